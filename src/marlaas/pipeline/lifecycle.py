"""Per-tenant operations that the async orchestrator and the sync baseline share:
setting a tenant up (fresh or from its checkpoint), playing a GRPO group, training a
step, evaluating, checkpointing, recording a step's metrics, saving the final adapter,
tearing down. A supervised tenant (`pipeline.supervised.SupervisedRuntime`) keeps the
setup, checkpoint, export and teardown and replaces the hooks that are GRPO's: its data
(`_prepare`), the settings a checkpoint restores (`_resume_settings`, `_restore_extra`)
and writes (`_snapshot`, `_extra`), its step and its eval.

Invariants:
- The device is reached only through its port (`ctx.device`): a tenant is added once,
  fresh at version 0 or from its checkpoint at its version (one publish); a train step
  is exactly `forward_backward` of the step's batch then `optim_step`
  (`train.grpo.GRPOTraining` makes both calls' arguments).
- Disk writes (checkpoints, the final PEFT adapter) run in worker threads and are
  atomic (`save_checkpoint`, `save_peft`); a checkpoint's `extra` holds the data
  cursor and the eval history, so a restore continues the same data stream, and its
  step's figures, so that what it reports (`reported`) survives a crash between the
  save and the reports' reaching the database.
- Eval is greedy, on the held-out split, pinned to one adapter version.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import fmean
from typing import Any, TypeVar

from marlaas.config.job import JobSpec
from marlaas.device.executor import ExecutorClosed
from marlaas.envs.base import Example, TaskFamily
from marlaas.errors import ModelError
from marlaas.model.lora import AdapterTensors
from marlaas.model.peft_io import model_fan_in_fan_out, save_peft
from marlaas.obs.progress import (
    CheckpointWritten,
    EvalDone,
    StepDone,
    StepMetrics,
    TenantRestored,
    checkpoint_metrics,
)
from marlaas.pipeline.context import PipelineContext
from marlaas.pipeline.data import (
    ExampleStream,
    build_task,
    episode_seed,
    eval_examples,
    eval_sampling,
    train_sampling,
)
from marlaas.pipeline.envpool import EnvCallError, play_episode
from marlaas.pipeline.tenant import PipelineError, TenantState
from marlaas.train.batch import TenantStepResult, TrainBatch
from marlaas.train.checkpoint import (
    ADAPTER_DIR,
    checkpoint_extra,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from marlaas.train.grpo import GRPOSnapshot, GRPOTraining
from marlaas.train.optim import TenantSnapshot
from marlaas.train.sft import SFTSnapshot
from marlaas.types import SamplingParams, Trajectory

T = TypeVar("T")
#: A checkpoint's `extra` key for the figures of the step that made its version.
STEP_FIGURES = "step"


@dataclass(frozen=True)
class Reported:
    """What a checkpoint reported when it was written: the figures of the step that made
    its version (None: not known then, e.g. a checkpoint of a restored version) and its
    own record's (`checkpoint_metrics`)."""

    step: dict[str, float] | None
    checkpoint: dict[str, float]


def reported(path: Path, version: int) -> Reported:
    """What the checkpoint of `version` at `path` reported, from its `extra`: its step's
    figures (none for one written before checkpoints kept them) and its eval history."""
    extra = checkpoint_extra(path)
    kept = extra.get(STEP_FIGURES)
    step = None
    if isinstance(kept, dict):
        with contextlib.suppress(TypeError, ValueError):  # not a step's figures: none
            step = StepMetrics(**{str(k): float(v) for k, v in kept.items()})
    accuracy, loss = (_of_version(extra.get(key), version) for key in ("eval", "eval_loss"))
    return Reported(
        None if step is None else step.as_dict(), checkpoint_metrics(step, accuracy, loss)
    )


def _of_version(history: object, version: int) -> float | None:
    """A version's figure in an eval history of `extra` (`{version: value}`), or None."""
    value = history.get(str(version)) if isinstance(history, dict) else None
    return float(value) if isinstance(value, int | float) else None


async def gather_all(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run `coros` together; on the first failure cancel the rest and raise that error."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as eg:
        first: BaseException = eg
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]


def grpo_training(job: JobSpec) -> GRPOTraining:
    """A job's GRPO settings: its algorithm at its sampling temperature; Dr. GRPO's
    constant normalisation is rows per step x max new tokens."""
    algo = job.grpo
    norm = None
    if algo.loss_norm == "constant":
        norm = float(algo.samples_per_step * job.sampling.max_new_tokens)
    return GRPOTraining(algo, job.sampling.temperature, constant_norm_tokens=norm)


class TenantRuntime:
    """A tenant's task, data and the operations on it (see the module docstring)."""

    def __init__(self, ctx: PipelineContext, state: TenantState) -> None:
        self.ctx = ctx
        self.state = state
        self.job = state.job
        self.name = state.name
        self._training: GRPOTraining | None = None
        self.sampling = train_sampling(self.job)
        self.eval_sampling = eval_sampling(self.job)
        self._family: TaskFamily | None = None
        self.stream: ExampleStream | None = None
        self.evals: list[Example] = []
        self.last_checkpoint: int | None = None
        #: Held-out loss by adapter version (supervised tenants; RL evals measure reward).
        self.eval_loss: dict[int, float] = {}
        self.registered = False
        self._last_step_at = time.perf_counter()
        #: The newest step's figures, by the version it made (for its checkpoint).
        self._last_step: tuple[int, StepMetrics] | None = None

    @property
    def family(self) -> TaskFamily:
        if self._family is None:
            raise PipelineError(f"tenant {self.name!r} is not set up")
        return self._family

    @property
    def training(self) -> GRPOTraining:
        if self._training is None:
            raise PipelineError(f"tenant {self.name!r} is not set up")
        return self._training

    # -- setup and teardown ----------------------------------------------------------

    async def setup(self) -> None:
        """Build the task and register the adapter (restored from the latest checkpoint
        when the context restores and one exists). Raises on a bad spec, data or checkpoint."""
        ctx, job = self.ctx, self.job
        await self._prepare()
        snapshot: TenantSnapshot | None = None
        extra: dict[str, Any] = {}
        path = latest_checkpoint(ctx.checkpoint_dir(self.name)) if ctx.restore else None
        if path is not None:
            ckpt = await asyncio.to_thread(load_checkpoint, path, ctx.device.model)
            if ckpt.snapshot.tenant != self.name or ckpt.snapshot.lora != job.lora:
                raise ModelError(
                    f"checkpoint {str(path)!r} is not for job {self.name!r} with this LoRA "
                    "spec; resume with the job spec it was written for, or start afresh"
                )
            self._resume_settings(ckpt.snapshot, path)
            snapshot = ckpt.snapshot.state
            extra = ckpt.extra
        self.registered = True  # from here on, teardown removes whatever got added
        await ctx.device.add_tenant(self.name, job.lora, seed=job.seed, snapshot=snapshot)
        if snapshot is not None:
            self.state.restore(snapshot.version, int(extra.get("cursor", 0)))
            self._restore_extra(extra)
            self.last_checkpoint = snapshot.version
            assert path is not None
            ctx.recorder.progress(TenantRestored(self.name, snapshot.version, path))
        ctx.device.set_priority(self.name, job.priority)
        self._last_step_at = time.perf_counter()

    def _restore_extra(self, extra: dict[str, Any]) -> None:
        """What a checkpoint's `extra` holds beyond the cursor: the eval history."""
        history = extra.get("eval", {})
        self.state.stats.eval_accuracy.update({int(k): float(v) for k, v in history.items()})

    def _resume_settings(self, snapshot: GRPOSnapshot | SFTSnapshot, path: Path) -> None:
        """The training settings from here on (`ModelError` for another algorithm's
        checkpoint): the job's current algorithm and temperature apply (a resume may
        change the schedule); the optimizer state is layout-compatible."""
        if not isinstance(snapshot, GRPOSnapshot):
            raise ModelError(
                f"checkpoint {str(path)!r} is a supervised tenant's, and job {self.name!r} "
                "is an RL job; resume with the job spec it was written for, or start afresh"
            )
        self._training = replace(
            snapshot.training, algo=self.job.grpo, temperature=self.job.sampling.temperature
        )

    async def _prepare(self) -> None:
        """The tenant's data and training settings, before its adapter is registered."""
        ctx, job = self.ctx, self.job
        self._training = grpo_training(job)
        family = ctx.tasks.get(self.name)
        if family is None:
            judge = ctx.judge_for(job)
            family = await asyncio.to_thread(build_task, job, ctx.device.tokenizer, judge)
        family = ctx.envs.place(family)  # where its environments run (a backend's choice)
        self._family = family
        self.stream = ExampleStream(family, job)
        self.evals = await asyncio.to_thread(eval_examples, family, job)
        # Draw the first block of train examples off the loop: bad data fails here.
        await asyncio.to_thread(self.stream.__getitem__, 0)

    async def teardown(self) -> None:
        """Stop the tenant's waiting requests and free its training state (its newest
        adapter versions stay on the device, so it can still be served)."""
        if self.registered:
            self.registered = False
            with contextlib.suppress(ExecutorClosed):
                await self.ctx.device.drop_tenant(self.name, keep_adapter=True)

    # -- rollouts --------------------------------------------------------------------

    async def play_group(self, index: int) -> list[Trajectory]:
        """The G samples of data index `index` (raises `TenantFailure` for good failures)."""
        assert self.stream is not None
        example = self.stream[index]
        coros = [
            self._episode(example, replace(self.sampling, seed=episode_seed(self.job, index, g)))
            for g in range(self.state.group_size)
        ]
        t0 = time.perf_counter()
        group = await gather_all(coros)
        self.ctx.recorder.span(
            "rollout", "group", t0, time.perf_counter(), tenant=self.name, args={"index": index}
        )
        return group

    def _episode(
        self, example: Example, sampling: SamplingParams, version: int | None = None
    ) -> Coroutine[Any, Any, Trajectory]:
        """One episode of this tenant through the gate and the env pool, with retries."""
        return play_episode(
            submit=self.ctx.device.sample,
            tokenizer=self.ctx.device.tokenizer,
            family=self.family,
            example=example,
            pool=self.ctx.envs,
            tenant=self.name,
            sampling=sampling,
            version=version,
            retries=self.ctx.options.episode_retries,
            on_retry=self._on_retry,
        )

    def _on_retry(self, exc: EnvCallError) -> None:
        self.state.stats.episode_retries += 1
        self.ctx.recorder.event("episode_retry", tenant=self.name, error=str(exc))

    async def evaluate(self, version: int) -> float | None:
        """Greedy accuracy of adapter `version` on the held-out examples (None: none)."""
        if not self.evals:
            return None
        t0 = time.perf_counter()
        coros = [self._episode(ex, self.eval_sampling, version) for ex in self.evals]
        trajectories = await gather_all(coros)
        accuracy = fmean(t.reward for t in trajectories)
        self.state.stats.eval_accuracy[version] = accuracy
        self.ctx.recorder.span("eval", "eval", t0, time.perf_counter(), tenant=self.name)
        self.ctx.recorder.progress(EvalDone(self.name, version, accuracy))
        return accuracy

    # -- steps -----------------------------------------------------------------------

    async def train(self, batch: TrainBatch) -> TenantStepResult:
        """One optimizer step on `batch`: `forward_backward` then `optim_step` (the new
        version is published when this returns). Raises `TrainBatchError` for a batch
        the device refuses (nothing changed)."""
        device, training = self.ctx.device, self.training
        outputs = await device.forward_backward([training.train_input(batch)])
        step = await device.optim_step(self.name, training.adam)
        return training.result(batch, outputs[self.name], step)

    def record_step(self, batch: TrainBatch, result: TenantStepResult, submitted: float) -> None:
        now = time.perf_counter()
        metrics = StepMetrics(
            reward_mean=result.reward_mean,
            reward_std=result.reward_std,
            loss=result.loss,
            clip_frac=result.clip_frac,
            ratio_mean=result.ratio_mean,
            kl_behaviour=result.kl_behaviour,
            entropy=result.entropy,
            staleness_max=float(result.staleness_max),
            staleness_mean=result.staleness_mean,
            tokens=float(result.tokens),
            rows=float(result.rows),
            rows_trained=float(result.rows_trained),
            grad_norm=result.grad_norm,
            lr=result.lr,
            step_time_s=now - self._last_step_at,
            train_wait_s=now - submitted,
            kl_base=result.kl_base,
        )
        self._last_step_at = now
        self._last_step = (result.version, metrics)
        self.ctx.recorder.span("train", "step", submitted, now, tenant=self.name)
        self.ctx.recorder.progress(StepDone(self.name, result.version, metrics))

    def checkpoint_due(self) -> bool:
        every, version = self.job.checkpoint_every, self.state.version
        at_end = version >= self.job.steps
        return version != self.last_checkpoint and (at_end or (every > 0 and version % every == 0))

    def eval_due(self) -> bool:
        every, version = self.job.eval_every, self.state.version
        return bool(self.evals) and every > 0 and version % every == 0

    async def checkpoint(self) -> None:
        """Write the tenant's state at its current version, atomically."""
        t0 = time.perf_counter()
        snapshot = self._snapshot(await self.ctx.device.snapshot(self.name))
        version = snapshot.version
        step = self._last_step[1] if self._last_step and self._last_step[0] == version else None
        extra = self._extra()
        if step is not None:  # with the eval history, what this checkpoint reports: a
            # crash after the save and before the reports reached the database leaves
            # them to recovery (`reported`)
            extra[STEP_FIGURES] = step.as_dict()
        path = await asyncio.to_thread(
            save_checkpoint,
            self.ctx.checkpoint_dir(self.name),
            snapshot,
            extra,
            self.job.keep_checkpoints or self.ctx.options.keep_checkpoints,
            fan_in_fan_out=model_fan_in_fan_out(self.ctx.device.model, snapshot.state.tensors),
        )
        self.last_checkpoint = version
        self.ctx.recorder.span("checkpoint", "save", t0, time.perf_counter(), tenant=self.name)
        self.ctx.recorder.progress(
            CheckpointWritten(
                self.name,
                version,
                path,
                path / ADAPTER_DIR,
                step=step,
                eval_accuracy=self.state.stats.eval_accuracy.get(version),
                eval_loss=self.eval_loss.get(version),
            )
        )

    def _snapshot(self, state: TenantSnapshot) -> GRPOSnapshot | SFTSnapshot:
        return GRPOSnapshot(state, self.training)

    def _extra(self) -> dict[str, Any]:
        """A checkpoint's `extra`: the data cursor and the eval history."""
        return {
            "cursor": self.state.cursor,
            "eval": {str(k): v for k, v in sorted(self.state.stats.eval_accuracy.items())},
        }

    async def save_adapter(self) -> None:
        """The final adapter, in PEFT format, under the tenant's `adapter/`."""
        tensors: AdapterTensors = await self.ctx.device.export(self.name)
        await asyncio.to_thread(
            save_peft,
            self.ctx.adapter_dir(self.name),
            self.job.lora,
            tensors,
            self.ctx.device.base_name,
            fan_in_fan_out=model_fan_in_fan_out(self.ctx.device.model, tensors),
        )
