"""The TRL baseline of `marlaas bench paper`: TRL's `GRPOTrainer` with a PEFT LoRA, one
tenant at a time, on the single-turn tasks. This is the only module that imports trl
(lazily, inside `run_trl_tenant`), so nothing else in marlaas needs it installed.

What is matched to the tenant's `JobSpec` (the same work and hyper-parameters):
- model: the same base directory, float32, on the device marlaas uses (`use_cpu=True`
  without CUDA), no vLLM, no bf16/fp16, no gradient checkpointing;
- data: the job's own train stream (`ExampleStream`: same family, split seed, job seed
  and order), the first `steps x P` prompts, unshuffled (`shuffle_dataset=False`), so
  optimizer step k sees the prompts marlaas's step k sees;
- reward: our verifier (`family.make_env(example).step(first line)`), awaited on a
  private event loop; a turn ends at a newline in both systems (the newline token is
  added to the model's EOS ids, exactly as our engine stops a turn);
- one optimizer step per P x G samples: `num_generations = G`,
  `per_device_train_batch_size = generation_batch_size = P x G`, one accumulation step,
  `num_iterations = 1`, `max_steps = steps`;
- AdamW lr / betas / weight decay, constant schedule, no warm-up, `max_grad_norm`;
  PPO clip `epsilon = clip_low`, `epsilon_high = clip_high`; `beta = kl_coef`;
  `scale_rewards = group | none`; loss normalisation token -> `dapo`, sequence ->
  `grpo`, constant -> `dr_grpo`; temperature, top-p, top-k and `max_completion_length
  = max_new_tokens`; LoRA rank, alpha, target modules, rsLoRA, no dropout.

What cannot be matched exactly (noted in the result's `notes`):
- random streams: TRL samples with torch's global generator and PEFT initialises LoRA A
  with its own RNG, so samples and the initial A differ (B = 0 in both: the initial
  policy is the base in both);
- `tis_cap` (truncated IS applies to vLLM rollouts in TRL) and `kl_estimator` (TRL
  always uses k3) have no counterpart; `max_staleness` is moot (TRL is on-policy);
- the advantage's std epsilon is TRL's 1e-4 (marlaas: 1e-6; both use the sample std);
- time: like marlaas's wall time (which excludes loading the base and includes each
  tenant's held-out eval before and after training), TRL's `wall_s` covers trainer
  construction, our greedy eval protocol (via `generate`) before and after, and
  `train()`; `train_s` is `train()` alone. TRL saves no checkpoints (marlaas does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

import torch

from marlaas.bench.workloads import is_single_turn
from marlaas.config.job import JobSpec
from marlaas.config.specs import ModelDType
from marlaas.envs.base import Example, TaskFamily
from marlaas.errors import ConfigError, ModelError
from marlaas.model.base import load_weights, resolve_dtype
from marlaas.model.peft_io import peft_target_modules
from marlaas.pipeline.data import ExampleStream, build_task, eval_examples

LOSS_TYPES = {"token": "dapo", "sequence": "grpo", "constant": "dr_grpo"}
NOTES = (
    "TRL samples with its own RNG and PEFT initialises LoRA A with its own RNG "
    "(B = 0 in both, so the initial policy is the base)",
    "tis_cap, kl_estimator (TRL: k3) and max_staleness have no TRL counterpart",
    "advantage std epsilon: TRL 1e-4, marlaas 1e-6",
    "TRL wall = GRPOTrainer construction + greedy eval before/after + train() (no checkpoints)",
)


@dataclass(frozen=True)
class TRLTenantResult:
    """One tenant trained with TRL."""

    name: str
    steps: int
    wall_s: float
    train_s: float
    #: Completion tokens of the training rollouts and of both evals (as marlaas counts).
    tokens_generated: int
    reward_mean: float
    adapter_delta_norm: float
    eval_before: float | None
    eval_after: float | None

    @property
    def adapter_changed(self) -> bool:
        return self.adapter_delta_norm > 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "adapter_changed": self.adapter_changed}


def grpo_config_kwargs(job: JobSpec, output_dir: str) -> dict[str, Any]:
    """`GRPOConfig` keyword arguments equivalent to `job` (see the module docstring)."""
    algo, s = job.grpo, job.sampling
    samples = algo.samples_per_step
    return {
        "output_dir": output_dir,
        "use_cpu": not torch.cuda.is_available(),  # the device marlaas's "auto" picks
        "bf16": False,
        "fp16": False,
        "use_vllm": False,
        "gradient_checkpointing": False,
        "report_to": [],
        "save_strategy": "no",
        "eval_strategy": "no",
        "logging_strategy": "no",
        "log_completions": False,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
        "seed": job.seed,
        "shuffle_dataset": False,
        "max_steps": job.steps,
        "num_generations": algo.group_size,
        "per_device_train_batch_size": samples,
        "gradient_accumulation_steps": 1,
        "generation_batch_size": samples,
        "num_iterations": 1,
        "learning_rate": algo.learning_rate,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "adam_beta1": algo.betas[0],
        "adam_beta2": algo.betas[1],
        "weight_decay": algo.weight_decay,
        "max_grad_norm": algo.max_grad_norm,
        "epsilon": algo.clip_low,
        "epsilon_high": algo.clip_high,
        "beta": algo.kl_coef,
        "scale_rewards": "group" if algo.scale_rewards else "none",
        "loss_type": LOSS_TYPES[algo.loss_norm],
        "max_completion_length": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
    }


def _lora_config(job: JobSpec) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=job.lora.rank,
        lora_alpha=job.lora.alpha,  # type: ignore[arg-type]  # annotated int; a float scales alike
        target_modules=peft_target_modules(job.lora),
        lora_dropout=0.0,
        use_rslora=job.lora.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _load(base_path: Path, dtype: ModelDType) -> tuple[Any, Any, list[int]]:
    """The base (in `dtype`, as marlaas resolves it on the device TRL trains on) and
    tokenizer, with the newline added to the EOS ids (a turn's end)."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        config = AutoConfig.from_pretrained(base_path, local_files_only=True)
        model = load_weights(base_path, config, resolve_dtype(dtype, device, config), device)
        tokenizer = AutoTokenizer.from_pretrained(base_path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelError(f"TRL baseline: cannot load the base from {str(base_path)!r}: {e}") from e
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    if len(newline) != 1:
        raise ModelError("TRL baseline: the tokenizer must encode a newline as one token")
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    eos_ids.append(newline[0])
    model.generation_config.eos_token_id = eos_ids
    return model, tokenizer, eos_ids


async def _score(family: TaskFamily, example: Example, completion: str) -> float:
    env = family.make_env(example)
    await env.initial_observation()
    result = await env.step(completion.split("\n", 1)[0])
    return float(result.reward)


class _Reward:
    """Our verifier as a TRL reward function (sync; awaits on a private event loop)."""

    __name__ = "marlaas_grader"

    def __init__(self, family: TaskFamily, examples: Sequence[Example]) -> None:
        self.family = family
        self.examples = list(examples)
        self.loop = asyncio.new_event_loop()
        self.tokens = 0
        self.rewards: list[float] = []

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]],
        example_index: list[int],
        **_: Any,
    ) -> list[float | None]:
        self.tokens += sum(len(c) for c in completion_ids)
        coros = [
            _score(self.family, self.examples[i], c)
            for i, c in zip(example_index, completions, strict=True)
        ]

        async def run_all() -> list[float]:
            return list(await asyncio.gather(*coros))

        rewards = self.loop.run_until_complete(run_all())
        self.rewards.extend(rewards)
        return list[float | None](rewards)

    def close(self) -> None:
        self.loop.close()


def _lora_b(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """TRL and transformers warn about CPU-only runs and the missing chat template."""
    loggers = [logging.getLogger(n) for n in ("trl", "transformers", "accelerate", "peft")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def run_trl_tenant(
    job: JobSpec,
    base_path: str | Path,
    *,
    work_dir: str | Path | None = None,
    dtype: ModelDType = "auto",
) -> TRLTenantResult:
    """Train `job`'s adapter with TRL's `GRPOTrainer` + PEFT LoRA (see the module docstring).

    Blocking; call it from a thread without a running event loop. Raises `ConfigError`
    for a job TRL cannot run here (a multi-turn task or a user dataset).
    """
    if not is_single_turn(job):
        raise ConfigError(
            f"job {job.name!r}: the TRL baseline runs single-turn built-in tasks only"
        )
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    family = build_task(job)
    stream = ExampleStream(family, job)
    n = job.steps * job.grpo.prompts_per_step
    examples = [stream[i] for i in range(n)]
    dataset = Dataset.from_dict(
        {"prompt": [e.prompt for e in examples], "example_index": list(range(n))}
    )
    model, tokenizer, eos_ids = _load(Path(base_path), dtype)
    reward = _Reward(family, examples)
    try:
        with _quiet(), tempfile.TemporaryDirectory(dir=work_dir) as tmp:
            started = time.perf_counter()
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=reward,
                args=GRPOConfig(**grpo_config_kwargs(job, tmp)),
                train_dataset=dataset,
                processing_class=tokenizer,
                peft_config=_lora_config(job),
            )
            trainer.remove_callback(PrinterCallback)  # it prints the final log dict
            before = _lora_b(trainer.model)
            eval_before, eval_tokens = _greedy_eval(trainer.model, tokenizer, family, job, eos_ids)
            train_started = time.perf_counter()
            trainer.train()
            train_s = time.perf_counter() - train_started
            eval_after, more = _greedy_eval(trainer.model, tokenizer, family, job, eos_ids)
            eval_tokens += more
            wall = time.perf_counter() - started
    finally:
        reward.close()
    after = _lora_b(trainer.model)
    delta = sum(float((after[k] - before[k]).pow(2).sum()) for k in before) ** 0.5
    return TRLTenantResult(
        name=job.name,
        steps=int(trainer.state.global_step),
        wall_s=wall,
        train_s=train_s,
        tokens_generated=reward.tokens + eval_tokens,
        reward_mean=fmean(reward.rewards) if reward.rewards else 0.0,
        adapter_delta_norm=delta,
        eval_before=eval_before,
        eval_after=eval_after,
    )


def _greedy_eval(
    model: Any, tokenizer: Any, family: TaskFamily, job: JobSpec, eos_ids: list[int]
) -> tuple[float | None, int]:
    """Our eval protocol on the TRL adapter (greedy, held-out split, same token limit):
    the accuracy (None without eval examples) and the tokens generated."""
    from transformers import GenerationConfig

    examples = eval_examples(family, job)
    if not examples:
        return None, 0
    model.eval()
    config = GenerationConfig(
        max_new_tokens=job.sampling.max_new_tokens,
        do_sample=False,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    tokenizer.padding_side = "left"
    texts: list[str] = []
    tokens = 0
    for lo in range(0, len(examples), 64):
        chunk = examples[lo : lo + 64]
        enc = tokenizer(
            [e.prompt for e in chunk],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        with torch.no_grad():
            out = model.generate(**enc, generation_config=config)
        new = out[:, enc["input_ids"].shape[1] :]
        ended = torch.isin(new, torch.tensor(eos_ids))
        first = torch.where(ended.any(dim=1), ended.int().argmax(dim=1) + 1, new.shape[1])
        tokens += int(first.sum())
        texts += tokenizer.batch_decode(new, skip_special_tokens=True)
    loop = asyncio.new_event_loop()
    try:

        async def run_all() -> list[float]:
            return list(
                await asyncio.gather(
                    *(_score(family, e, t) for e, t in zip(examples, texts, strict=True))
                )
            )

        scores = loop.run_until_complete(run_all())
    finally:
        loop.close()
    return fmean(scores), tokens
