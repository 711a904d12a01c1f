"""A job's status and the one machine that moves it: used by the pipeline's tenant state
(`pipeline.tenant.TenantState`) and by the service's job rows (`service.lifecycle`).

Every edge is labelled with the move that takes it. Owners (a tenant through the API,
or the pipeline's control calls) pause, unpause and cancel; the runner admits, finishes
and fails. Words: to *pause* stops scheduling a job's work and to *unpause* undoes it;
to *restore* is to continue a job from its checkpoint (after a restart, or in a new
run), which moves no status. The API's public word for unpausing is "resume".

    queued  --admit-->   running   --finish--> done
    queued  --pause-->   paused    (the service's row; the pipeline holds such a job
                                    out of its admission queue and keeps it queued)
    running --pause-->   paused
    paused  --unpause--> running   (the pipeline: an admitted tenant goes on at once)
    paused  --unpause--> queued    (the service's row: the runner then reports admit)
    paused  --finish-->  done      (its last step was trained when it paused)
    queued | running | paused --fail--> failed,  --cancel--> cancelled
    done, failed, cancelled: terminal

The stored values (`JobStatus`) are public: the job API and the OpenAI fine-tuning API
serve them.
"""

from __future__ import annotations

import enum


class JobStatus(enum.StrEnum):
    """Where a job stands (done, failed and cancelled are terminal)."""

    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED})
ACTIVE = frozenset({JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PAUSED})


class Move(enum.StrEnum):
    """What moves a job from one status to another."""

    #: The runner's: the job got a place and runs.
    ADMIT = "admit"
    #: The owner's.
    PAUSE = "pause"
    UNPAUSE = "unpause"
    CANCEL = "cancel"
    #: The runner's: the job ended.
    FINISH = "finish"
    FAIL = "fail"


_Q, _R, _P = JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PAUSED

#: (from, to) -> the move that takes that edge; no other edge exists.
EDGES: dict[tuple[JobStatus, JobStatus], Move] = {
    (_Q, _R): Move.ADMIT,
    (_Q, _P): Move.PAUSE,
    (_R, _P): Move.PAUSE,
    (_P, _R): Move.UNPAUSE,
    (_P, _Q): Move.UNPAUSE,
    (_R, JobStatus.DONE): Move.FINISH,
    (_P, JobStatus.DONE): Move.FINISH,
    **{(s, JobStatus.FAILED): Move.FAIL for s in ACTIVE},
    **{(s, JobStatus.CANCELLED): Move.CANCEL for s in ACTIVE},
}


def can_move(current: JobStatus, target: JobStatus, move: Move | None = None) -> bool:
    """Whether the machine has the edge `current -> target` (taken by `move`, if given)."""
    label = EDGES.get((current, target))
    return label is not None and (move is None or label is move)


def sources(move: Move, target: JobStatus) -> frozenset[JobStatus]:
    """The statuses from which `move` leads to `target`."""
    return frozenset(a for (a, b), m in EDGES.items() if m is move and b is target)
