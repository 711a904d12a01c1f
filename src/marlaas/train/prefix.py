"""Rows that start with the same prompt share its forward (the samples of a GRPO group).

A micro-batch holds a group's samples as rows that each start with the group's prompt.
Under causal attention the prompt's keys and values do not depend on what follows it,
so the prompt is run once per distinct prompt and its cache is shared by its rows:

1. prefix pass: the distinct prefixes (each prompt but its last token), left-padded, one
   row each, under its tenant's LoRA lane; the cache is kept (with its autograd graph);
2. suffix pass: each row's remaining positions (the prompt's last token, whose logits
   predict the first sampled token, then the trajectory), right-padded, attending to its
   prefix's cache rows (`index_select`: the gradients of a group's rows add up in its
   one prefix).

Column `j` of the suffix layout is column `start_B[b] + j` of the row's full layout, and
every valid target lies in the suffix (prompt targets never carry a loss), so the loss
sees the same targets with the same log-probs, up to floating-point rounding, and the
gradient is the full forward's.

Sliding-window layers (Mistral, Qwen2/3, Gemma2/3) keep every prefix token in the cache;
the window is the attention mask's, measured in columns. A prefix is left-padded to end
at column `P` and its suffix starts there, so the column distance between a suffix token
and a prefix token is their position distance: the window sees what it sees in the full
forward.

It is used only where it saves enough tokens to pay for its second forward: distinct
prefixes x the longest prefix plus rows x the longest suffix must be at most `MAX_COST`
of rows x the micro-batch's length, and at least `MIN_SAVED` tokens fewer. Measured on
the embedded base (CPU, 1 thread; groups of 4 rows, whole groups in one micro-batch):
32 tenants at a cost of 0.62 took 0.70 of the plain forward's time, at 0.85 0.92; one
tenant (4 rows, 24-32 tokens each) saving 24-72 tokens took 1.06-1.37 of it, as the
second forward and backward cost about 8 ms more whatever their size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from marlaas.model.cache import cache_tensors, empty_cache, wrap_cache
from marlaas.model.lane_layers import LaneBatch
from marlaas.model.lora import LoRAModel
from marlaas.train.decoder import RowGather, TokenLogits, TrainDecoder
from marlaas.train.rows import MicroBatch, Rows

#: Largest cost of the shared forward, relative to the plain one, for it to be used.
MAX_COST = 0.85
#: Fewest tokens the shared forward must save over the plain one to be used.
MIN_SAVED = 128


@dataclass(frozen=True)
class SharedPrefix:
    """How one micro-batch's rows share their prompts' forwards (see the module doc)."""

    #: Per row: its prefix's length, i.e. the full-layout column of suffix column 0.
    start_B: Tensor
    #: Per row: the index of its prefix among the distinct ones.
    group_B: Tensor
    #: The distinct prefixes, left-padded, with their attention mask and positions.
    ids_GP: Tensor
    attn_GP: Tensor
    pos_GP: Tensor
    #: The LoRA lane of each prefix (its rows' tenant).
    lane_G: Tensor
    #: Per row: which suffix columns hold positions of the row.
    valid_BS: Tensor

    @staticmethod
    def plan(rows: Rows, micro: MicroBatch) -> SharedPrefix | None:
        """The sharing plan of `micro`, or None where sharing would not save tokens."""
        idx_B = micro.rows_B
        B, T = int(idx_B.shape[0]), micro.length
        start_B = rows.prompt_len_N[idx_B] - 1
        if B < 2 or int(start_B.min()) < 1:  # an empty prefix has nothing to share
            return None
        groups, group_B = torch.unique(rows.prompt_N[idx_B], return_inverse=True)
        G = int(groups.shape[0])
        P = int(start_B.max())
        suffix_B = rows.lengths_N[idx_B] - start_B
        S = int(suffix_B.max())
        cost = G * P + B * S
        if G == B or cost > MAX_COST * B * T or B * T - cost < MIN_SAVED:
            return None
        # The first row of each group stands for it (its prompt is the group's prompt).
        first_G = torch.full((G,), B, dtype=torch.long).scatter_reduce_(
            0, group_B, torch.arange(B), "amin"
        )
        len_G = start_B[first_G]
        col_GP = torch.arange(P) - (P - len_G)[:, None]  # left padding: negative columns
        attn_GP = col_GP >= 0
        ids_GP = rows.input_ids_NT[idx_B[first_G]].gather(1, col_GP.clamp(min=0))
        return SharedPrefix(
            start_B=start_B,
            group_B=group_B,
            ids_GP=torch.where(attn_GP, ids_GP, 0),
            attn_GP=attn_GP.long(),
            pos_GP=col_GP.clamp(min=0),
            lane_G=micro.lane_B[first_G],
            valid_BS=torch.arange(S) < suffix_B[:, None],
        )

    @property
    def length(self) -> int:
        """Columns of the suffix layout."""
        return int(self.valid_BS.shape[1])

    def suffix(self, x_BT: Tensor) -> Tensor:
        """The suffix layout of a full-layout `[B, T]` tensor (zeros outside the rows)."""
        T = x_BT.shape[1]
        col_BS = (self.start_B[:, None] + torch.arange(self.length)).clamp(max=T - 1)
        out_BS = x_BT.gather(1, col_BS.to(x_BT.device))
        return torch.where(self.valid_BS.to(x_BT.device), out_BS, torch.zeros_like(out_BS))

    def logits(
        self,
        model: LoRAModel,
        lanes: LaneBatch,
        ids_BS: Tensor,
        decoder: TrainDecoder | None = None,
    ) -> TokenLogits:
        """Logits of the suffix tokens `ids_BS`, each row under its lane in
        `lanes`, after its prefix (the two passes of the module doc); through the
        compact `decoder` where given, else the model's modules."""
        dev = ids_BS.device
        prefix_lanes = dataclasses.replace(lanes, lane_B=self.lane_G.to(dev))
        ids_GP, attn_GP, pos_GP = (x.to(dev) for x in (self.ids_GP, self.attn_GP, self.pos_GP))
        if decoder is not None:
            _, prefix = decoder.forward(
                ids_GP, attn_GP, pos_GP, keep_cache=True, last_only=True, lanes=prefix_lanes
            )
        else:
            with model.lanes(prefix_lanes):
                out = model.base(
                    input_ids=ids_GP,
                    attention_mask=attn_GP,
                    position_ids=pos_GP,
                    past_key_values=empty_cache(),  # sliding-window layers keep every token
                    use_cache=True,
                    logits_to_keep=1,
                )
                prefix = list(zip(*cache_tensors(out.past_key_values), strict=True))
        group_B = self.group_B.to(dev)
        attn_BPS = torch.cat([attn_GP[group_B], self.valid_BS.long().to(dev)], 1)
        pos_BS = self.start_B.to(dev)[:, None] + torch.arange(self.length, device=dev)
        if decoder is not None:
            return decoder.forward(
                ids_BS, attn_BPS, pos_BS, past=prefix, lanes=lanes, past_rows=group_B
            )[0]
        past = [(RowGather.apply(k, group_B), RowGather.apply(v, group_B)) for k, v in prefix]
        with model.lanes(lanes):
            logits: Tensor = model.base(
                input_ids=ids_BS,
                attention_mask=attn_BPS,
                position_ids=pos_BS,
                past_key_values=wrap_cache([k for k, _ in past], [v for _, v in past]),
                use_cache=True,
            ).logits
            return TokenLogits(logits)
