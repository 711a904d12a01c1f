"""The synchronous heart of the rollout engine: one call of `DecodeScheduler.iterate`
is one iteration of continuous batching. No threads and no asyncio here; `RolloutEngine`
serialises the calls and owns the request queue.

One iteration:
1. abort the running rows named by the engine (cancelled futures);
2. admit queued requests, oldest first, while the batch has room and the prefill budget
   lasts: validate, pin the adapter (`bank.acquire`, which fixes the version for the
   request's whole life), take the session's cached KV when it can be continued;
   prefill the rest of every admitted prompt and sample the first tokens: a prompt
   prefilled recently under the same adapter version (a GRPO group's samples) is taken
   from the prompt cache (`marlaas.rollout.prompts`) or shared within the iteration,
   and prompts of similar length share a forward (bounded padding);
3. one decode forward over every running row, each with its own adapter slot, and one
   batched sampling call;
4. rows with a token listener get their new token (prefill and decode alike);
5. finished rows leave: the adapter pin is released, the KV may be kept for the
   session, the callback gets the `Completion`.

Invariants:
- Every admitted request is answered exactly once (its `deliver` is called with a
  `Completion` or an exception) and its adapter pin is released exactly once.
- An error in one request (bad prompt, unknown tenant) fails that request only; an
  error in a forward fails the rows of that forward only.
- A row's listener sees its tokens in order, each once, all before its `deliver`; a
  listener that raises is dropped (its row runs on, unstreamed), never failing others.
- A row's output depends on its own request only (prompt, adapter version, sampling
  params, seed), never on its batch mates or its admission time.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from marlaas.errors import CapacityError, InvalidRequest, MarlaasError
from marlaas.model.arch import context_length
from marlaas.model.bank import AdapterBank
from marlaas.model.lora import LoRAModel
from marlaas.rollout.batch import Deliver, Row, RowBatch, TokenListener
from marlaas.rollout.finish import FinishPolicy
from marlaas.rollout.forward import RowForward
from marlaas.rollout.kv import SlotKV, kv_geometry
from marlaas.rollout.prefill import Admitted, run_prefill
from marlaas.rollout.prompts import PromptCache
from marlaas.rollout.sampling import sample_B
from marlaas.rollout.sessions import SessionCache, SessionEntry
from marlaas.types import Completion, RolloutRequest


@dataclass
class EngineStats:
    """Counters since the engine started."""

    iterations: int = 0
    #: Prompt tokens run through the model (excluding padding and reused tokens).
    prefill_tokens: int = 0
    #: Prompt tokens not run because the same prompt under the same adapter version was
    #: prefilled in the same iteration or is in the prompt cache: its prefill is shared.
    shared_prefill_tokens: int = 0
    #: Prompt tokens whose KV came from a session's previous turn.
    reused_tokens: int = 0
    #: Row-steps of decode forwards (one per running row per iteration).
    decode_tokens: int = 0
    #: Tokens sampled (decode row-steps plus the first token of each prefilled row).
    sampled_tokens: int = 0
    completed: int = 0
    failed: int = 0
    aborted: int = 0
    #: The largest number of rows that ran together.
    max_batch: int = 0


@dataclass
class Pending:
    """A queued request, the callback that answers it and its token listener."""

    request: RolloutRequest
    deliver: Deliver
    listener: TokenListener | None = None


class DecodeScheduler:
    """Admission, prefill, decode and completion over one `RowBatch` (not thread-safe)."""

    def __init__(
        self,
        model: LoRAModel,
        bank: AdapterBank,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int,
        max_prefill_tokens: int,
        sessions: SessionCache,
        prompts: PromptCache,
        eos_token_ids: Sequence[int] | None,
        seed: int | None,
    ) -> None:
        if max_batch_size < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch_size and max_prefill_tokens must be >= 1")
        self.model = model
        self.bank = bank
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.sessions = sessions
        self.prompts = prompts
        self.stats = EngineStats()
        config = model.base.config
        geometry = kv_geometry(config)
        self._vocab = int(config.get_text_config(decoder=True).vocab_size)
        self._max_positions = context_length(config)
        self.kv = SlotKV(
            geometry, model.kv_dtype, model.device, max_batch_size, self._max_positions
        )
        self.forward = RowForward(model, bank, self.kv)
        self.batch = self._empty_batch()
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad) if isinstance(pad, int) else 0
        self._finisher = FinishPolicy(tokenizer, _eos_ids(model, tokenizer, eos_token_ids))
        self._rng = random.Random(seed)

    @property
    def room(self) -> int:
        """How many more rows the batch can take."""
        return max(self.max_batch_size - self.batch.size, 0)

    def iterate(self, candidates: list[Pending], aborts: set[str]) -> tuple[int, list[Pending]]:
        """One iteration over the oldest queued requests (at most `room` of them); returns
        (tokens sampled, candidates to queue again, in order)."""
        if aborts:
            self._abort_rows(aborts)
        admitted, back = self._admit(candidates)
        advanced = self._prefill(admitted) if admitted else 0
        if self.batch.size:
            advanced += self._decode()
        if advanced:
            self.stats.iterations += 1
        return advanced, back

    def _empty_batch(self) -> RowBatch:
        return RowBatch.build([], [], [], [], self.model.device)

    def fail_all(self, exc: BaseException) -> None:
        """Fail every running row with `exc` and empty the batch."""
        batch, self.batch = self.batch, self._empty_batch()
        self.kv.release()
        for row in batch.rows:
            self._release(row)
            self.fail(row.deliver, exc)

    def fail(self, deliver: Deliver, exc: BaseException) -> None:
        self.stats.failed += 1
        _call(deliver, exc)

    # -- admission and prefill ------------------------------------------------------------

    def _admit(self, candidates: list[Pending]) -> tuple[list[Admitted], list[Pending]]:
        room = self.room
        taken: list[Admitted] = []
        back: list[Pending] = []
        budget = self.max_prefill_tokens
        charged: set[tuple[str, int | None, tuple[int, ...]]] = set()  # shared prefills
        for i, pending in enumerate(candidates):
            request = pending.request
            key = (request.tenant, request.version, request.prompt_ids)
            cost = 0 if key in charged else len(request.prompt_ids)
            if len(taken) >= room or (taken and cost > budget):
                back.extend(candidates[i:])
                break
            try:
                max_new = self._validate(request)
                handle = self.bank.acquire(request.tenant, request.version)
            except CapacityError as exc:
                if self.batch.size == 0 and not taken:  # nothing running would free a slot
                    self.fail(pending.deliver, exc)
                else:
                    back.append(pending)
                continue
            except Exception as exc:
                self.fail(pending.deliver, exc)
                continue
            reused, past = 0, None
            # Prompt log-probs need the whole prompt run: no session cache for those.
            if request.session is not None and not request.sampling.prompt_logprobs:
                reused, past = self.sessions.take(
                    request.session, request.tenant, handle.version, request.prompt_ids
                )
            budget -= cost
            charged.add(key)
            row = Row(request, handle, pending.deliver, reused=reused, listener=pending.listener)
            row.stop_window = self._finisher.window(request.sampling.stop)
            seed = request.sampling.seed
            taken.append(
                Admitted(
                    row=row,
                    past=past,
                    new_tokens=request.prompt_ids[reused:],
                    seed=_int64(seed if seed is not None else self._rng.getrandbits(63)),
                    max_new=max_new,
                )
            )
        return taken, back

    def _validate(self, request: RolloutRequest) -> int:
        """Raise `InvalidRequest` unless the model can serve it; the row's token limit."""
        prompt = request.prompt_ids
        if not prompt:
            raise InvalidRequest(f"request {request.request_id}: the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= self._vocab:
            raise InvalidRequest(
                f"request {request.request_id}: prompt token ids must be in [0, {self._vocab})"
            )
        limit = request.sampling.max_new_tokens
        if self._max_positions is not None:
            if len(prompt) > self._max_positions:
                raise InvalidRequest(
                    f"request {request.request_id}: the prompt has {len(prompt)} tokens, the "
                    f"model at most {self._max_positions} positions; shorten the prompt"
                )
            # The last sampled token is never fed, so it needs no position.
            limit = min(limit, self._max_positions - len(prompt) + 1)
        return limit

    def _prefill(self, admitted: list[Admitted]) -> int:
        """Prefill the admitted rows into the cache rows after the running ones
        (`marlaas.rollout.prefill`) and sample their first tokens; a failed forward
        fails its rows only."""
        B0 = self.batch.size
        result = run_prefill(self.forward, self.prompts, admitted, B0, self._pad_id)
        for a, exc in result.failed:
            self._release(a.row)
            self.fail(a.row.deliver, exc)
        self.stats.prefill_tokens += result.prefill_tokens
        self.stats.shared_prefill_tokens += result.shared_tokens
        if not result.ok or result.logits_RV is None:
            return 0
        done = result.ok
        rows = [a.row for a in done]
        self.stats.reused_tokens += sum(r.reused for r in rows)
        new = RowBatch.build(
            rows,
            [len(r.request.prompt_ids) for r in rows],
            [a.seed for a in done],
            [a.max_new for a in done],
            self.model.device,
        )
        finished = self._sample_and_finish(new, result.logits_RV)
        self.batch = RowBatch.concat(self.batch, new)
        self._drop([B0 + i for i in finished])
        self.stats.max_batch = max(self.stats.max_batch, self.batch.size)
        return len(rows)

    # -- decode and completion ------------------------------------------------------------

    def _decode(self) -> int:
        batch = self.batch
        try:
            logits_BV = self.forward.decode(batch)
        except Exception as exc:
            self.fail_all(exc)
            return 0
        self.stats.decode_tokens += batch.size
        self._drop(self._sample_and_finish(batch, logits_BV))
        return batch.size

    def _sample_and_finish(self, batch: RowBatch, logits_BV: torch.Tensor) -> list[int]:
        """Sample one token per row, record it, and complete the rows it finished; their
        positions in `batch` (still there: `_drop` removes them)."""
        # Greedy-only batches draw nothing; any float tensor of the right shape will do.
        u_B = (
            batch.uniform_BN.gather(1, batch.n_gen_B.unsqueeze(-1)).squeeze(-1)
            if batch.n_sampling
            else batch.top_p_B
        )
        tokens_B, logprobs_B = sample_B(
            logits_BV,
            batch.temperature_B,
            batch.top_k_B,
            batch.top_p_B,
            u_B,
            all_greedy=batch.n_sampling == 0,
            any_filter=batch.n_filter > 0,
        )
        batch.record(tokens_B, logprobs_B)
        self.stats.sampled_tokens += batch.size
        if batch.n_listen:
            _stream_tokens(batch, tokens_B)
        done_B, eos_B = self._finisher.done_B(batch, tokens_B)
        if not bool(done_B.any()):
            return []
        finished: list[int] = done_B.nonzero().squeeze(-1).tolist()
        self._complete(batch, finished, eos_B[finished].tolist(), aborted=False)
        return finished

    def _drop(self, gone: Sequence[int]) -> None:
        """Remove rows `gone` from the batch: the last surviving rows move into their
        cache rows, so the batch stays rows `0 .. B-1` and nothing else moves."""
        if not gone:
            return
        batch, out = self.batch, set(gone)
        n = batch.size - len(out)
        holes = [i for i in range(n) if i in out]
        movers = [i for i in range(n, batch.size) if i not in out]
        order = list(range(n))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        if movers:
            columns = int(batch.lengths_B[movers].max())
            self.kv.move_rows(holes, movers, columns)
        self.batch = batch.select(order)
        if not order:  # an idle engine holds no cache (the trainer may want the memory)
            self.kv.release()

    def _abort_rows(self, ids: set[str]) -> None:
        batch = self.batch
        hit = [i for i, row in enumerate(batch.rows) if row.request.request_id in ids]
        if hit:
            self._complete(batch, hit, [False] * len(hit), aborted=True)
            self._drop(hit)

    def _complete(self, batch: RowBatch, rows: list[int], eos: list[bool], aborted: bool) -> None:
        """Build the rows' completions, keep session KV, release the pins, deliver."""
        completions = self._finisher.completions(batch, rows, eos, aborted=aborted)
        for i, completion in zip(rows, completions, strict=True):
            row = batch.rows[i]
            if row.request.session is not None and not aborted:
                self._keep_session(batch, i, completion)
            self._release(row)
            if aborted:
                self.stats.aborted += 1
            else:
                self.stats.completed += 1
            _call(row.deliver, completion)

    def _keep_session(self, batch: RowBatch, i: int, completion: Completion) -> None:
        request = batch.rows[i].request
        assert request.session is not None
        tokens = request.prompt_ids + completion.token_ids[:-1]
        length = int(batch.lengths_B[i])
        if length != len(tokens):  # a broken invariant must not poison reuse
            return
        kv = self.kv.export_rows([i], [length])[0]
        self.sessions.put(
            request.session, SessionEntry(request.tenant, completion.version, tokens, kv)
        )

    def _release(self, row: Row) -> None:
        with contextlib.suppress(MarlaasError):  # already released: nothing left to undo
            self.bank.release(row.handle)


def _stream_tokens(batch: RowBatch, tokens_B: torch.Tensor) -> None:
    """Hand each listening row its new token; a listener that raises is dropped."""
    rows = batch.listen_rows
    for i, token in zip(rows, tokens_B[rows].tolist(), strict=True):
        row = batch.rows[i]
        if row.listener is None:
            continue
        try:
            row.listener(token)
        except Exception:  # the consumer's fault: its row runs on without a stream
            row.listener = None


def _call(deliver: Deliver, result: Completion | BaseException) -> None:
    with contextlib.suppress(Exception):  # a caller's callback must not break the batch
        deliver(result)


def _int64(seed: int) -> int:
    """Any Python int as the int64 with the same low 64 bits."""
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _eos_ids(
    model: LoRAModel, tokenizer: PreTrainedTokenizerBase, given: Sequence[int] | None
) -> list[int]:
    """`given`, else the tokenizer's EOS and the model's generation-config EOS ids."""
    if given is not None:
        return sorted(set(given))
    ids: set[int] = set()
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    extra = getattr(getattr(model.base, "generation_config", None), "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, list | tuple):
        ids.update(int(x) for x in extra)
    return sorted(ids)
