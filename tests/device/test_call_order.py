"""Which queued calls one turn of the device thread runs (`device.ops.take`), and when a
pass waits for more tenants (`device.ops.PassGathering`)."""

from __future__ import annotations

from concurrent.futures import Future

from marlaas.device.ops import (
    ACTIVE_WINDOW_S,
    GATHER_TENANTS,
    GATHER_TURNS,
    Op,
    PassGathering,
    Phase,
    take,
)


def op(phase: Phase, *tenants: str) -> Op:
    return Op(phase, tenants, Future())


FB, FWD, OPT, ADD, AFTER = (
    Phase.FORWARD_BACKWARD,
    Phase.FORWARD,
    Phase.OPTIM,
    Phase.ADD,
    Phase.AFTER,
)


def names(ops: list[Op]) -> list[tuple[str, tuple[str, ...]]]:
    return [(o.phase.name, o.tenants) for o in ops]


def test_every_tenants_pending_pass_joins_one_turn() -> None:
    queue = [op(FB, "a"), op(FB, "b"), op(FB, "c", "d"), op(FB, "a")]
    taken, waiting = take(queue)
    assert names(taken) == [("FORWARD_BACKWARD", ("a",)), ("FORWARD_BACKWARD", ("b",)),
                            ("FORWARD_BACKWARD", ("c", "d"))]  # fmt: skip
    assert waiting == [queue[3]]  # a's second pass waits for the next one


def test_a_tenants_calls_run_in_order_phase_by_phase() -> None:
    # add, pass, step, snapshot of one tenant, queued together: one turn, in that order
    queue = [op(ADD, "a"), op(FB, "a"), op(OPT, "a"), op(AFTER, "a")]
    taken, waiting = take(queue)
    assert taken == queue and waiting == []
    # a step queued before a pass: the pass must see the stepped weights, so it waits
    queue = [op(OPT, "a"), op(FB, "a"), op(OPT, "a")]
    taken, waiting = take(queue)
    assert taken == queue[:1] and waiting == queue[1:]
    # forward then forward_backward: the second is an earlier phase, so it waits
    queue = [op(FWD, "a"), op(FB, "a")]
    assert take(queue) == (queue[:1], queue[1:])


def test_a_waiting_call_holds_back_the_later_calls_of_its_tenants_only() -> None:
    queue = [op(OPT, "a"), op(ADD, "a"), op(AFTER, "a"), op(FB, "a", "b"), op(FB, "c")]
    taken, waiting = take(queue)
    # a's add comes after its step (an earlier phase): it and everything of `a` after it
    # waits, including the two-tenant pass, which also holds back `b`; `c` runs.
    assert taken == [queue[0], queue[4]]
    assert waiting == queue[1:4]


def test_without_passes_cheap_calls_still_run() -> None:
    queue = [op(FB, "a"), op(OPT, "a"), op(OPT, "b"), op(AFTER, "c")]
    taken, waiting = take(queue, passes=False)
    assert taken == [queue[2], queue[3]]
    assert waiting == queue[:2]  # a's step stays behind its pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gathering_with(training: int) -> tuple[PassGathering, Clock]:
    clock = Clock()
    gathering = PassGathering(clock)
    gathering.ran([f"t{i}" for i in range(training)])
    return gathering, clock


def test_a_pass_of_few_tenants_waits_a_few_iterations_for_more() -> None:
    gathering, _ = gathering_with(32)
    few = [op(FB, "t0"), op(FB, "t1"), op(OPT, "t0")]
    held = [gathering.hold(few, rows_waiting=True) for _ in range(GATHER_TURNS + 1)]
    assert held == [True] * GATHER_TURNS + [False]  # then it runs, held or not
    assert gathering.hold(few, rows_waiting=True)  # the next pass is held afresh
    enough = [op(FB, f"t{i}") for i in range(GATHER_TENANTS)]
    assert not PassGathering(gathering.clock).hold(enough, rows_waiting=True)
    assert not gathering_with(32)[0].hold(enough, rows_waiting=True)


def test_a_pass_is_not_held_when_nothing_else_would_run_or_nobody_else_trains() -> None:
    gathering, _ = gathering_with(32)
    assert not gathering.hold([op(FB, "t0")], rows_waiting=False)  # the engine is empty
    assert not gathering.hold([op(FWD, "t0"), op(OPT, "t1")], rows_waiting=True)  # no pass
    for training in (0, 1, 2, 3):  # a lone tenant, or two, never waits
        lone, _ = gathering_with(training)
        assert not lone.hold([op(FB, "t0")], rows_waiting=True), training
    # Half the training tenants is enough, up to GATHER_TENANTS.
    four, _ = gathering_with(8)
    assert four.hold([op(FB, "a"), op(FB, "b"), op(FB, "c")], rows_waiting=True)
    assert not four.hold([op(FB, "a"), op(FB, "b"), op(FB, "c", "d")], rows_waiting=True)


def test_tenants_count_as_training_for_the_active_window_only() -> None:
    gathering, clock = gathering_with(32)
    assert len(gathering.training()) == 32
    clock.now += ACTIVE_WINDOW_S / 2
    gathering.ran(["late"])
    assert gathering.hold([op(FB, "t0")], rows_waiting=True)
    clock.now += ACTIVE_WINDOW_S / 2 + 0.01  # the 32 passed out of the window
    assert gathering.training() == {"late"}
    assert not gathering.hold([op(FB, "t0")], rows_waiting=True)
