"""Prefill of the rows admitted in one iteration, into cache rows `row0 ..`.

Each distinct prompt runs once: the first row with a given adapter (`adapter_id`) and
prompt and no session cache is its *source*; later rows with the same ones (a GRPO
group's samples) *share* it, and a prompt prefilled in an earlier iteration comes from
the prompt cache (`marlaas.rollout.prompts`). The sources run in forwards of similar
lengths, longest first, cut where the padding costs less than another forward
(`marlaas.packing.pack_cheapest`), a forward costing `FORWARD_TOKENS` padded tokens
whatever its size. Measured by replaying the 836 iterations' admitted rows of a `bench
paper --tenants 32 --regime paper` run (embedded base, one CPU thread, thread CPU time,
mean of two rounds): forwards padded at most a quarter 13.0 s (1,266 forwards, 193k
padded tokens); the cheapest cut at 24 / 48 / 112 tokens a forward 11.9 / 11.1 / 11.2 s
(1,142 / 935 / 744 forwards); one forward per iteration 17.4 s (441, 367k).

Cache rows: every forward's sources take consecutive rows, then the prompt-cache hits,
then the sharers; a row with a session cache gets it written into its row first. After
the forwards each surviving row's cache row is filled by one batched move (a sharer
copies its source's row; rows after a failed forward close the gap), so the survivors
end up in rows `row0 .. row0 + len(ok) - 1`, in `ok` order.

Rows that ask for prompt log-probs (`SamplingParams.prompt_logprobs`) never share nor
take a cached prefill (only a forward over the whole prompt computes them) and run in
forwards of their own, which keep every position's logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from marlaas.packing import pack_cheapest
from marlaas.rollout.batch import Row
from marlaas.rollout.forward import RowForward
from marlaas.rollout.kv import RowKV
from marlaas.rollout.prompts import PromptCache, PromptEntry

#: A prefill forward's fixed cost, in padded tokens of prefill (module doc).
FORWARD_TOKENS = 64


@dataclass
class Admitted:
    """A row admitted this iteration, before its prefill."""

    row: Row
    past: RowKV | None
    new_tokens: tuple[int, ...]
    seed: int
    max_new: int

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.row.request.sampling.prompt_logprobs


@dataclass
class PrefillResult:
    """The rows now in cache rows `row0 ..` (in order), their last logits `[R, V]`, the
    rows whose forward failed, and token counts for the engine's stats."""

    ok: list[Admitted]
    logits_RV: Tensor | None
    failed: list[tuple[Admitted, BaseException]] = field(default_factory=list)
    prefill_tokens: int = 0
    shared_tokens: int = 0


def plan_prefill(
    admitted: Sequence[Admitted], cached: set[int]
) -> tuple[list[int], list[list[int]]]:
    """Which prompts to prefill, and in which forwards: `(source, forwards)`.

    `source[i]` is the admitted index whose prefill row `i` shares, else `i` itself.
    `forwards` splits the sources that are not `cached` (found in the prompt cache),
    longest first, into the forwards of least cost (`FORWARD_TOKENS` each plus their
    padded tokens); rows that want prompt log-probs form forwards of their own.
    """
    first: dict[tuple[int, tuple[int, ...]], int] = {}
    source: list[int] = []
    for i, a in enumerate(admitted):
        if a.past is None and not a.wants_prompt_logprobs:
            source.append(first.setdefault((a.row.handle.adapter_id, a.new_tokens), i))
        else:
            source.append(i)
    forwards: list[list[int]] = []
    for wants in (False, True):
        order = sorted(
            (i for i in set(source) - cached if admitted[i].wants_prompt_logprobs == wants),
            key=lambda i: -len(admitted[i].new_tokens),
        )
        spans = pack_cheapest([len(admitted[i].new_tokens) for i in order], FORWARD_TOKENS)
        forwards.extend(order[start:end] for start, end in spans)
    return source, forwards


def run_prefill(
    forward: RowForward,
    prompts: PromptCache,
    admitted: Sequence[Admitted],
    row0: int,
    pad_id: int,
) -> PrefillResult:
    """Prefill `admitted` into cache rows `row0 ..` (see the module doc)."""
    kv = forward.kv
    hits: dict[int, PromptEntry] = {}
    for i, a in enumerate(admitted):
        if a.past is None and not a.wants_prompt_logprobs:
            entry = prompts.get(a.row.handle.adapter_id, a.new_tokens)
            if entry is not None:
                hits[i] = entry
    source, forwards = plan_prefill(admitted, set(hits))
    cached = sorted(i for i in hits if source[i] == i)
    order = [i for f in forwards for i in f] + cached
    order += [i for i in range(len(admitted)) if source[i] != i]
    row_of = {i: row0 + k for k, i in enumerate(order)}
    columns = max(len(a.row.request.prompt_ids) for a in admitted)
    # Room for the rows' lives (the last sampled token is never fed), up to twice the
    # prompts: short generations never grow the buffers during decode, and one request
    # asking for many tokens does not make every row reserve them (decode grows the
    # buffers geometrically when a row gets there).
    life = max(len(a.row.request.prompt_ids) + a.max_new - 1 for a in admitted)
    kv.reserve(row0 + len(order), min(life, 2 * columns + 64))
    pasts = [(row_of[i], a.past) for i, a in enumerate(admitted) if a.past is not None]
    pasts += [(row_of[i], hits[i].kv) for i in cached]
    kv.import_rows([row for row, _ in pasts], [past for _, past in pasts])

    result = PrefillResult(ok=[], logits_RV=None)
    logits_of: dict[int, Tensor] = {i: hits[i].logits_V for i in cached}
    kept: list[int] = []  # the prompts run whose prefills the prompt cache keeps
    for group in forwards:
        firsts = [admitted[i] for i in group]
        slot_R = torch.tensor([a.row.handle.slot for a in firsts], device=kv.device)
        all_logits = any(a.wants_prompt_logprobs for a in firsts)
        try:
            logits_RNV = forward.prefill(
                row_of[group[0]],
                slot_R,
                [a.row.reused for a in firsts],
                [a.new_tokens for a in firsts],
                pad_id,
                all_logits=all_logits,
            )
        except Exception as exc:  # this forward's rows and their sharers fail, no others
            members = set(group)
            result.failed += [(a, exc) for k, a in enumerate(admitted) if source[k] in members]
            continue
        for j, (i, a) in enumerate(zip(group, firsts, strict=True)):
            logits_of[i] = logits_RNV[j, -1]
            if a.wants_prompt_logprobs:
                a.row.prompt_logprobs = _prompt_logprobs(logits_RNV[j], a.new_tokens)
            if a.past is None:
                kept.append(i)
        result.prefill_tokens += sum(len(a.new_tokens) for a in firsts)
    # Copies for the prompt cache, all in two ops, before the moves below fill the rows.
    kvs = kv.export_rows([row_of[i] for i in kept], [len(admitted[i].new_tokens) for i in kept])
    lasts = torch._foreach_clone([logits_of[i] for i in kept]) if kept else []
    for i, row_kv, logits_V in zip(kept, kvs, lasts, strict=True):
        a = admitted[i]
        prompts.put(a.row.handle.adapter_id, a.new_tokens, PromptEntry(row_kv, logits_V))

    ok = [i for i in order if source[i] in logits_of]
    moves = [(row0 + k, row_of[source[i]]) for k, i in enumerate(ok)]
    moves = [(dst, src) for dst, src in moves if dst != src]
    kv.move_rows([d for d, _ in moves], [s for _, s in moves], columns)
    result.ok = [admitted[i] for i in ok]
    if ok:
        result.logits_RV = torch.stack([logits_of[source[i]] for i in ok])
    result.shared_tokens = sum(
        len(admitted[i].new_tokens) for i in ok if source[i] != i or i in hits
    )
    return result


def _prompt_logprobs(logits_NV: Tensor, tokens: Sequence[int]) -> tuple[float, ...]:
    """log p(tokens[i] | tokens[:i]) at temperature 1 from a row's left-padded logits
    (its tokens are the last `len(tokens)` columns); entry 0 is 0.0."""
    n = len(tokens)
    if n < 2:
        return (0.0,) * n
    logp = torch.log_softmax(logits_NV[-n:-1].float(), dim=-1)
    target = torch.tensor(tokens[1:], dtype=torch.long, device=logp.device)
    picked = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return (0.0, *picked.tolist())
