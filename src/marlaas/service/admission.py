"""Admission by cost: what a job will ask of this server's machine and of its tenant's
quotas, checked before the job is created (201), off the event loop, in bounded time.

A job is refused at submission, never at run time, when
- it cannot fit the machine (422, naming the field and the limit). The limits are
  computed from the served model and the engine's sizes (`MachineLimits`): the LoRA
  targets resolved against the model's own layers and the rank it allows
  (`LoRAModel.resolve`, `LoRAModel.validate_spec`), a chat format only with a chat
  template, a group no larger than the engine's rows, a prompt plus one turn within the
  model's context, a whole sequence within the trainer's micro-batch budget, tool
  latency below the environment timeout;
- or it cannot start: its task is built here as the pipeline builds it (a dataset read
  and checked row by row, its grader compiled, a family's options checked, chat rows
  rendered) and its prompts, as its episodes will see them, are tokenized with the
  served model's tokenizer (422 naming the field);
- or its step or eval would ask more than the tenant's quotas (`JobCost`, checked by
  `quotas.check_job_cost` in the transaction that creates the job: 429).

Bounded time: everything here runs in one worker thread per job under a `Deadline`
(`validation_timeout_s`, checked between phases and between chunks of tokenization), and
at most `MAX_CONCURRENT` jobs are checked at once, so a flood of submissions costs
bounded CPU and never blocks the event loop.

The model and tokenizer come from the pipeline's engine when it runs; otherwise (no
backend, or the pipeline still starting) from a weightless copy of the same base (its
config and tokenizer, the layers on PyTorch's `meta` device), built once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marlaas.config.job import DatasetSpec, JobSpec
from marlaas.config.specs import SFTSpec, TargetModules, TaskSpec
from marlaas.errors import MarlaasError
from marlaas.service.errors import InvalidField, redact_paths
from marlaas.service.settings import ServiceSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from marlaas.envs.base import Example, TaskFamily
    from marlaas.model.lora import LoRAModel
    from marlaas.service.inference import InferenceProvider

#: Jobs checked at once; more wait (within their own deadline).
MAX_CONCURRENT = 2
#: Prompts tokenized per call (between two deadline checks).
TOKENIZE_CHUNK = 1024
#: Train examples of a built-in family whose prompts are measured (its first block).
BUILTIN_SAMPLE = 256


@dataclass(frozen=True)
class MachineLimits:
    """What one job may ask of this server's machine."""

    #: The served model's context (max positions); None when its config does not say.
    context_length: int | None
    #: Rows the engine decodes at once (a group is sampled together).
    max_batch_rows: int
    #: The trainer's token budget of one forward/backward (one sequence must fit).
    max_tokens_per_microbatch: int
    #: Limit of one environment call (a tool call must end before it).
    env_timeout_s: float
    #: The targets of a job that leaves `lora.target_modules` unset (the server's default).
    default_targets: TargetModules = None


@dataclass(frozen=True)
class JobCost:
    """What one job asks per step and per eval, for the quota checks."""

    samples_per_step: int
    eval_episodes: int
    longest_prompt: int
    max_turns: int
    max_new_tokens: int
    context_length: int | None

    @property
    def tokens_per_sequence(self) -> int:
        """The longest sequence a sample may grow to: its prompt and every turn, at most
        the model's context (the engine stops there)."""
        tokens = self.longest_prompt + self.max_turns * self.max_new_tokens
        return tokens if self.context_length is None else min(tokens, self.context_length)

    @property
    def tokens_per_step(self) -> int:
        return self.samples_per_step * self.tokens_per_sequence


class Deadline:
    """A point in time; `check` raises `InvalidField` once it has passed."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def check(self, doing: str) -> None:
        if time.monotonic() > self._end:
            raise InvalidField(
                ("body",),
                f"checking this job took longer than this server's limit of "
                f"{self.seconds:g} s (while {doing}); use a smaller dataset",
            )


class JobAdmission:
    """The app's job checks (see the module docstring); one per app."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)
        self._lock = asyncio.Lock()
        self._shape: tuple[LoRAModel, PreTrainedTokenizerBase] | None = None

    async def assess(
        self, spec: JobSpec, runnable: JobSpec, shared: InferenceProvider | None
    ) -> JobCost:
        """The cost of `spec` (`runnable`: the same with a dataset's server path), or
        `InvalidField` (422) saying what to change. `shared`: the pipeline's engine."""
        deadline = Deadline(self.settings.validation_timeout_s)
        try:
            async with asyncio.timeout(deadline.seconds):
                if shared is not None:
                    model, tokenizer = shared.model, shared.tokenizer
                else:
                    model, tokenizer = await self._shape_model()
                await self._slots.acquire()
                # The slot is the thread's: it is released when the thread ends, even if
                # this request stops waiting for it first.
                work = asyncio.ensure_future(
                    asyncio.to_thread(
                        assess_job, spec, runnable, model, tokenizer, self.limits(model), deadline
                    )
                )
                work.add_done_callback(lambda _: self._slots.release())
                return await asyncio.shield(work)
        except TimeoutError:
            deadline.check("waiting for the checks to finish")
            raise

    def limits(self, model: LoRAModel) -> MachineLimits:
        settings = self.settings
        from marlaas.model.arch import context_length  # torch: loaded with the model

        return MachineLimits(
            context_length=context_length(model.base.config),
            max_batch_rows=settings.max_batch_rows,
            max_tokens_per_microbatch=settings.max_tokens_per_microbatch,
            env_timeout_s=settings.env_timeout_s,
            default_targets=settings.default_target_modules,
        )

    async def _shape_model(self) -> tuple[LoRAModel, PreTrainedTokenizerBase]:
        async with self._lock:
            if self._shape is None:
                self._shape = await asyncio.to_thread(
                    shape_model, self.settings.serve_base_model, self.settings.max_lora_rank
                )
            return self._shape


def shape_model(base_path: Path | None, max_rank: int) -> tuple[LoRAModel, PreTrainedTokenizerBase]:
    """The base's multi-LoRA layers without weights (on the `meta` device) and its
    tokenizer: what the checks need of the model, for the cost of its config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from marlaas.model.base import default_base_path
    from marlaas.model.lora import LoRAModel

    root = base_path or default_base_path()
    config = AutoConfig.from_pretrained(root, local_files_only=True)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    return LoRAModel(base, max_rank=max_rank), tokenizer


# -- the checks (in a worker thread) ---------------------------------------------------


def assess_job(
    spec: JobSpec,
    runnable: JobSpec,
    model: LoRAModel,
    tokenizer: PreTrainedTokenizerBase,
    limits: MachineLimits,
    deadline: Deadline,
) -> JobCost:
    """Every check of the module docstring, in order of cost; the job's `JobCost`."""
    from marlaas.errors import ConfigError, ModelError
    from marlaas.model.chat import has_chat_template

    try:
        model.validate_spec(model.resolve(spec.lora, default=limits.default_targets))
    except (ConfigError, ModelError) as e:
        field = "rank" if spec.lora.rank > model.max_rank else "target_modules"
        raise InvalidField(("body", "lora", field), str(e)) from None
    if spec.task.format == "chat" and not has_chat_template(tokenizer):
        raise InvalidField(
            ("body", "task", "format"),
            "task.format chat needs the served model's chat template, and its tokenizer "
            "has none; use format text (or auto), or a server on a chat model",
        )
    if spec.supervised:
        return _assess_supervised(spec, runnable, tokenizer, limits, deadline)
    group = spec.grpo.group_size
    if group > limits.max_batch_rows:
        raise InvalidField(
            ("body", "algorithm", "group_size"),
            f"group_size {group} is above this server's {limits.max_batch_rows} engine rows "
            "(a group is sampled together); lower it, and raise prompts_per_step instead",
        )
    task = spec.task
    if isinstance(task, TaskSpec) and task.tool_latency_s[1] >= limits.env_timeout_s:
        raise InvalidField(
            ("body", "task", "tool_latency_s"),
            f"a tool latency of {task.tool_latency_s[1]:g} s would reach this server's "
            f"environment timeout of {limits.env_timeout_s:g} s; keep it below",
        )
    family = _build(spec, runnable, tokenizer)
    deadline.check("building the task")
    examples = _sample(family, runnable)
    deadline.check("drawing the task's examples")
    prompts = _prompts(family, examples)
    deadline.check("rendering the prompts")
    longest, where = _longest_prompt(tokenizer, prompts, deadline)
    cost = JobCost(
        samples_per_step=spec.grpo.samples_per_step,
        eval_episodes=spec.eval_episodes,
        longest_prompt=longest,
        max_turns=family.max_turns,
        max_new_tokens=spec.sampling.max_new_tokens,
        context_length=limits.context_length,
    )
    _check_lengths(spec, cost, where, limits)
    return cost


def _assess_supervised(
    spec: JobSpec,
    runnable: JobSpec,
    tokenizer: PreTrainedTokenizerBase,
    limits: MachineLimits,
    deadline: Deadline,
) -> JobCost:
    """A supervised job's checks: every row read and rendered as the pipeline does, each
    within the trainer's budget and the model's context. Its cost is `batch_size`
    sequences of the longest row per step, and `eval_episodes` held-out rows per eval."""
    from marlaas.pipeline.supervised import supervised_data

    budget, limit = limits.max_tokens_per_microbatch, "this server's trainer budget per forward"
    if limits.context_length is not None and limits.context_length < budget:
        budget, limit = limits.context_length, "the served model's context"
    try:
        train, evals = supervised_data(runnable, tokenizer, budget, limit)
    except (MarlaasError, ValueError, OSError) as e:
        text, task = str(e), spec.task
        if isinstance(task, DatasetSpec) and isinstance(runnable.task, DatasetSpec):
            paths = [(runnable.task.path, task.path), (runnable.task.eval_path, task.eval_path)]
            for path, name in paths:
                if path and name:
                    text = text.replace(f"{path}:", f"dataset {name!r}, line ")
                    text = text.replace(path, f"dataset {name!r}")
        raise InvalidField(
            ("body", "task", "path"), f"the data cannot be used: {redact_paths(text)}"
        ) from None
    deadline.check("rendering the rows")
    longest = max(len(d.input_ids) for d in [*train, *evals])
    assert isinstance(spec.algorithm, SFTSpec)
    return JobCost(
        samples_per_step=spec.algorithm.batch_size,
        eval_episodes=min(spec.eval_episodes, len(evals)),
        longest_prompt=longest,
        max_turns=0,
        max_new_tokens=0,
        context_length=limits.context_length,
    )


def _build(spec: JobSpec, runnable: JobSpec, tokenizer: PreTrainedTokenizerBase) -> TaskFamily:
    """The task as the pipeline builds it; its errors name the field to fix and never
    the server's path of a dataset."""
    from marlaas.errors import DataError, GraderError
    from marlaas.pipeline.data import build_task

    try:
        return build_task(runnable, tokenizer)
    except (MarlaasError, ValueError, TypeError, OSError) as e:
        task, text = spec.task, str(e)
        field: tuple[str, ...] = ("body", "task")
        if isinstance(task, DatasetSpec) and isinstance(runnable.task, DatasetSpec):
            path = runnable.task.path
            text = text.replace(f"{path}:", f"dataset {task.path!r}, line ")
            text = text.replace(path, f"dataset {task.path!r}")
            if isinstance(e, GraderError):
                field = ("body", "task", "grader")
            elif isinstance(e, DataError):
                field = ("body", "task", "path")
        elif isinstance(task, TaskSpec):
            field = ("body", "task", "options")
        raise InvalidField(field, f"the task cannot be built: {redact_paths(text)}") from None


def _sample(family: TaskFamily, runnable: JobSpec) -> list[Example]:
    """The examples whose prompts are measured: every row of a dataset; a built-in
    family's first block of train examples (its prompts are short and alike) and the
    eval examples one eval uses."""
    from marlaas.envs.datasets import DatasetTask
    from marlaas.pipeline.data import ExampleStream, eval_examples

    try:
        if isinstance(family, DatasetTask):
            return [*family.train, *family.eval]
        stream = ExampleStream(family, runnable)
        train = [stream[i] for i in range(BUILTIN_SAMPLE)]
        return [*train, *eval_examples(family, runnable)]
    except (MarlaasError, ValueError) as e:
        raise InvalidField(("body", "task"), f"the task gives no examples: {e}") from None


@dataclass(frozen=True)
class _Prompt:
    """An example's first prompt as its episode sends it: text, and whether a chat
    template rendered it (its special tokens are then part of the text)."""

    example: str
    text: str
    rendered: bool


def _prompts(family: TaskFamily, examples: Sequence[Example]) -> list[_Prompt]:
    """Each example's initial observation, from a fresh env (what the episode sends)."""

    async def observe() -> list[_Prompt]:
        out = []
        for example in examples:
            env = family.make_env(example)
            text = await env.initial_observation()
            out.append(_Prompt(example.id, text, bool(getattr(env, "chat", False))))
        return out

    try:
        return asyncio.run(observe())  # this worker thread has no loop of its own
    except (MarlaasError, ValueError) as e:
        raise InvalidField(("body", "task"), f"the task's prompts cannot be made: {e}") from None


def _longest_prompt(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[_Prompt], deadline: Deadline
) -> tuple[int, str]:
    """The longest prompt in tokens, as episodes encode them (`model.chat.encode_text`:
    BOS as the tokenizer expects, for text; nothing added to rendered text), and which
    example it is. Tokenized in chunks, with the deadline checked between them."""
    from marlaas.model.chat import adds_bos

    bos = adds_bos(tokenizer)
    longest, where = 0, ""
    for start in range(0, len(prompts), TOKENIZE_CHUNK):
        chunk = prompts[start : start + TOKENIZE_CHUNK]
        encoded: Any = tokenizer([p.text for p in chunk], add_special_tokens=False)
        for prompt, ids in zip(chunk, encoded["input_ids"], strict=True):
            n = len(ids)
            if bos is not None and not prompt.rendered and (not ids or ids[0] != bos):
                n += 1
            if n > longest:
                longest, where = n, prompt.example
        deadline.check("tokenizing the prompts")
    return longest, where


def _check_lengths(spec: JobSpec, cost: JobCost, where: str, limits: MachineLimits) -> None:
    context = limits.context_length
    longest, new = cost.longest_prompt, cost.max_new_tokens
    if context is not None and longest >= context:
        raise InvalidField(
            ("body", "task"),
            f"the prompt of example {where!r} is {longest} tokens, and the served model's "
            f"context is {context} tokens; shorten the prompts below {context} tokens",
        )
    if context is not None and longest + new > context:
        raise InvalidField(
            ("body", "sampling", "max_new_tokens"),
            f"max_new_tokens {new} plus the longest prompt ({longest} tokens, example "
            f"{where!r}) is above the served model's context of {context} tokens; lower "
            f"max_new_tokens to at most {context - longest}",
        )
    budget = limits.max_tokens_per_microbatch
    if cost.tokens_per_sequence > budget:
        raise InvalidField(
            ("body", "sampling", "max_new_tokens"),
            f"a sequence may grow to {cost.tokens_per_sequence} tokens (the longest prompt, "
            f"{longest} tokens, and {cost.max_turns} turn(s) of max_new_tokens {new}), above "
            f"this server's trainer budget of {budget} tokens per forward; lower "
            "max_new_tokens",
        )
