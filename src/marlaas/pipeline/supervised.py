"""A supervised (SFT) tenant: its data, its step, its eval and its driver loop.

A supervised job is an ordinary tenant of the pipeline (same admission, device port,
checkpoints, PEFT export, progress records) whose work has no rollouts: each step
trains `algorithm.batch_size` examples of its dataset with the cross-entropy objective
(`marlaas.train.sft`). `SupervisedRuntime` is `TenantRuntime` with the data and the
step replaced; `run` is its driver, which the orchestrator picks by algorithm type.

Invariants:
- The data stream is a pure function of the job: example `i` of the stream is row
  `order_e[i mod n]` of the train split, where `order_e` is epoch `e = i // n`'s
  permutation drawn from the job's seed. The tenant's `cursor` counts examples
  consumed, and a checkpoint stores it, so a resume trains the same next example.
- One step is exactly `forward_backward` of the step's batch, then `optim_step`; the
  version goes up by one per step (`TenantState.advance`).
- Every example fits the trainer's micro-batch budget and the base's context (checked
  when the data load).
- Eval is `forward` (no gradient) at one adapter version on the held-out rows: mean
  token NLL (`EvalDone.loss`) and token accuracy (`EvalDone.accuracy`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from marlaas.config.job import DatasetSpec, JobSpec
from marlaas.config.specs import SFTSpec
from marlaas.envs.conversations import Conversation, in_format, load_conversations
from marlaas.envs.datasets import split_examples
from marlaas.errors import ConfigError, DataError, ModelError
from marlaas.model.arch import context_length
from marlaas.obs.progress import EvalDone, StepDone, StepMetrics
from marlaas.pipeline.context import PipelineContext
from marlaas.pipeline.lifecycle import TenantRuntime
from marlaas.pipeline.tenant import JobStatus, TenantState
from marlaas.train.grpo import GRPOSnapshot
from marlaas.train.optim import TenantSnapshot
from marlaas.train.sft import SFTSnapshot, SFTTraining, conversation_datum
from marlaas.types import Datum


def supervised_data(
    job: JobSpec,
    tokenizer: PreTrainedTokenizerBase,
    max_tokens: int,
    limit: str = "the trainer's budget per forward",
) -> tuple[list[Datum], list[Datum]]:
    """The job's (train, eval) datums: its dataset's rows (`prompt_field` and
    `format` applied: `envs.conversations.in_format`) rendered for the base, the
    eval rows held out by `eval_fraction` or read from `eval_path` (at most
    `eval_episodes` of them). `DataError` naming the file, line and field for a bad
    row, or for one longer than `max_tokens` (`limit` says what bounds it)."""
    task = job.task
    if not isinstance(task, DatasetSpec):
        raise ConfigError(f"job {job.name!r}: a supervised job needs a dataset task")

    def render(convs: Sequence[Conversation]) -> list[Datum]:
        out = []
        for conv in convs:
            where = conv.where or conv.id
            datum = conversation_datum(tokenizer, conv, where)
            if len(datum.input_ids) > max_tokens:
                raise DataError(
                    f"{where} is {len(datum.input_ids)} tokens, above {limit} "
                    f"({max_tokens} tokens); shorten it"
                )
            out.append(datum)
        return out

    def load(path: str) -> list[Conversation]:
        rows = load_conversations(path, task.prompt_field)
        return [in_format(conv, task.format) for conv in rows]

    rows = load(task.path)
    if task.eval_path is not None:
        train, held_out = rows, load(task.eval_path)
    else:
        train, held_out = split_examples(rows, task.eval_fraction, task.seed)
    if not train:
        raise DataError(f"{task.path}: the train split is empty")
    return render(train), render(held_out[: job.eval_episodes])


class SupervisedRuntime(TenantRuntime):
    """A supervised tenant (see the module docstring)."""

    def __init__(self, ctx: PipelineContext, state: TenantState) -> None:
        super().__init__(ctx, state)
        if not isinstance(self.job.algorithm, SFTSpec):
            raise ConfigError(f"job {self.name!r} is not a supervised job")
        self.sft = SFTTraining(self.job.algorithm)
        self.train_data: list[Datum] = []
        self.eval_data: list[Datum] = []

    async def _prepare(self) -> None:
        budget, limit = self.ctx.run.trainer.max_tokens_per_microbatch, "the trainer's budget"
        context = context_length(self.ctx.device.model.base.config)
        if context is not None and context < budget:
            budget, limit = context, "the base model's context"
        tokenizer = self.ctx.device.tokenizer
        self.train_data, self.eval_data = await asyncio.to_thread(
            supervised_data, self.job, tokenizer, budget, limit
        )

    def _resume_settings(self, snapshot: GRPOSnapshot | SFTSnapshot, path: Path) -> None:
        if not isinstance(snapshot, SFTSnapshot):
            raise ModelError(
                f"checkpoint {str(path)!r} is an RL tenant's, and job {self.name!r} is a "
                "supervised job; resume with the job spec it was written for, or start afresh"
            )
        # The job's current settings apply from here on (a resume may change them).

    def _restore_extra(self, extra: dict[str, Any]) -> None:
        super()._restore_extra(extra)
        losses = extra.get("eval_loss", {})
        self.eval_loss.update({int(k): float(v) for k, v in losses.items()})

    def _snapshot(self, state: TenantSnapshot) -> GRPOSnapshot | SFTSnapshot:
        return SFTSnapshot(state, self.sft.algo)

    def _extra(self) -> dict[str, Any]:
        extra = super()._extra()
        extra["eval_loss"] = {str(k): v for k, v in sorted(self.eval_loss.items())}
        return extra

    def eval_due(self) -> bool:
        every, version = self.job.eval_every, self.state.version
        return bool(self.eval_data) and every > 0 and version % every == 0

    # -- data, step, eval ------------------------------------------------------------

    def example(self, index: int) -> Datum:
        """Example `index` of the endless stream (see the module docstring)."""
        n = len(self.train_data)
        epoch, offset = divmod(index, n)
        order = list(range(n))
        random.Random(f"sft:{self.job.seed}:{epoch}").shuffle(order)
        return self.train_data[order[offset]]

    async def step(self) -> None:
        """One optimizer step on the next `batch_size` examples."""
        state, device = self.state, self.ctx.device
        size = self.sft.algo.batch_size
        batch = [self.example(state.cursor + i) for i in range(size)]
        submitted = time.perf_counter()
        train_input = self.sft.train_input(self.name, batch, state.version)
        outputs = await device.forward_backward([train_input])
        result = await device.optim_step(self.name, self.sft.adam)
        sums = outputs[self.name].sums
        tokens = max(float(sums["tokens"]), 1.0)
        state.advance(result.version, size, round(tokens))
        now = time.perf_counter()
        metrics = StepMetrics(
            loss=float(sums["nll"]) / tokens,
            tokens=tokens,
            rows=float(size),
            grad_norm=result.grad_norm,
            lr=result.lr,
            step_time_s=now - self._last_step_at,
            train_wait_s=now - submitted,
            token_accuracy=float(sums["correct"]) / tokens,
        )
        self._last_step_at = now
        self._last_step = (result.version, metrics)
        self.ctx.recorder.span("train", "step", submitted, now, tenant=self.name)
        self.ctx.recorder.progress(StepDone(self.name, result.version, metrics))

    async def evaluate(self, version: int) -> float | None:
        """Token accuracy of the current adapter (at `version`) on the held-out rows,
        with their mean token NLL recorded too (None: no held-out rows)."""
        if not self.eval_data:
            return None
        t0 = time.perf_counter()
        inputs = [self.sft.eval_input(self.name, self.eval_data, version)]
        sums = (await self.ctx.device.forward(inputs))[self.name].sums
        tokens = max(float(sums["tokens"]), 1.0)
        accuracy, loss = float(sums["correct"]) / tokens, float(sums["nll"]) / tokens
        self.state.stats.eval_accuracy[version] = accuracy
        self.eval_loss[version] = loss
        self.ctx.recorder.span("eval", "eval", t0, time.perf_counter(), tenant=self.name)
        self.ctx.recorder.progress(EvalDone(self.name, version, accuracy, loss=loss))
        return accuracy

    # -- the driver ------------------------------------------------------------------

    async def run(self, stopping: Callable[[], bool], wake: asyncio.Event) -> bool:
        """Train to the job's last step, then evaluate, checkpoint and save the adapter
        (True); or, once `stopping()` (the pipeline's graceful close), checkpoint what
        was trained since the last checkpoint and return False. A pause waits on `wake`."""
        state = self.state
        first_due = state.version == 0 or self.eval_due()
        if first_due and state.version not in state.stats.eval_accuracy:
            await self.evaluate(state.version)
        while not state.finished_training:
            wake.clear()
            if stopping():
                if state.version > 0 and state.version != self.last_checkpoint:
                    await self.checkpoint()
                return False
            if state.status is not JobStatus.RUNNING:
                await wake.wait()
                continue
            await self.step()
            if self.checkpoint_due() and not state.finished_training:
                await self.checkpoint()
            if self.eval_due() and not state.finished_training:
                await self.evaluate(state.version)
        if state.version not in state.stats.eval_accuracy:
            await self.evaluate(state.version)
        await self.checkpoint()
        await self.save_adapter()
        return True
