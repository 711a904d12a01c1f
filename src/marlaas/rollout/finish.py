"""When a row is finished, and what its `Completion` says.

A row finishes on the first of: an EOS token, a stop string in the decoded text of its
new tokens, its token limit (`max_new_tokens`, or the model's last position).

Stop strings are checked every iteration on the decoded text of the row's last
`window` tokens (enough tokens to spell the longest stop string in bytes, plus a
margin), and confirmed on the full decoded text; the text is cut before the first
occurrence. Only rows with stop strings do this per-row work; EOS and length are
batched tensor checks. A stop string that a new token completes ends in that token's
text, so where the tokenizer decodes a sequence as the concatenation of its tokens'
texts (a plain fast tokenizer) and every stop string ends in an ASCII character, only
the rows whose new token's text holds one of those last characters are decoded: a
lookup over the vocabulary, made once per character, picks them in one tensor op (a
row ends at a newline: most iterations decode no row at all).

`Completion` fields: `token_ids` holds every sampled token, including the EOS token or
the token that completed the stop string; `logprobs` is aligned with it; `text` is the
decoded text (special tokens skipped) without the EOS and without the stop string and
anything after it; `version` is the adapter version pinned at admission.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from marlaas.rollout.batch import RowBatch
from marlaas.types import Completion, FinishReason

#: Extra tokens decoded before a stop string's worst-case span (byte-level tokens).
_STOP_MARGIN = 3


class FinishPolicy:
    """EOS ids, stop-string checks and completion building, for one tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self._eos_t: Tensor | None = None
        # A fast tokenizer whose decode is its Rust backend's with nothing around it (no
        # override, no clean-up) decodes many rows in one call: the same texts, without
        # the Python of a `decode` per row (1.48 -> 0.41 ms for 200 tails of 12 tokens).
        plain = (
            isinstance(tokenizer, TokenizersBackend)
            and type(tokenizer)._decode is TokenizersBackend._decode
            and not tokenizer.clean_up_tokenization_spaces
        )
        self._decode_batch = tokenizer.backend_tokenizer.decode_batch if plain else None
        #: Each token id's text, decoded once where the stop filter applies (`_holding`).
        self._token_texts: list[str] | None = None
        #: Per set of characters and device, which token ids' texts hold one; bool [V].
        self._holds: dict[tuple[frozenset[str], torch.device], Tensor] = {}

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def decode_many(self, seqs: list[list[int]]) -> list[str]:
        """`decode` of each of `seqs`, in one call where the tokenizer allows it."""
        if self._decode_batch is None:
            return [self.decode(ids) for ids in seqs]
        return [str(text) for text in self._decode_batch(seqs, skip_special_tokens=True)]

    @staticmethod
    def window(stop: Sequence[str]) -> int:
        """Tokens to decode for the stop check (0 when there are no stop strings)."""
        if not stop:
            return 0
        return max(len(s.encode("utf-8")) for s in stop) + _STOP_MARGIN

    def done_B(self, batch: RowBatch, tokens_B: Tensor) -> tuple[Tensor, Tensor]:
        """`(done_B, eos_B)` after `tokens_B` was recorded; sets `stop_text` on rows that a
        stop string ended."""
        if self.eos_ids:
            if self._eos_t is None or self._eos_t.device != tokens_B.device:
                self._eos_t = torch.tensor(self.eos_ids, dtype=torch.long, device=tokens_B.device)
            eos_B = torch.isin(tokens_B, self._eos_t)
        else:
            eos_B = torch.zeros_like(tokens_B, dtype=torch.bool)
        done_B = eos_B | (batch.n_gen_B >= batch.max_new_B)
        if batch.n_stop:
            self._check_stops(batch, tokens_B, done_B)
        return done_B, eos_B

    def _check_stops(self, batch: RowBatch, tokens_B: Tensor, done_B: Tensor) -> None:
        rows_R = batch.stop_rows_R
        holds_V = self._holding(batch.stop_ends, tokens_B.device)
        if holds_V is not None:  # only the rows whose new token may complete a stop string
            V = holds_V.shape[0]
            new_R = tokens_B[rows_R]
            rows_R = rows_R[torch.where(new_R < V, holds_V[new_R.clamp(max=V - 1)], True)]
            if not len(rows_R):
                return
        rows = rows_R.tolist()
        n_R = batch.n_gen_B[rows_R]
        counts = n_R.tolist()
        w = max(batch.rows[i].stop_window for i in rows)
        pos_RW = (n_R[:, None] - w + torch.arange(w, device=n_R.device)).clamp(min=0)
        window_RW = batch.tokens_BN[rows_R[:, None], pos_RW].tolist()
        tails = [
            tail[w - min(n, batch.rows[i].stop_window) :]
            for i, n, tail in zip(rows, counts, window_RW, strict=True)
        ]
        recents = self.decode_many(tails)
        hits = [
            (i, n)
            for i, n, recent in zip(rows, counts, recents, strict=True)
            if any(s in recent for s in batch.rows[i].request.sampling.stop)
        ]
        if not hits:
            return
        # Confirmed on the rows' whole texts, decoded in one call.
        tokens = batch.tokens_BN[[i for i, _ in hits]].tolist()
        fulls = self.decode_many([ids[:n] for ids, (_, n) in zip(tokens, hits, strict=True)])
        stopped: list[int] = []
        for (i, _), full in zip(hits, fulls, strict=True):
            stops = batch.rows[i].request.sampling.stop
            cuts = [full.find(s) for s in stops if s in full]
            if cuts:
                batch.rows[i].stop_text = full[: min(cuts)]
                stopped.append(i)
        if stopped:  # one op, not one per row (each op may wait for the interpreter lock)
            done_B[torch.tensor(stopped, dtype=torch.long, device=done_B.device)] = True

    def _holding(self, chars: frozenset[str], device: torch.device) -> Tensor | None:
        """bool [V]: the token ids whose text holds one of `chars`; None where the filter
        does not apply (a tokenizer that does not decode by concatenation, a character
        past ASCII, which a token may hold only part of)."""
        if self._decode_batch is None or not chars or any(ord(c) > 127 for c in chars):
            return None
        key = (chars, device)
        if key not in self._holds:
            if self._token_texts is None:
                self._token_texts = self._decode_tokens()
            holds = [any(c in text for c in chars) for text in self._token_texts]
            self._holds[key] = torch.tensor(holds, dtype=torch.bool, device=device)
        return self._holds[key]

    def _decode_tokens(self) -> list[str]:
        """Each token id's text, decoded after a plain-text prefix (a token decoded alone
        may lose a leading space it has in context)."""
        prefix = list(self.tokenizer.encode("a", add_special_tokens=False))
        alone = self.decode_many([prefix])[0]
        texts = self.decode_many([[*prefix, t] for t in range(len(self.tokenizer))])
        return [t[len(alone) :] if t.startswith(alone) else t for t in texts]

    def completions(
        self, batch: RowBatch, rows: list[int], eos: list[bool], aborted: bool = False
    ) -> list[Completion]:
        idx = torch.tensor(rows, dtype=torch.long, device=batch.n_gen_B.device)
        counts = batch.n_gen_B[idx].tolist()
        tokens = batch.tokens_BN[idx].tolist()
        logprobs = batch.logprobs_BN[idx].tolist()
        ids_R = [tuple(tokens[j][: counts[j]]) for j in range(len(rows))]
        reasons = [_reason(batch.rows[i].stop_text, eos[j], aborted) for j, i in enumerate(rows)]
        # Every text but a stop string's cut, in one decode call (no EOS in an eos text).
        texts = iter(
            self.decode_many(
                [
                    list(ids[:-1] if r == "eos" else ids)
                    for ids, r in zip(ids_R, reasons, strict=True)
                    if r != "stop"
                ]
            )
        )
        out: list[Completion] = []
        for j, i in enumerate(rows):
            row, n, ids, reason = batch.rows[i], counts[j], ids_R[j], reasons[j]
            text = row.stop_text if row.stop_text is not None and reason == "stop" else next(texts)
            out.append(
                Completion(
                    request_id=row.request.request_id,
                    tenant=row.request.tenant,
                    version=row.handle.version,
                    prompt_len=len(row.request.prompt_ids),
                    token_ids=ids,
                    logprobs=tuple(logprobs[j][:n]),
                    text=text,
                    finish_reason=reason,
                    prompt_logprobs=row.prompt_logprobs,
                )
            )
        return out


def _reason(stop_text: str | None, eos: bool, aborted: bool) -> FinishReason:
    if aborted:
        return "aborted"
    if stop_text is not None:
        return "stop"
    return "eos" if eos else "length"
