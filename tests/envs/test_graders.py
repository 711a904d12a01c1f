"""Grader specs (parse-time validation) and built graders (scores, failures)."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from marlaas.config.graders import (
    PythonGraderSpec,
    RegexGraderSpec,
    WeightedGraderSpec,
    parse_grader,
)
from marlaas.envs import graders as graders_mod
from marlaas.envs.graders import build_grader
from marlaas.errors import GraderError

HAS_SANDBOX = importlib.util.find_spec("marlaas.envs.sandbox") is not None
needs_sandbox = pytest.mark.skipif(not HAS_SANDBOX, reason="marlaas.envs.sandbox not present")


async def score(spec: dict[str, Any], completion: str, reference: str, **row: object) -> float:
    return await build_grader(parse_grader(spec))(completion, reference, row)


# --- specs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        ({"type": "nope"}, ["`type`", "unknown grader type 'nope'", "exact"]),
        ({"strip": True}, ["`type`", "missing"]),
        ({"type": "regex", "pattern": "(a"}, ["`pattern`", "not a valid regular expression"]),
        (
            {"type": "regex", "pattern": "x", "substitute_reference": True},
            ["`pattern`", "{reference}"],
        ),
        ({"type": "python", "code": "x = 1"}, ["`code`", "no top-level function `grade`"]),
        ({"type": "python", "code": "def grade(:\n"}, ["`code`", "does not parse"]),
        (
            {"type": "python", "code": "def f():\n    def grade(c, r, w):\n        return 1\n"},
            ["`code`", "no top-level function `grade`"],
        ),
        ({"type": "python", "code": "def grade(c):\n    return 1\n"}, ["`code`", "three"]),
        (
            {"type": "python", "code": "async def grade(c, r, w):\n    return 1\n"},
            ["`code`", "async def"],
        ),
        ({"type": "exact", "mode": "eq"}, ["`mode`", "'eq'"]),
        ({"type": "exact", "stirp": True}, ["`stirp`", "unknown field"]),
        ({"type": "numeric", "abs_tol": -1}, ["`abs_tol`", "greater than or equal to 0"]),
        ({"type": "weighted", "graders": []}, ["`graders`", "at least one"]),
        (
            {"type": "weighted", "graders": [{"weight": 0, "grader": {"type": "exact"}}]},
            ["`graders.0.weight`", "greater than 0"],
        ),
        (
            {"type": "weighted", "graders": [{"weight": -2, "grader": {"type": "exact"}}]},
            ["`graders.0.weight`", "(got -2)"],
        ),
        (
            {
                "type": "weighted",
                "graders": [
                    {"weight": 1, "grader": {"type": "exact"}},
                    {
                        "weight": 1,
                        "grader": {
                            "type": "weighted",
                            "graders": [{"weight": 1, "grader": {"type": "regex", "pattern": "["}}],
                        },
                    },
                ],
            },
            ["`graders.1.grader.graders.0.grader.pattern`", "not a valid regular expression"],
        ),
        (
            {"type": "weighted", "graders": [{"weight": 1, "grader": {"type": "bogus"}}]},
            ["`graders.0.grader.type`", "unknown grader type 'bogus'"],
        ),
    ],
)
def test_bad_specs_name_the_field(spec: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(GraderError) as info:
        parse_grader(spec)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_non_mapping_spec_is_a_grader_error() -> None:
    with pytest.raises(GraderError, match="must be an object"):
        parse_grader(["exact"])  # type: ignore[arg-type]


def test_specs_are_frozen_and_weights_normalised() -> None:
    spec = parse_grader(
        {
            "type": "weighted",
            "graders": [
                {"weight": 1, "grader": {"type": "exact"}},
                {"weight": 3, "grader": {"type": "math"}},
            ],
        }
    )
    assert isinstance(spec, WeightedGraderSpec)
    assert spec.normalized_weights == (0.25, 0.75)
    regex = parse_grader({"type": "regex", "pattern": "a+"})
    assert isinstance(regex, RegexGraderSpec)
    with pytest.raises(ValueError):
        regex.pattern = "b"  # type: ignore[misc]


def test_python_spec_accepts_defaults_and_varargs() -> None:
    for code in (
        "def grade(c, r, row, extra=1):\n    return 1.0\n",
        "def grade(*args):\n    return 1.0\n",
    ):
        assert isinstance(parse_grader({"type": "python", "code": code}), PythonGraderSpec)


# --- string, numeric, regex ----------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "completion", "reference", "expected"),
    [
        ({}, " Paris \n", "Paris", 1.0),
        ({}, "paris", "Paris", 0.0),
        ({"case_sensitive": False}, "PARIS", "paris", 1.0),
        ({"strip": False}, " Paris", "Paris", 0.0),
        ({"mode": "contains"}, "It is Paris, France", "Paris", 1.0),
        ({"mode": "contains"}, "It is Lyon", "Paris", 0.0),
        ({"mode": "startswith"}, "Paris, France", "Paris", 1.0),
        ({"mode": "startswith"}, "In Paris", "Paris", 0.0),
    ],
)
async def test_exact(
    options: dict[str, Any], completion: str, reference: str, expected: float
) -> None:
    assert await score({"type": "exact", **options}, completion, reference) == expected


@pytest.mark.parametrize(
    ("options", "completion", "reference", "expected"),
    [
        ({}, "The answer is 42.", "42", 1.0),
        ({}, "42 or maybe 41", "42", 0.0),
        ({"pick": "first"}, "42 or maybe 41", "42", 1.0),
        ({}, "it costs 1,000 dollars", "1000", 1.0),
        ({}, "x = -3.5", "-3.5", 1.0),
        ({}, "about 1e3", "1000", 1.0),
        ({}, "no number here", "1", 0.0),
        ({}, "100.0000001", "100", 1.0),
        ({}, "100.01", "100", 0.0),
        ({"abs_tol": 0.1}, "100.05", "100", 1.0),
        ({"abs_tol": 0, "rel_tol": 0.01}, "99.5", "100", 1.0),
        ({"abs_tol": 0, "rel_tol": 0.01}, "98", "100", 0.0),
    ],
)
async def test_numeric(
    options: dict[str, Any], completion: str, reference: str, expected: float
) -> None:
    assert await score({"type": "numeric", **options}, completion, reference) == expected


async def test_numeric_reference_must_be_a_number() -> None:
    with pytest.raises(GraderError, match="reference 'forty' is not a number"):
        await score({"type": "numeric"}, "40", "forty")


@pytest.mark.parametrize(
    ("options", "completion", "reference", "expected"),
    [
        ({"pattern": r"\d+"}, " 123 ", "", 1.0),
        ({"pattern": r"\d+"}, "abc 123", "", 0.0),
        ({"pattern": r"\d+", "mode": "search"}, "abc 123", "", 1.0),
        ({"pattern": "yes", "ignore_case": True}, "YES", "", 1.0),
        ({"pattern": "yes"}, "YES", "", 0.0),
        (
            {"pattern": "answer: {reference}", "substitute_reference": True, "mode": "search"},
            "so answer: 1+1",
            "1+1",
            1.0,
        ),
        # The reference is escaped: '+' is literal, so '11' does not match '1+1'.
        (
            {"pattern": "answer: {reference}", "substitute_reference": True, "mode": "search"},
            "so answer: 11",
            "1+1",
            0.0,
        ),
    ],
)
async def test_regex(
    options: dict[str, Any], completion: str, reference: str, expected: float
) -> None:
    assert await score({"type": "regex", **options}, completion, reference) == expected


# --- math --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("1/2", 1.0),
        ("0.5", 1.0),
        ("\\frac{1}{2}", 1.0),
        ("The answer is $\\boxed{\\frac{1}{2}}$", 1.0),
        ("0.6", 0.0),
        ("1/3", 0.0),
        ("", 0.0),
    ],
)
async def test_math_equivalence(completion: str, expected: float) -> None:
    assert await score({"type": "math"}, completion, "\\frac{1}{2}") == expected


async def test_math_unparseable_reference_is_an_error() -> None:
    with pytest.raises(GraderError, match="could not be parsed"):
        await score({"type": "math"}, "1", "")


def test_the_math_grader_prints_nothing(tmp_path: Path) -> None:
    """math-verify warns "Timeout is disabled ..." when its own (signal-based) timeout
    is off, as we turn it off on purpose: a fresh interpreter grading twice writes
    nothing but its own output, on stdout or stderr."""
    script = (
        "import asyncio\n"
        "from marlaas.envs.graders import build_grader\n"
        "g = build_grader({'type': 'math'})\n"
        "async def main():\n"
        "    print(await g('1/2', '0.5', {}), await g('x', '2', {}))\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout == "1.0 0.0\n" and done.stderr == ""


async def test_math_timeout_is_a_grader_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def stuck(completion: str, reference: str) -> bool:
        time.sleep(1.0)
        return True

    monkeypatch.setattr(graders_mod, "_math_equal", stuck)
    grader = build_grader({"type": "math", "timeout_s": 0.05})
    start = time.monotonic()
    with pytest.raises(GraderError, match="no verdict within"):
        await grader("1", "1", {})
    assert time.monotonic() - start < 0.8


# --- weighted ------------------------------------------------------------------------

WEIGHTED = {
    "type": "weighted",
    "graders": [
        {"weight": 1, "grader": {"type": "exact", "mode": "contains"}},
        {
            "weight": 3,
            "grader": {
                "type": "weighted",
                "graders": [
                    {"weight": 1, "grader": {"type": "numeric"}},
                    {"weight": 1, "grader": {"type": "regex", "pattern": r"\d+"}},
                ],
            },
        },
    ],
}


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("7", 1.0),  # contains, numeric, regex
        ("x 7", 0.25 + 0.375),  # contains, numeric; not a full regex match
        ("8", 0.375),  # only the regex
        ("none", 0.0),
    ],
)
async def test_weighted_nested(completion: str, expected: float) -> None:
    assert await score(WEIGHTED, completion, "7") == pytest.approx(expected)


async def test_weighted_child_failure_names_the_child() -> None:
    spec = {
        "type": "weighted",
        "graders": [
            {"weight": 1, "grader": {"type": "exact"}},
            {"weight": 1, "grader": {"type": "numeric"}},
        ],
    }
    with pytest.raises(GraderError, match=r"child 1 \(numeric\).*not a number"):
        await score(spec, "x", "not-a-number")


# --- python (sandboxed) ----------------------------------------------------------------

GOOD = """
import json
def grade(completion, reference, row):
    print("debug output goes to the log, not the score")
    bonus = 0.5 if row.get("level") == "easy" else 0.0
    return (0.5 if completion.strip() == reference else 0.0) + bonus
"""


@pytest.fixture
def sandbox() -> Any:
    from marlaas.envs.sandbox import default_sandbox

    return default_sandbox()


@needs_sandbox
async def test_python_grader_scores(sandbox: Any) -> None:
    grader = build_grader({"type": "python", "code": GOOD}, sandbox=sandbox)
    results = await asyncio.gather(
        grader("42", "42", {"level": "easy"}),
        grader("42", "42", {"level": "hard"}),
        grader("41", "42", {"level": "hard"}),
    )
    assert results == [1.0, 0.5, 0.0]


@needs_sandbox
@pytest.mark.parametrize(
    ("code", "fragments"),
    [
        (
            "def grade(c, r, row):\n    raise ValueError('boom from user')\n",
            ["python grader failed", "boom from user"],
        ),
        ("def grade(c, r, row):\n    return 'yes'\n", ["returned 'yes' (str)"]),
        ("def grade(c, r, row):\n    return None\n", ["returned None (NoneType)"]),
        ("def grade(c, r, row):\n    return 1.5\n", ["returned 1.5", "[0, 1]"]),
        ("def grade(c, r, row):\n    return float('nan')\n", ["returned nan"]),
        ("import sys\ndef grade(c, r, row):\n    sys.exit(0)\n", ["no score"]),
    ],
)
async def test_python_grader_failures(sandbox: Any, code: str, fragments: list[str]) -> None:
    grader = build_grader({"type": "python", "code": code}, sandbox=sandbox)
    with pytest.raises(GraderError) as info:
        await grader("a", "a", {})
    for fragment in fragments:
        assert fragment in str(info.value)


@needs_sandbox
async def test_python_grader_hang_is_contained(sandbox: Any) -> None:
    code = "import time\ndef grade(c, r, row):\n    time.sleep(60)\n    return 1.0\n"
    grader = build_grader({"type": "python", "code": code, "timeout_s": 1.0}, sandbox=sandbox)
    fast = build_grader({"type": "exact"})
    start = time.monotonic()
    hung = asyncio.create_task(grader("a", "a", {}))
    # The event loop stays free while the user code hangs.
    assert await fast("a", "a", {}) == 1.0
    assert time.monotonic() - start < 0.5
    with pytest.raises(GraderError, match="python grader failed"):
        await hung
    assert time.monotonic() - start < 10


@needs_sandbox
async def test_python_grader_output_flood_is_contained(sandbox: Any) -> None:
    code = "def grade(c, r, row):\n    print('x' * 10**6)\n    return 1.0\n"
    grader = build_grader({"type": "python", "code": code, "timeout_s": 2.0}, sandbox=sandbox)
    with pytest.raises(GraderError, match="output limit") as info:
        await grader("a", "a", {})
    assert len(str(info.value)) < 3000  # the log in the message is bounded
