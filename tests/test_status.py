"""The one job-status machine: the pipeline's tenant states and the service's job rows
take its edges, and nothing else."""

from __future__ import annotations

import pytest

from marlaas.service.lifecycle import ACTIONS, REPORTED, Action
from marlaas.status import ACTIVE, EDGES, TERMINAL, JobStatus, Move, can_move, sources


def test_terminal_statuses_have_no_way_out() -> None:
    assert set(JobStatus) == TERMINAL | ACTIVE and not TERMINAL & ACTIVE
    assert all(a in ACTIVE for a, _ in EDGES)
    assert all(s.terminal for s in TERMINAL) and not any(s.terminal for s in ACTIVE)


@pytest.mark.parametrize(
    ("current", "target", "move"),
    [
        ("queued", "running", Move.ADMIT),
        ("running", "paused", Move.PAUSE),
        ("paused", "running", Move.UNPAUSE),
        ("paused", "queued", Move.UNPAUSE),
        ("paused", "done", Move.FINISH),
        ("queued", "cancelled", Move.CANCEL),
    ],
)
def test_edges_are_labelled_with_their_move(current: str, target: str, move: Move) -> None:
    assert can_move(JobStatus(current), JobStatus(target), move)
    others = [m for m in Move if m is not move]
    assert not any(can_move(JobStatus(current), JobStatus(target), m) for m in others)


def test_no_shortcuts() -> None:
    assert not can_move(JobStatus.QUEUED, JobStatus.DONE)  # done follows running
    assert not can_move(JobStatus.RUNNING, JobStatus.QUEUED)
    assert not can_move(JobStatus.DONE, JobStatus.RUNNING)


def test_the_service_tables_are_the_machines() -> None:
    assert ACTIONS[Action.RESUME] == (sources(Move.UNPAUSE, JobStatus.QUEUED), JobStatus.QUEUED)
    assert ACTIONS[Action.RESUME][0] == {JobStatus.PAUSED}
    assert ACTIONS[Action.PAUSE][0] == {JobStatus.QUEUED, JobStatus.RUNNING}
    assert ACTIONS[Action.CANCEL][0] == ACTIVE
    assert {
        JobStatus.RUNNING: {JobStatus.QUEUED},
        JobStatus.DONE: {JobStatus.RUNNING, JobStatus.PAUSED},
        JobStatus.FAILED: ACTIVE,
    } == REPORTED
