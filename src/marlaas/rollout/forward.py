"""The engine's two forwards over its slot cache: prefill new rows, decode every row.

Both run the model on a few new tokens per cache row, each row with its own adapter
slot, and write the new keys and values in place into the slot cache (`SlotKV`);
attention goes through `marlaas.model.attention` with one `AttentionPlan` per forward
(each row sees its own columns, within each layer's window). The model is the compact
decoder (`marlaas.rollout.decoder`) where it covers the base, else the Hugging Face
modules (with the cache as `SlotKV.cache`).

- decode: rows `0 .. B-1`, one token each, at position = the row's cache length;
- prefill: rows `row0 ..`, the new prompt tokens of each row left-padded, so the last
  column holds every row's last token (`logits_to_keep=1`, or every position's logits
  when prompt log-probs are wanted), after the `past` tokens already in its row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from marlaas.model.attention import PLAN_KWARG, AttentionPlan, install_attention
from marlaas.model.bank import AdapterBank
from marlaas.model.kernels import torch_path_on
from marlaas.model.lora import LoRAModel
from marlaas.rollout.batch import RowBatch
from marlaas.rollout.decoder import CompactDecoder
from marlaas.rollout.kv import SlotKV


class RowForward:
    """The engine's forwards over its slot cache `kv`, each row with its adapter slot in
    `bank`: through the compact decoder where it covers the base
    (`marlaas.rollout.decoder`), else through the Hugging Face modules."""

    def __init__(self, model: LoRAModel, bank: AdapterBank, kv: SlotKV) -> None:
        self.model = model
        self.bank = bank
        self.kv = kv
        install_attention(model.base)  # the modules' path attends through the plan
        self.decoder = CompactDecoder.of(model)

    @property
    def native(self) -> bool:
        """Whether the forwards' layers run in one native call (`rollout.native`)."""
        return self.decoder is not None and self.decoder.native is not None

    def rows(
        self,
        row0: int,
        slot_R: Tensor,
        ids_RN: Tensor,
        positions_RN: Tensor,
        columns: int,
        all_logits: bool = False,
    ) -> Tensor:
        """Logits `[R, N or 1, V]` of new tokens `ids_RN` at `positions_RN` (-1: padding)
        of cache rows `row0 .. row0 + R`, attending to their first `columns` columns."""
        model, kv = self.model, self.kv
        plan = AttentionPlan.build(positions_RN, columns, kv.geometry.windows)
        decoder = None if torch_path_on() else self.decoder
        # Inference mode, not just no_grad: no version counters or view tracking, which a
        # forward of ~2,000 small ops pays for (in-process A/B on the embedded base,
        # median iteration: 1 row 6.42 vs 7.23 ms, 64 rows 12.8 vs 14.9, 256 rows 30.5 vs
        # 33.0). The cache buffers and the bank's slots are allocated outside it, so they
        # stay ordinary tensors that later in-place writes may update.
        with torch.inference_mode(), model.lanes(self.bank.slot_lanes(slot_R)):
            if decoder is not None:
                return decoder.forward(kv, row0, ids_RN, positions_RN, plan, all_logits)
            # A 4-D mask is taken as given: Hugging Face builds no mask of its own (ours
            # is in the plan, one per window).
            out = model.base(
                input_ids=ids_RN,
                attention_mask=plan.mask(kv.geometry.windows[0]),
                position_ids=positions_RN.clamp(min=0),
                past_key_values=kv.cache(row0, positions_RN, columns),
                use_cache=True,
                logits_to_keep=0 if all_logits else 1,
                **{PLAN_KWARG: plan},
            )
        logits: Tensor = out.logits
        return logits

    def decode(self, batch: RowBatch) -> Tensor:
        """Feed every row's pending token into its cache row; `logits_BV`."""
        columns = batch.max_length + 1
        self.kv.reserve(batch.size, columns)
        pos_B1 = batch.lengths_B.unsqueeze(-1)
        logits = self.rows(0, batch.slot_B, batch.next_B.unsqueeze(-1), pos_B1, columns)
        batch.lengths_B += 1
        return logits[:, -1]

    def prefill(
        self,
        row0: int,
        slot_R: Tensor,
        past: Sequence[int],
        new_tokens: Sequence[Sequence[int]],
        pad_id: int,
        all_logits: bool = False,
    ) -> Tensor:
        """Prefill rows `row0 ..`: row i has `past[i]` tokens in its cache row already and
        `new_tokens[i]` to run. Logits `[R, 1, V]` of each row's last token, or `[R, N,
        V]` of every column with `all_logits` (row i's tokens are its last
        `len(new_tokens[i])`)."""
        dev = slot_R.device
        R, N = len(new_tokens), max(len(t) for t in new_tokens)
        # Padded in Python, one tensor each: not four ops a row.
        ids_RN = torch.tensor(
            [[pad_id] * (N - len(toks)) + list(toks) for toks in new_tokens], dtype=torch.long
        )
        pos_RN = torch.tensor(
            [
                [-1] * (N - len(toks)) + list(range(done, done + len(toks)))
                for done, toks in zip(past, new_tokens, strict=True)
            ],
            dtype=torch.long,
        )
        columns = max(p + len(t) for p, t in zip(past, new_tokens, strict=True))
        self.kv.reserve(row0 + R, columns)
        return self.rows(row0, slot_R, ids_RN.to(dev), pos_RN.to(dev), columns, all_logits)
