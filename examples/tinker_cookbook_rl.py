"""tinker-cookbook's RL trainer (`tinker_cookbook.rl.train.main`, what its `rl_basic`
recipe runs) against `marlaas serve`, offline, on the embedded base.

The recipe's own dataset (GSM8K from the Hugging Face hub) and its model-name lookups
(renderer, tokenizer) need the network and a hub model, so this script gives the trainer
what it needs locally: a JSONL file of questions and answers (`--data`; by default the
built-in `reverse` task, written to the log directory), a plain-text environment that
prompts `Q: ...\\nA: ` with the served base's own tokenizer (no chat renderer: the
embedded base is no chat model), and the base by its path as the capabilities list it.

tinker-cookbook 0.6.1 cannot be installed with its dependencies here (it requires
`tml-renderers>=0.4.1`, which the package index does not have), so install it without
them, plus the few it imports on this path:

    pip install --no-deps tinker-cookbook==0.6.1 chz==0.4.0 blobfile==3.3.0 termcolor \\
        pyrage tiktoken aiohttp
    TINKER_BASE_URL=http://127.0.0.1:8321 TINKER_API_KEY=tml-... \\
        python examples/tinker_cookbook_rl.py --steps 10 --log-path /tmp/cookbook-rl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import chz
import tinker
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import (
    Action,
    ActionExtra,
    Env,
    EnvGroupBuilder,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
)
from tinker_cookbook.tokenizer_utils import get_tokenizer


class QAEnv(Env):
    """One question; reward 1 when the first line of the answer matches."""

    def __init__(self, model: str, question: str, answer: str) -> None:
        self.tokenizer = get_tokenizer(model)
        self.question, self.answer = question, answer

    async def initial_observation(self) -> tuple[tinker.ModelInput, list[str]]:
        prompt = self.tokenizer.encode(f"Q: {self.question}\nA: ")
        return tinker.ModelInput.from_ints(prompt), ["\n"]

    async def step(self, action: Action, *, extra: ActionExtra | None = None) -> StepResult:
        text = self.tokenizer.decode(action).split("\n", 1)[0].strip()
        correct = float(text == self.answer)
        return StepResult(
            reward=correct,
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=["\n"],
            metrics={"correct": correct},
        )


@dataclass(frozen=True)
class QAGroup(EnvGroupBuilder):
    model: str
    question: str
    answer: str
    group_size: int

    async def make_envs(self) -> Sequence[Env]:
        return [QAEnv(self.model, self.question, self.answer) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["qa"]


class QADataset(RLDataset):
    def __init__(self, groups: list[QAGroup], batch_size: int) -> None:
        self.groups, self.batch_size = groups, batch_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return self.groups[index * self.batch_size : (index + 1) * self.batch_size]

    def __len__(self) -> int:
        return len(self.groups) // self.batch_size


@chz.chz
class QADatasetBuilder(RLDatasetBuilder):
    """Groups of a local JSONL file (`{"question": ..., "answer": ...}` per line)."""

    path: str
    model: str
    batch_size: int
    group_size: int

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        rows = [json.loads(line) for line in Path(self.path).read_text().splitlines() if line]
        groups = [QAGroup(self.model, r["question"], r["answer"], self.group_size) for r in rows]
        return QADataset(groups, self.batch_size), None


def write_reverse_task(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 10)))
            f.write(json.dumps({"question": f"reverse {word}", "answer": word[::-1]}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description="tinker-cookbook RL on marlaas serve.")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--data", type=Path, help="JSONL of question/answer (default: reverse).")
    parser.add_argument("--log-path", type=Path, default=Path("runs/cookbook-rl"))
    parser.add_argument("--batch-size", type=int, default=8, help="Groups per step.")
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()
    if not os.environ.get("TINKER_BASE_URL") or not os.environ.get("TINKER_API_KEY"):
        parser.error("set TINKER_BASE_URL and TINKER_API_KEY (a tml- key of your tenant)")
    base = str(
        tinker.RestClient().get_server_capabilities().result().supported_models[0].model_name
    )
    args.log_path.mkdir(parents=True, exist_ok=True)
    data = args.data
    if data is None:
        data = args.log_path / "reverse.jsonl"
        write_reverse_task(data, args.steps * args.batch_size)
    config = train.Config(
        learning_rate=5e-4,
        dataset_builder=QADatasetBuilder(
            path=str(data), model=base, batch_size=args.batch_size, group_size=args.group_size
        ),
        model_name=base,
        recipe_name="marlaas_cookbook_rl",
        max_tokens=16,
        log_path=str(args.log_path),
        lora_rank=8,
        eval_every=0,
        save_every=0,
        ttl_seconds=None,
    )
    asyncio.run(train.main(config))
    metrics = [
        json.loads(line) for line in (args.log_path / "metrics.jsonl").read_text().splitlines()
    ]
    rewards = [m["env/all/reward/total"] for m in metrics if "env/all/reward/total" in m]
    print(f"reward per step: {[round(r, 3) for r in rewards]}")


if __name__ == "__main__":
    main()
