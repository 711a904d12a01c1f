"""A tenant's data: its task, its train example stream, its eval set and sampling.

Invariants:
- The train stream is a deterministic function of the job: example `i` is the same in
  every run (and after a resume, which restarts at the checkpoint's cursor). It is the
  task's own seeded train list, read in blocks of `BLOCK` and shuffled within each
  block by the job's seed, so jobs that differ only in `seed` see different orders.
- Train and eval never share an instance (the task's split guarantees it).
- Episode sampling seeds are a pure function of (job seed, data index, sample index), so
  a group's samples do not depend on what else runs in the engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Any

from transformers import PreTrainedTokenizerBase

from marlaas.config.job import DatasetSpec, JobSpec
from marlaas.envs.base import Example, TaskFamily
from marlaas.envs.chat import ChatFamily, render_examples
from marlaas.envs.datasets import DatasetTask, load_jsonl
from marlaas.envs.graders import build_grader
from marlaas.envs.openai_graders import Judge
from marlaas.envs.tasks import get_family
from marlaas.errors import ConfigError, DataError
from marlaas.types import SamplingParams

#: Examples shuffled together by the job seed.
BLOCK = 256


def build_task(
    job: JobSpec, tokenizer: PreTrainedTokenizerBase | None = None, judge: Judge | None = None
) -> TaskFamily:
    """The job's task: a built-in family with its knobs, or its dataset and grader (its
    model graders calling `judge`); in chat format, rendered with `tokenizer`'s chat
    template (`marlaas.envs.chat`).

    Raises `ConfigError` / `DataError` / `GraderError` for a bad spec or bad data (a
    chat task for a tokenizer without a chat template among them).
    """
    task = job.task
    if isinstance(task, DatasetSpec):
        examples = load_jsonl(task.path, task.prompt_field, task.reference_field)
        examples, chat = render_examples(examples, tokenizer, task.format, task.path)
        if task.grader is None:
            raise ConfigError(f"job {job.name!r}: task.grader is required by an RL job")
        grader = build_grader(task.grader, judge=judge)
        held_out = None
        if task.eval_path is not None:
            # Ids only need to be unique within a file: the eval file's get a prefix.
            held_out = [
                dataclasses.replace(e, id=f"eval:{e.id}")
                for e in load_jsonl(task.eval_path, task.prompt_field, task.reference_field)
            ]
            held_out, _ = render_examples(held_out, tokenizer, task.format, task.eval_path)
        return DatasetTask(
            examples,
            grader,
            name=job.name,
            eval_fraction=task.eval_fraction,
            split_seed=task.seed,
            eval_examples=held_out,
            chat=chat,
        )
    options: dict[str, Any] = dict(task.options)
    family = get_family(task.family, tool_latency_s=task.tool_latency_s, **options)
    if task.format == "chat":
        if tokenizer is None:
            raise ConfigError(f"job {job.name!r}: task.format chat needs the base's tokenizer")
        return ChatFamily(family, tokenizer)
    return family


def _list_seed(job: JobSpec) -> int:
    """The seed passed to `TaskFamily.examples`: a built-in family's split seed, or the
    job's seed for a dataset (whose split is fixed when the task is built)."""
    return job.seed if isinstance(job.task, DatasetSpec) else job.task.seed


class ExampleStream:
    """The job's endless, deterministic train examples; `stream[i]` is example `i`."""

    def __init__(self, family: TaskFamily, job: JobSpec) -> None:
        self.family = family
        self.job = job
        self._seed = _list_seed(job)
        self._raw: list[Example] = []
        self._blocks: dict[int, list[Example]] = {}

    def __getitem__(self, index: int) -> Example:
        if index < 0:
            raise IndexError(index)
        block, offset = divmod(index, BLOCK)
        if block not in self._blocks:
            self._blocks = {block: self._block(block)}  # one block is kept at a time
        return self._blocks[block][offset]

    def _block(self, block: int) -> list[Example]:
        need = (block + 1) * BLOCK
        if len(self._raw) < need:
            # Families give prefix-stable lists; doubling keeps the total work linear.
            n = max(need, 2 * len(self._raw))
            fresh = self.family.examples("train", n, seed=self._seed)
            if len(fresh) < need:
                raise DataError(f"task of job {self.job.name!r} gave too few train examples")
            self._raw = fresh
        items = list(self._raw[block * BLOCK : need])
        random.Random(f"{self.job.seed}/{block}").shuffle(items)
        return items


def eval_examples(family: TaskFamily, job: JobSpec) -> list[Example]:
    """The held-out examples of a periodic eval ([] when the task holds none out).

    A dataset's eval split is used once each (at most `eval_episodes` of it): greedy
    decoding would repeat the same episode.
    """
    n = job.eval_episodes
    if isinstance(family, DatasetTask):
        n = min(n, len(family.eval))
        if n == 0:
            return []
    return family.examples("eval", n, seed=_list_seed(job))


def train_sampling(job: JobSpec) -> SamplingParams:
    s = job.sampling
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_new_tokens=s.max_new_tokens,
        stop=s.stop,
    )


def eval_sampling(job: JobSpec) -> SamplingParams:
    """Greedy decoding, the job's token limit and stop strings."""
    return SamplingParams(
        temperature=0.0, max_new_tokens=job.sampling.max_new_tokens, stop=job.sampling.stop
    )


def episode_seed(job: JobSpec, index: int, sample: int) -> int:
    """A 62-bit sampling seed for sample `sample` of data index `index`."""
    digest = hashlib.blake2b(f"{job.seed}/{index}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2
