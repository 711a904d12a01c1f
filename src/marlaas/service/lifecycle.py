"""Who may move a job row where: the service's side of the one job-status machine
(`marlaas.status`, which the pipeline's tenants follow too).

Tenants act through the API (cancel, pause, and "resume", the API's public word for
unpausing); the runner reports what actually happened (running: admitted, done,
failed). Terminal statuses never change again, so a late report from the runner after
a cancel cannot bring a job back.

    queued --admit--> running --finish/fail--> done | failed
      |  \\            |
      |   pause       pause          any non-terminal --cancel--> cancelled
      |     \\         v
      |      `----> paused --unpause ("resume")--> queued  (the runner then reports
                                                           running)

The database never records `paused -> running`: the API cannot know whether the runner
still holds the job's place, so an unpaused row waits as queued until the runner says.
"""

from __future__ import annotations

import enum

from marlaas.status import ACTIVE, TERMINAL, JobStatus, Move, sources

__all__ = [
    "ACTIONS",
    "ACTIVE",
    "REPORTED",
    "TERMINAL",
    "Action",
    "JobStatus",
    "action_target",
    "allowed_from",
]


class Action(enum.StrEnum):
    """What a tenant may ask of a job, by its public name in the API."""

    CANCEL = "cancel"
    PAUSE = "pause"
    #: Unpause: the API's word (`POST .../resume`, the OpenAI fine-tuning API's too).
    RESUME = "resume"


# action -> (the machine's move, the status it leads to in the database)
_MOVES: dict[Action, tuple[Move, JobStatus]] = {
    Action.CANCEL: (Move.CANCEL, JobStatus.CANCELLED),
    Action.PAUSE: (Move.PAUSE, JobStatus.PAUSED),
    Action.RESUME: (Move.UNPAUSE, JobStatus.QUEUED),
}

# action -> (statuses it applies to, status it leads to)
ACTIONS: dict[Action, tuple[frozenset[JobStatus], JobStatus]] = {
    action: (sources(move, target), target) for action, (move, target) in _MOVES.items()
}

# status the runner reports -> statuses it may come from
REPORTED: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.RUNNING: sources(Move.ADMIT, JobStatus.RUNNING),
    JobStatus.DONE: sources(Move.FINISH, JobStatus.DONE),
    JobStatus.FAILED: sources(Move.FAIL, JobStatus.FAILED),
}


def action_target(action: Action, status: JobStatus) -> JobStatus | None:
    """The status `action` leads to from `status`, or None when it does not apply."""
    sources_, target = ACTIONS[action]
    return target if status in sources_ else None


def allowed_from(action: Action) -> str:
    """The statuses `action` applies to, for error messages."""
    return ", ".join(sorted(ACTIONS[action][0]))
