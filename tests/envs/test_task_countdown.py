"""Countdown verification: cheap checks in-process, evaluation in the sandbox."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

import pytest

from marlaas.envs.base import Example
from marlaas.envs.tasks.calculator import safe_eval
from marlaas.envs.tasks.countdown import CountdownFamily, syntax_ok


@dataclass(frozen=True)
class CannedResult:
    ok: bool
    stdout: str


class LocalRunner:
    """Runs the sandbox program in a plain subprocess: tests the evaluator itself."""

    async def run_python(self, code: str, *, stdin: str = "") -> CannedResult:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", code,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await proc.communicate(stdin.encode())
        return CannedResult(ok=proc.returncode == 0, stdout=out.decode())


class RecordingSandbox:
    """Counts calls and answers with a canned result."""

    def __init__(self, result: CannedResult) -> None:
        self.calls: list[tuple[str, str]] = []
        self.result = result

    async def run_python(self, code: str, *, stdin: str = "") -> CannedResult:
        self.calls.append((code, stdin))
        return self.result


def _example(target: int, numbers: list[int]) -> Example:
    return Example(
        id="countdown-test-0-0",
        prompt=f"Q: make {target} from {' '.join(map(str, numbers))}\nA: ",
        reference="",
        meta={"numbers": numbers, "target": target},
    )


async def _score(family: CountdownFamily, example: Example, action: str) -> float:
    result = await family.make_env(example).step(action)
    assert result.done
    return result.reward


@pytest.mark.parametrize(
    "action",
    ["3*4-2-2", "3*4", "3*4-5", "3*4-02", "3*4-2.0", "3*4-2;", "__import__('os')", "3**4-2",
     "12//4+2", "3*4-2 # x", "abs(3*4-2)", "3*4-2e0", ""],
)  # fmt: skip
async def test_rejected_without_touching_the_sandbox(action: str) -> None:
    sandbox = RecordingSandbox(CannedResult(ok=True, stdout='{"num": 10, "den": 1}'))
    family = CountdownFamily(sandbox=sandbox)
    assert await _score(family, _example(10, [2, 3, 4]), action) == 0.0
    assert sandbox.calls == []


@pytest.mark.parametrize(
    ("numbers", "target", "action"),
    [
        ([2, 3, 4], 10, "3*4-2"),
        ([2, 3, 4], 10, " 4 * 3 - 2 "),
        ([2, 3, 4], 10, "4*3-2"),
        ([2, 3, 4], 10, "(2*3)+4"),
        ([12, 2, 1], 6, "12/2*1"),
        ([6, 4, 3], 8, "(6/3)*4"),
        ([5, 5], 1, "5/5"),
        ([7, 7, 2], 2, "-7+7+2"),
    ],
)
async def test_correct_expressions_are_accepted_via_the_sandbox(
    numbers: list[int], target: int, action: str
) -> None:
    family = CountdownFamily(sandbox=LocalRunner())
    result = await family.make_env(_example(target, numbers)).step(action)
    assert result.reward == 1.0 and result.metrics["sandbox_calls"] == 1.0


@pytest.mark.parametrize("action", ["2*3-4", "3 4 2", "2/(4-4)*3", "3*(4-2", "(3*)4-2", "3*4--2"])
async def test_well_formed_but_wrong_gets_zero(action: str) -> None:
    family = CountdownFamily(sandbox=LocalRunner())
    assert await _score(family, _example(10, [2, 3, 4]), action) == 0.0


@pytest.mark.parametrize(
    "result",
    [CannedResult(False, '{"num": 10, "den": 1}'), CannedResult(True, "garbage"),
     CannedResult(True, ""), CannedResult(True, '{"error": "ValueError"}'),
     CannedResult(True, '{"num": 10, "den": 0}')],
)  # fmt: skip
async def test_failed_sandbox_runs_get_zero(result: CannedResult) -> None:
    sandbox = RecordingSandbox(result)
    family = CountdownFamily(sandbox=sandbox)
    assert await _score(family, _example(10, [2, 3, 4]), "3*4-2") == 0.0
    assert len(sandbox.calls) == 1
    assert '"expr": "3*4-2"' in sandbox.calls[0][1]


def test_references_are_valid_solutions() -> None:
    for n in (2, 3, 4):
        family = CountdownFamily(n_numbers=n, sandbox=RecordingSandbox(CannedResult(True, "")))
        for e in family.examples("train", 150):
            numbers, target = list(e.meta["numbers"]), int(e.meta["target"])  # type: ignore[call-overload]
            assert len(numbers) == n and all(1 <= x <= 12 for x in numbers)
            assert 1 <= target <= 150
            assert " " not in e.reference and syntax_ok(e.reference, numbers)
            assert safe_eval(e.reference) == target
            assert e.prompt == f"Q: make {target} from {' '.join(map(str, numbers))}\nA: "


async def test_default_sandbox_verifies_a_demonstration() -> None:
    family = CountdownFamily()
    example = family.examples("eval", 1)[0]
    good = await family.make_env(example).step(example.reference)
    assert good.reward == 1.0 and good.metrics["sandbox_calls"] == 1.0
    numbers = list(example.meta["numbers"])  # type: ignore[call-overload]
    wrong = "-".join(map(str, numbers))
    expected = 1.0 if safe_eval(wrong) == example.meta["target"] else 0.0
    assert await _score(family, example, wrong) == expected
