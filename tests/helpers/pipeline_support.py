"""Helpers of the pipeline, device and Ray tests (a plain module: `conftest` names clash
across test folders): an in-memory recorder, job factories, a tiny random base on disk."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from marlaas.config.job import JobSpec
from marlaas.model.base import default_base_path
from marlaas.model.tokenizer import build_tokenizer
from marlaas.obs.progress import EvalDone, Progress, StepDone


def save_tiny_llama(path: Path) -> Path:
    """A tiny random Llama with the byte-level tokenizer, saved as a HF directory."""
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(str(path))
    return path


def embedded_base() -> Path | None:
    path = default_base_path()
    return path if (path / "config.json").is_file() else None


def job(
    name: str,
    family: str = "arithmetic",
    *,
    steps: int = 3,
    staleness: int = 1,
    priority: float = 1.0,
    P: int = 2,
    G: int = 4,
    max_new_tokens: int = 16,
    **extra: Any,
) -> JobSpec:
    """A small job; `extra` sets any other JobSpec field."""
    fields: dict[str, Any] = {
        "name": name,
        "task": {"family": family},
        "steps": steps,
        "eval_episodes": 4,
        "algorithm": {"group_size": G, "prompts_per_step": P, "max_staleness": staleness},
        "sampling": {"max_new_tokens": max_new_tokens},
        "lora": {"rank": 4},
        "priority": priority,
    }
    fields.update(extra)
    return JobSpec.model_validate(fields)


@dataclass
class MemoryRecorder:
    """Keeps every record in memory (thread-safe), for assertions. Progress records are
    kept as they come (`records`); those other than steps and evals are also logged in
    `events` under their `event` name, as a `RunRecorder` logs them."""

    spans: list[tuple[str, str, float, float, str | None]] = field(default_factory=list)
    records: list[Progress] = field(default_factory=list)
    events: list[tuple[str, str | None, dict[str, object]]] = field(default_factory=list)
    #: Called after each train step with (tenant, step), e.g. to set an event.
    on_metrics: Callable[[str, int], object] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def span(
        self,
        stage: str,
        name: str,
        start: float,
        end: float,
        *,
        tenant: str | None = None,
        args: Mapping[str, object] | None = None,
    ) -> None:
        assert end >= start
        with self._lock:
            self.spans.append((stage, name, start, end, tenant))

    def progress(self, record: Progress) -> None:
        with self._lock:
            self.records.append(record)
            if not isinstance(record, StepDone | EvalDone):
                self.events.append((record.event, record.tenant, record.log_fields()))
        if self.on_metrics is not None and isinstance(record, StepDone):
            self.on_metrics(record.tenant, record.step)

    def _steps(self) -> list[StepDone]:
        with self._lock:
            return [r for r in self.records if isinstance(r, StepDone)]

    def spans_of(self, stage: str) -> dict[str, list[tuple[float, float]]]:
        """Each tenant's (start, end) spans of `stage`, in the order they were recorded."""
        found: dict[str, list[tuple[float, float]]] = {}
        with self._lock:
            for st, _, t0, t1, tenant in self.spans:
                if st == stage and tenant is not None:
                    found.setdefault(tenant, []).append((t0, t1))
        return found

    def event(self, name: str, *, tenant: str | None = None, **fields: object) -> None:
        with self._lock:
            self.events.append((name, tenant, dict(fields)))

    def train_steps(self, tenant: str) -> list[int]:
        """The steps of `tenant`'s train records, in the order they were recorded."""
        return [r.step for r in self._steps() if r.tenant == tenant]

    def train_metrics(self, tenant: str) -> list[dict[str, float]]:
        return [r.metrics.as_dict() for r in self._steps() if r.tenant == tenant]

    def evals(self, tenant: str) -> dict[int, float]:
        with self._lock:
            records = list(self.records)
        return {
            r.version: r.accuracy for r in records if isinstance(r, EvalDone) and r.tenant == tenant
        }

    def event_names(self, name: str) -> list[str | None]:
        return [t for n, t, _ in self.events if n == name]
