"""Helpers shared by the obs tests (a plain module: `conftest` names clash across test
folders) and by the tests that render obs views from a real run."""

from __future__ import annotations

from marlaas.obs.progress import StepMetrics


def step_metrics(reward: float, loss: float = 1.0) -> StepMetrics:
    """A step's figures with the given mean reward and loss (the rest plausible)."""
    return StepMetrics(
        reward_mean=reward,
        reward_std=0.1,
        loss=loss,
        clip_frac=0.0,
        ratio_mean=1.0,
        kl_behaviour=0.0,
        entropy=1.5,
        staleness_max=0.0,
        staleness_mean=0.0,
        tokens=64.0,
        rows=8.0,
        grad_norm=0.5,
        lr=1e-4,
        step_time_s=1.0,
        train_wait_s=0.2,
    )


class FakeClock:
    """A perf_counter stand-in that only moves when told to."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
