"""A job's status and who may move it where.

The names match the pipeline's tenant states. Tenants act through the API (cancel,
pause, resume); the runner reports what actually happened (running, done, failed).
Terminal statuses never change again, so a late report from the runner after a cancel
cannot bring a job back.

    queued --run--> running --done/failed--> done | failed
      |  \\            |
      |   pause       pause          any non-terminal --cancel--> cancelled
      |     \\         v
      |      `----> paused --resume--> queued  (the runner then reports running)
"""

from __future__ import annotations

import enum

from marlaas.types import JobStatus

TERMINAL = frozenset({JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED})
ACTIVE = frozenset({JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PAUSED})


class Action(enum.StrEnum):
    """What a tenant may ask of a job."""

    CANCEL = "cancel"
    PAUSE = "pause"
    RESUME = "resume"


# action -> (statuses it applies to, status it leads to)
ACTIONS: dict[Action, tuple[frozenset[JobStatus], JobStatus]] = {
    Action.CANCEL: (ACTIVE, JobStatus.CANCELLED),
    Action.PAUSE: (frozenset({JobStatus.QUEUED, JobStatus.RUNNING}), JobStatus.PAUSED),
    Action.RESUME: (frozenset({JobStatus.PAUSED}), JobStatus.QUEUED),
}

# status the runner reports -> statuses it may come from
REPORTED: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.RUNNING: frozenset({JobStatus.QUEUED}),
    JobStatus.DONE: frozenset({JobStatus.RUNNING, JobStatus.PAUSED}),
    JobStatus.FAILED: ACTIVE,
}


def action_target(action: Action, status: JobStatus) -> JobStatus | None:
    """The status `action` leads to from `status`, or None when it does not apply."""
    sources, target = ACTIONS[action]
    return target if status in sources else None


def allowed_from(action: Action) -> str:
    """The statuses `action` applies to, for error messages."""
    return ", ".join(sorted(ACTIONS[action][0]))
