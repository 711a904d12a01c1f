"""Which queued calls one turn of the device thread runs (`device.ops.take`)."""

from __future__ import annotations

from concurrent.futures import Future

from marlaas.device.ops import Op, Phase, take


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
