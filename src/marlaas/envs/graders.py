"""Turn a grader spec (`marlaas.config.graders`) into an async scoring function.

Contract of a `Grader`: `await grader(completion, reference, row)` returns a float in
[0, 1]; `row` holds the example's other fields. It never blocks the event loop for long:

- `exact`, `numeric`, `regex` are pure and fast; they compute inline.
- `math` runs math-verify in a small dedicated thread pool with a timeout, so that a
  pathological input neither blocks the loop nor starves `asyncio.to_thread` users.
  A thread cannot be killed: a timed-out call keeps its worker until it finishes, and
  once every worker is stuck, further math calls time out (GraderError) instead of
  hanging. math-verify's own signal-based timeout only works in the main thread, so it
  is disabled here and only the last `max_chars` of a completion are parsed.
- `python` runs the user's `grade` in the sandbox (`marlaas.envs.sandbox`; standard
  library only, the spec's `timeout_s` as wall and CPU limit): a fixed
  wrapper reads `{"completion", "reference", "row"}` as JSON on stdin, calls `grade`
  with the user's prints redirected to stderr, and writes one marked JSON line with the
  result to stdout.
- `weighted` awaits its children concurrently and returns their normalised weighted mean.
- `openai` evaluates an OpenAI grader (`marlaas.envs.openai_graders`); its python graders
  run in the same sandbox, its model graders (`score_model`, `label_model`) call the
  `judge` the caller gives (the pipeline's, `marlaas.pipeline.judges`). Without one, a
  model grader fails to score (`GraderError`).

Any failure to score (a user grader that raises, hangs, exits or returns a non-number
or a value outside [0, 1]; a reference the grader cannot read; a math timeout) raises
`GraderError` with the reason. Deciding what fails (one tenant's work) is the caller's job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from marlaas.config.graders import (
    REFERENCE_PLACEHOLDER,
    ExactGraderSpec,
    GraderSpec,
    MathGraderSpec,
    NumericGraderSpec,
    OpenAIGraderSpec,
    PythonGraderSpec,
    RegexGraderSpec,
    WeightedGraderSpec,
    parse_grader,
)
from marlaas.errors import GraderError

if TYPE_CHECKING:
    from marlaas.envs.openai_graders import Judge
    from marlaas.envs.sandbox import Sandbox


class Grader(Protocol):
    """An async scoring function; see the module docstring for the contract."""

    async def __call__(self, completion: str, reference: str, row: Mapping[str, object]) -> float:
        """Score `completion` against `reference`; a float in [0, 1]."""
        ...


def build_grader(
    spec: GraderSpec | Mapping[str, Any],
    *,
    sandbox: Sandbox | None = None,
    judge: Judge | None = None,
) -> Grader:
    """A ready grader for `spec` (a parsed spec, or plain data that `parse_grader` takes).

    `sandbox` runs `python` graders; without it they use the default sandbox. `judge`
    answers the model graders of OpenAI graders.
    """
    if isinstance(spec, Mapping):
        spec = parse_grader(spec)
    if isinstance(spec, ExactGraderSpec):
        return ExactGrader(spec)
    if isinstance(spec, NumericGraderSpec):
        return NumericGrader(spec)
    if isinstance(spec, RegexGraderSpec):
        return RegexGrader(spec)
    if isinstance(spec, MathGraderSpec):
        return MathGrader(spec)
    if isinstance(spec, PythonGraderSpec):
        if sandbox is None:
            from marlaas.envs.sandbox import default_sandbox

            sandbox = default_sandbox()
        return PythonGrader(spec, sandbox)
    if isinstance(spec, WeightedGraderSpec):
        children = [
            build_grader(child.grader, sandbox=sandbox, judge=judge) for child in spec.graders
        ]
        return WeightedGrader(spec, children)
    if isinstance(spec, OpenAIGraderSpec):
        from marlaas.envs.openai_graders import OpenAIRewardGrader

        return OpenAIRewardGrader(spec.grader, sandbox=sandbox, judge=judge)
    raise GraderError(f"unknown grader spec {type(spec).__name__}")


class ExactGrader:
    """String equality, containment or prefix."""

    def __init__(self, spec: ExactGraderSpec) -> None:
        self.spec = spec

    def _norm(self, text: str) -> str:
        if self.spec.strip:
            text = text.strip()
        return text if self.spec.case_sensitive else text.casefold()

    async def __call__(self, completion: str, reference: str, row: Mapping[str, object]) -> float:
        got, want = self._norm(completion), self._norm(reference)
        if self.spec.mode == "equals":
            hit = got == want
        elif self.spec.mode == "contains":
            hit = want in got
        else:
            hit = got.startswith(want)
        return 1.0 if hit else 0.0


# An optionally signed integer or decimal, with optional thousands separators and
# exponent; never starts inside another number.
_NUMBER = re.compile(
    r"(?<![\d.])[-+]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
)


def parse_number(text: str) -> float:
    """A number token as matched by `_NUMBER` (thousands separators allowed)."""
    return float(text.replace(",", ""))


class NumericGrader:
    """The first or last number of the completion, within tolerance of the reference."""

    def __init__(self, spec: NumericGraderSpec) -> None:
        self.spec = spec

    async def __call__(self, completion: str, reference: str, row: Mapping[str, object]) -> float:
        ref = reference.strip()
        if _NUMBER.fullmatch(ref) is None:
            raise GraderError(
                f"numeric grader: the reference {reference!r} is not a number; "
                "store references as plain numbers such as '42' or '-3.5'"
            )
        want = parse_number(ref)
        found = _NUMBER.findall(completion)
        if not found:
            return 0.0
        got = parse_number(found[0] if self.spec.pick == "first" else found[-1])
        tol = max(self.spec.abs_tol, self.spec.rel_tol * abs(want))
        return 1.0 if abs(got - want) <= tol else 0.0


class RegexGrader:
    """A regular-expression match, the reference optionally substituted in."""

    def __init__(self, spec: RegexGraderSpec) -> None:
        self.spec = spec
        self._flags = re.IGNORECASE if spec.ignore_case else 0
        self._fixed = None if spec.substitute_reference else re.compile(spec.pattern, self._flags)

    def _pattern(self, reference: str) -> re.Pattern[str]:
        if self._fixed is not None:
            return self._fixed
        source = self.spec.pattern.replace(REFERENCE_PLACEHOLDER, re.escape(reference))
        try:
            return re.compile(source, self._flags)
        except re.error as exc:  # e.g. '{reference}' placed inside a character class
            raise GraderError(
                f"regex grader: pattern {source!r} with the reference substituted "
                f"does not compile ({exc})"
            ) from exc

    async def __call__(self, completion: str, reference: str, row: Mapping[str, object]) -> float:
        pattern = self._pattern(reference)
        text = completion.strip() if self.spec.strip else completion
        match = pattern.fullmatch(text) if self.spec.mode == "fullmatch" else pattern.search(text)
        return 1.0 if match is not None else 0.0


@functools.cache
def _math_pool() -> ThreadPoolExecutor:
    # Separate from the loop's default executor: stuck math-verify calls must not starve
    # other users of asyncio.to_thread. Created once per process on first use.
    _quiet_math_verify()
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="marlaas-math")


class _NoTimeoutWarning(logging.Filter):
    """Drops math-verify's "Timeout is disabled ..." warning: we disable its
    signal-based timeout on purpose (it works only in the main thread) and bound each
    call ourselves (`MathGrader`), so the warning is noise in every run's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


def _quiet_math_verify() -> None:
    for name in ("math_verify.grader", "math_verify.parser"):
        logging.getLogger(name).addFilter(_NoTimeoutWarning())


def _math_equal(completion: str, reference: str) -> bool:
    from math_verify import parse, verify  # sympy-heavy: imported on first use

    gold = parse(reference, parsing_timeout=None)  # type: ignore[arg-type]
    if not gold:
        raise GraderError(f"math grader: the reference {reference!r} could not be parsed")
    answer = parse(completion, parsing_timeout=None)  # type: ignore[arg-type]
    if not answer:
        return False
    return bool(verify(gold, answer, timeout_seconds=None))


class MathGrader:
    """Mathematical equivalence of the completion's answer and the reference."""

    def __init__(self, spec: MathGraderSpec) -> None:
        self.spec = spec

    async def __call__(self, completion: str, reference: str, row: Mapping[str, object]) -> float:
        tail = completion[-self.spec.max_chars :]
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(_math_pool(), _math_equal, tail, reference)
        try:
            equal = await asyncio.wait_for(job, self.spec.timeout_s)
        except TimeoutError as exc:
            raise GraderError(
                f"math grader: no verdict within {self.spec.timeout_s:g}s "
                f"(reference {reference!r}); the input may be pathological"
            ) from exc
        return 1.0 if equal else 0.0


#: Seconds past a python grader's timeout before we stop waiting for the sandbox.
_SANDBOX_GRACE_S = 5.0
#: Prefix of the wrapper's result line on stdout.
SCORE_MARKER = "__marlaas_grade__ "

_WRAPPER = """\
import contextlib, json, numbers, sys, traceback
_USER_CODE = {code!r}
def _main():
    payload = json.loads(sys.stdin.read())
    ns = {{"__name__": "__grader__"}}
    try:
        with contextlib.redirect_stdout(sys.stderr):
            exec(compile(_USER_CODE, "<grader>", "exec"), ns)
            score = ns["grade"](payload["completion"], payload["reference"], payload["row"])
    except Exception as exc:
        # Show the user's frames only: the wrapper is not theirs to debug.
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<grader>":
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        sys.exit(1)
    if isinstance(score, numbers.Real):
        out = {{"score": float(score)}}
    else:
        out = {{"bad": repr(score)[:200], "type": type(score).__name__}}
    sys.stdout.write("\\n" + {marker!r} + json.dumps(out) + "\\n")
    sys.stdout.flush()
_main()
"""


def _tail(text: str, lines: int = 15, chars: int = 2000) -> str:
    """The end of a log, bounded in lines and characters."""
    kept = "\n".join(text.strip().splitlines()[-lines:])
    return kept if len(kept) <= chars else "..." + kept[-chars:]


class PythonGrader:
    """User code in the sandbox; see the module docstring for the protocol."""

    def __init__(self, spec: PythonGraderSpec, sandbox: Sandbox) -> None:
        self.spec = spec
        self.sandbox = sandbox
        self._program = _WRAPPER.format(code=spec.code, marker=SCORE_MARKER)
        # The spec's timeout bounds wall and CPU time; memory, processes and output keep
        # the sandbox's own limits.
        self._limits = dataclasses.replace(
            sandbox.limits, wall_seconds=spec.timeout_s, cpu_seconds=spec.timeout_s
        )

    async def __call__(self, completion: str, reference: str, row: Mapping[str, object]) -> float:
        payload = json.dumps(
            {"completion": completion, "reference": reference, "row": dict(row)}, default=str
        )
        run = self.sandbox.run_python(self._program, stdin=payload, limits=self._limits)
        try:
            # Defence in depth: the sandbox enforces the wall limit itself, but a grader
            # must never hang its caller even if the sandbox does.
            result = await asyncio.wait_for(run, self.spec.timeout_s + _SANDBOX_GRACE_S)
        except TimeoutError as exc:
            raise GraderError(
                f"python grader failed: the sandbox did not return within "
                f"{self.spec.timeout_s + _SANDBOX_GRACE_S:g}s"
            ) from exc
        if result.timed_out:
            raise GraderError(
                f"python grader failed: timed out after {self.spec.timeout_s:g}s "
                "(raise timeout_s if grading is legitimately slow)"
            )
        if not result.ok:
            reason = result.reason or f"exit status {result.returncode}"
            log = _tail(result.stderr)
            raise GraderError(f"python grader failed ({reason})" + (f":\n{log}" if log else ""))
        return _read_score(result.stdout)


def _read_score(stdout: str) -> float:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(SCORE_MARKER)]
    if not lines:
        raise GraderError(
            "python grader produced no score: `grade` must return normally "
            "(do not call sys.exit or close stdout)"
        )
    try:
        out = json.loads(lines[-1][len(SCORE_MARKER) :])
        if not isinstance(out, dict) or not ("score" in out or "bad" in out):
            raise ValueError(out)
    except ValueError as exc:  # only a grader writing to the real stdout can cause this
        raise GraderError(f"python grader: malformed result line {lines[-1]!r:.200}") from exc
    if "bad" in out:
        raise GraderError(
            f"python grader: grade() returned {out['bad']} ({out['type']}); "
            "it must return a number in [0, 1]"
        )
    score = float(out["score"])
    if not (math.isfinite(score) and 0.0 <= score <= 1.0):
        raise GraderError(f"python grader: grade() returned {score!r}; it must be in [0, 1]")
    return score


class WeightedGrader:
    """The normalised weighted mean of its children, scored concurrently."""

    def __init__(self, spec: WeightedGraderSpec, children: list[Grader]) -> None:
        self.spec = spec
        self.children = children
        self.weights = spec.normalized_weights

    async def _child(
        self, i: int, completion: str, reference: str, row: Mapping[str, object]
    ) -> float:
        try:
            return await self.children[i](completion, reference, row)
        except GraderError as exc:
            kind = self.spec.graders[i].grader.type
            raise GraderError(f"weighted grader, child {i} ({kind}): {exc}") from exc

    async def __call__(self, completion: str, reference: str, row: Mapping[str, object]) -> float:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(self._child(i, completion, reference, row))
                    for i in range(len(self.children))
                ]
        except ExceptionGroup as group_error:
            # Surface the first grader failure as itself, not wrapped in a group.
            graders = group_error.subgroup(GraderError)
            if graders is None:
                raise
            first = graders.exceptions[0]
            while isinstance(first, ExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        total = sum(w * t.result() for w, t in zip(self.weights, tasks, strict=True))
        return min(1.0, max(0.0, total))
