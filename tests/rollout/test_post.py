"""`rollout.engine.post`: calls from the stepping thread onto an event loop run there in
the order posted, share one wake-up while the loop has not run the earlier ones, go on
past a call that raises, and do nothing once the loop is closed."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from marlaas.rollout.engine import post


def test_calls_run_in_order_with_one_wake_up_per_batch() -> None:
    loop = asyncio.new_event_loop()
    wakes = 0
    original = loop.call_soon_threadsafe

    def counting(callback: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal wakes
        wakes += 1
        return original(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    seen: list[int] = []
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))

    def boom() -> None:
        raise ValueError("a listener that raises")

    def from_a_thread() -> None:  # the loop is not running: every call waits for it
        for i in range(500):
            post(loop, seen.append, i)
            if i == 250:
                post(loop, boom)

    worker = threading.Thread(target=from_a_thread)
    worker.start()
    worker.join()
    assert wakes == 1 and seen == []
    loop.run_until_complete(asyncio.sleep(0))
    assert seen == list(range(500))
    assert len(errors) == 1 and isinstance(errors[0]["exception"], ValueError)
    post(loop, seen.append, 500)  # the loop ran the batch: the next call wakes it again
    assert wakes == 2
    loop.run_until_complete(asyncio.sleep(0))
    assert seen[-1] == 500
    loop.close()
    post(loop, seen.append, 501)  # closed: nobody waits, nothing raises
    assert seen[-1] == 500
