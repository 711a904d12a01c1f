"""The live view and the learning curves of a short real run: every tenant's reward
shows from its first step, read from the typed progress records the pipeline emits."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.console import Console

from helpers.pipeline_support import job
from marlaas.backends import open_backend
from marlaas.config.job import EngineSpec, RunSpec
from marlaas.obs.live import LiveView
from marlaas.obs.memory import RunRecorder
from marlaas.obs.plots import CURVES_FILE, curves_figure, write_plots
from marlaas.pipeline import PipelineOptions, run_jobs

STEPS = 2


async def test_a_real_run_shows_every_tenants_reward(base_dir: Path, tmp_path: Path) -> None:
    run = RunSpec(
        base_model=str(base_dir),
        engine=EngineSpec.model_validate({"max_batch_size": 32, "max_rank": 4}),
        jobs=(
            job("alpha", "arithmetic", steps=STEPS, eval_every=1),
            job("beta", "reverse", steps=STEPS, eval_every=0),
        ),
    )
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with RunRecorder(tmp_path / "run") as recorder:
        async with LiveView(recorder, console=console, log_every_s=60):
            result = await run_jobs(
                run,
                tmp_path / "run",
                backend=open_backend,
                recorder=recorder,
                options=PipelineOptions(device="cpu"),
            )
    assert all(t.status == "done" for t in result.tenants.values())

    # The live view's last line: each tenant at its last step, with a reward and a state.
    line = out.getvalue().splitlines()[-1]
    for tenant in ("alpha", "beta"):
        pattern = rf"{tenant} {STEPS}/{STEPS} reward=(-?\d\.\d{{3}}) acc=\d+\.\d% done"
        match = re.search(pattern, line)
        assert match is not None, line
        rewards = [m.reward_mean for _, m in recorder.steps(tenant)]
        assert match.group(1) == f"{rewards[-1]:.3f}"

    # The curves: one reward line per tenant, from step 1 to the last step.
    reward, accuracy = curves_figure(recorder).axes[:2]
    drawn = {line.get_label(): line.get_xydata() for line in reward.lines}
    assert set(drawn) == {"alpha", "beta"}
    for tenant, xy in drawn.items():
        assert xy[:, 0].tolist() == list(range(1, STEPS + 1))
        assert xy[:, 1].tolist() == [m.reward_mean for _, m in recorder.steps(tenant)]
    evals = {line.get_label(): line.get_xdata().tolist() for line in accuracy.lines}
    assert evals == {"alpha": [0, 1, 2], "beta": [0, 2]}  # before training, then as scheduled
    paths = write_plots(recorder, tmp_path / "run")
    assert paths[0].name == CURVES_FILE and paths[0].stat().st_size > 20_000
