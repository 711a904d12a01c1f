"""A reinforcement fine-tuning job written for OpenAI's API, run on marlaas unchanged.

The official `openai` client reads its endpoint and key from the environment, so the
same script runs against either service:

    # OpenAI (while it still takes fine-tuning jobs)
    OPENAI_API_KEY=sk-... RFT_MODEL=o4-mini-2025-04-16 python examples/openai_rft.py

    # marlaas (serving a chat model: marlaas serve --base-model DIR): its URL and a
    # tenant's API key; `base` is the model marlaas serves
    OPENAI_BASE_URL=http://127.0.0.1:8321/v1 OPENAI_API_KEY=mk_... python examples/openai_rft.py

It uploads a small training file in OpenAI's RFT format (chat `messages` plus an
`answer` field the grader reads as `item.answer`), tries the grader on one answer,
trains, follows the job's events until it ends, lists the checkpoints and asks the
fine-tuned model a question.

With `--supervised` it runs OpenAI's supervised fine-tuning instead (`method: {type:
supervised}`): the training file's rows end with the assistant's answer, which is what
the model learns (cross-entropy on the assistant turns; no grader). On OpenAI, set
`RFT_MODEL` to a model that takes supervised jobs (e.g. gpt-4.1-mini-2025-04-14).
"""

from __future__ import annotations

import io
import json
import os
import random
import sys
import time

from openai import OpenAI

MODEL = os.environ.get("RFT_MODEL", "base")
POLL_S = 2.0

GRADER = {
    "type": "multi",
    "name": "arithmetic",
    "graders": {
        # 1 when the answer is exactly the reference.
        "exact": {
            "type": "string_check",
            "name": "exact",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "eq",
        },
        # 1 when the reference appears anywhere in the answer (partial credit).
        "contains": {
            "type": "python",
            "name": "contains",
            "source": (
                "def grade(sample, item):\n"
                "    return 1.0 if item['answer'] in sample['output_text'] else 0.0\n"
            ),
        },
    },
    "calculate_output": "0.7 * exact + 0.3 * contains",
}


def training_rows(n: int, seed: int, supervised: bool = False) -> list[dict[str, object]]:
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        question = {"role": "user", "content": f"{a}+{b}"}
        if supervised:  # the target answer is the conversation's assistant turn
            rows.append({"messages": [question, {"role": "assistant", "content": str(a + b)}]})
        else:
            rows.append({"messages": [question], "answer": str(a + b)})
    return rows


def main() -> int:
    client = OpenAI()
    supervised = "--supervised" in sys.argv[1:]
    rows = training_rows(40, seed=0, supervised=supervised)
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    training = client.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune")
    print(f"uploaded {training.id}: {training.status}")
    if supervised:
        job = client.fine_tuning.jobs.create(
            model=MODEL,
            training_file=training.id,
            method={
                "type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 4}},
            },
            suffix="arithmetic-sft",
            seed=1,
        )
        print(f"created {job.id}: {job.status}")
        return follow(client, job.id)

    client.fine_tuning.alpha.graders.validate(grader=GRADER)  # type: ignore[arg-type]
    trial = client.fine_tuning.alpha.graders.run(
        grader=GRADER,  # type: ignore[arg-type]
        model_sample="the answer is 42",
        item={"answer": "42"},
    )
    print(f"grader on a sample: reward {trial.reward:.2f}, sub-rewards {trial.sub_rewards}")

    job = client.fine_tuning.jobs.create(
        model=MODEL,
        training_file=training.id,
        method={
            "type": "reinforcement",
            "reinforcement": {
                "grader": GRADER,  # type: ignore[typeddict-item]
                "hyperparameters": {"n_epochs": 1, "batch_size": 4, "eval_interval": 5},
            },
        },
        suffix="arithmetic",
        seed=1,
    )
    print(f"created {job.id}: {job.status}")
    return follow(client, job.id)


def follow(client: OpenAI, job_id: str) -> int:
    """Print the job's events until it ends; then its checkpoints and one answer."""
    seen: set[str] = set()
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
        for event in reversed(events):  # the API lists the newest first
            if event.id not in seen:
                seen.add(event.id)
                print(f"  [{event.level}] {event.message}")
        if job.status in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(POLL_S)
    if job.status != "succeeded":
        print(f"job {job.status}: {job.error.message if job.error else ''}", file=sys.stderr)
        return 1

    for checkpoint in client.fine_tuning.jobs.checkpoints.list(job.id):
        print(
            f"checkpoint at step {checkpoint.step_number}: {checkpoint.fine_tuned_model_checkpoint}"
        )
    assert job.fine_tuned_model is not None
    answer = client.chat.completions.create(
        model=job.fine_tuned_model,
        messages=[{"role": "user", "content": "12+30"}],
        max_tokens=8,
        temperature=0,
    )
    print(f"{job.fine_tuned_model} says 12+30 = {answer.choices[0].message.content!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
