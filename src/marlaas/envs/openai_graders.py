"""OpenAI graders (`marlaas.config.openai_graders`) evaluated by marlaas.

`evaluate(grader, output_text, item, ...)` scores one model answer as OpenAI's
`alpha/graders/run` does: the reward, each multi sub-grader's score, the judges' token
usage and the error flags the SDK parses. `OpenAIRewardGrader` is the same evaluation
behind marlaas's `Grader` protocol, so a training pipeline scores with it like with
any other grader.

The sample a template or a python grader sees: `output_text` (the answer), `output_json`
(the answer parsed as JSON, or None when it is not JSON) and `output_tools` (always
empty: marlaas answers are text). The item is the dataset row.

Problems while grading never raise from `evaluate`: each becomes a flag with details
and the grader's score is 0, as OpenAI reports them. Whose problem it is decides what
training does with it (`Problem.fatal`): an answer the grader cannot read (not JSON
where the template wants `sample.output_json`, a judge answer that is no score) is a
reward of 0, part of learning; a broken grader (a python grader that raises, a row
without the field a template names, a formula that divides by zero, a judge or sandbox
that cannot run) raises `GraderError` in `OpenAIRewardGrader`, which fails the
tenant's work loudly instead of training on zeros.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from marlaas.config.openai_graders import (
    LabelModelGrader,
    MultiGrader,
    OpenAIGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
    formula_source,
    parse_openai_grader,
)
from marlaas.config.openai_templates import (
    TemplateVariableError,
    as_text,
    parse_template,
    render_template,
)
from marlaas.envs import text_metrics
from marlaas.errors import GraderError, SandboxError

if TYPE_CHECKING:
    from marlaas.envs.sandbox import Sandbox

#: Wall-clock (and CPU) seconds of one python grader call.
PYTHON_TIMEOUT_S = 30.0
#: Tokens a judge may write when its sampling params do not say.
JUDGE_MAX_TOKENS = 256
_MARKER = "__marlaas_openai_grade__ "


@dataclass(frozen=True)
class JudgeReply:
    text: str
    prompt_tokens: int
    completion_tokens: int


class JudgeError(GraderError):
    """The judge could not answer (its model is unknown, or serving failed)."""


class Judge(Protocol):
    """A model that reads chat messages and writes one answer (score and label graders)."""

    async def __call__(
        self,
        model: str,
        messages: Sequence[tuple[str, str]],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
    ) -> JudgeReply:
        """The judge's answer; `JudgeError` when it cannot give one."""
        ...


@dataclass(frozen=True)
class Problem:
    """One thing that went wrong: the SDK's flag, what happened, and whether it is the
    grader's fault (`fatal`) rather than the answer's."""

    flag: str
    detail: str
    fatal: bool


@dataclass
class Evaluation:
    reward: float
    scores: dict[str, float] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    token_usage: dict[str, dict[str, int]] = field(default_factory=dict)

    def failed(self, problem: Problem) -> Evaluation:
        self.problems.append(problem)
        self.reward = 0.0
        return self

    def error_flags(self) -> dict[str, Any]:
        """The `metadata.errors` object of OpenAI's run response."""
        flags: dict[str, Any] = {
            name: False
            for name in (
                "formula_parse_error",
                "invalid_variable_error",
                "model_grader_parse_error",
                "model_grader_refusal_error",
                "model_grader_server_error",
                "other_error",
                "python_grader_runtime_error",
                "python_grader_server_error",
                "sample_parse_error",
                "truncated_observation_error",
                "unresponsive_reward_error",
            )
        }
        details: dict[str, str | None] = {
            "model_grader_server_error_details": None,
            "python_grader_runtime_error_details": None,
            "python_grader_server_error_type": None,
        }
        detail_of = {
            "model_grader_server_error": "model_grader_server_error_details",
            "python_grader_runtime_error": "python_grader_runtime_error_details",
        }
        for p in self.problems:
            flags[p.flag] = True
            key = detail_of.get(p.flag)
            if key is not None and details[key] is None:  # the first one says most
                details[key] = p.detail
            if p.flag == "python_grader_server_error":
                details["python_grader_server_error_type"] = "sandbox"
        return {**flags, **details}


def make_sample(output_text: str) -> dict[str, Any]:
    try:
        output_json: Any = json.loads(output_text)
    except ValueError:
        output_json = None
    return {"output_text": output_text, "output_json": output_json, "output_tools": []}


def _render(text: str, values: Mapping[str, object]) -> str:
    """Render or raise `TemplateVariableError`."""
    return render_template(parse_template(text), values)


def _variable_problem(exc: TemplateVariableError, sample: Mapping[str, Any]) -> Problem:
    if exc.namespace == "item":
        return Problem("invalid_variable_error", f"the item lacks {exc}", fatal=True)
    if exc.path.startswith("sample.output_json") and sample.get("output_json") is None:
        return Problem("sample_parse_error", "the answer is not JSON: " + str(exc), fatal=False)
    return Problem("invalid_variable_error", f"the answer lacks {exc}", fatal=False)


class _Evaluator:
    """One evaluation's dependencies: the sandbox (python) and the judge (models)."""

    def __init__(self, sandbox: Sandbox | None, judge: Judge | None) -> None:
        self.sandbox = sandbox
        self.judge = judge

    async def run(self, grader: OpenAIGrader, values: Mapping[str, Any]) -> Evaluation:
        if isinstance(grader, MultiGrader):
            return await self.multi(grader, values)
        try:
            if isinstance(grader, StringCheckGrader):
                return Evaluation(_string_check(grader, values))
            if isinstance(grader, TextSimilarityGrader):
                text, ref = _render(grader.input, values), _render(grader.reference, values)
                metric = grader.evaluation_metric
                score = await asyncio.to_thread(text_metrics.similarity, metric, text, ref)
                return Evaluation(score)
            if isinstance(grader, PythonGrader):
                return await self.python(grader, values)
            return await self.model(grader, values)
        except TemplateVariableError as exc:
            return Evaluation(0.0).failed(_variable_problem(exc, values["sample"]))

    async def multi(self, grader: MultiGrader, values: Mapping[str, Any]) -> Evaluation:
        from simpleeval import DEFAULT_OPERATORS, SimpleEval

        names = list(grader.graders)
        subs = await asyncio.gather(*(self.run(grader.graders[n], values) for n in names))
        out = Evaluation(0.0, scores={n: e.reward for n, e in zip(names, subs, strict=True)})
        for name, sub in zip(names, subs, strict=True):
            out.problems.extend(
                dataclasses.replace(p, detail=f"{name}: {p.detail}") for p in sub.problems
            )
            for model, usage in sub.token_usage.items():
                _add_usage(out.token_usage, model, usage)
        functions = {f: getattr(math, f) for f in ("floor", "ceil", "exp", "sqrt", "log")}
        functions.update(min=min, max=max, abs=abs)
        evaluator = SimpleEval(
            operators=DEFAULT_OPERATORS, functions=functions, names=dict(out.scores)
        )
        try:
            value = float(evaluator.eval(formula_source(grader.calculate_output)))
        except Exception as exc:  # simpleeval raises many kinds; every one is the formula's
            return out.failed(
                Problem(
                    "formula_parse_error",
                    f"calculate_output {grader.calculate_output!r} failed on "
                    f"{out.scores}: {type(exc).__name__}: {exc}",
                    fatal=True,
                )
            )
        if not math.isfinite(value):
            return out.failed(
                Problem("formula_parse_error", f"calculate_output gave {value}", fatal=True)
            )
        out.reward = value
        return out

    async def python(self, grader: PythonGrader, values: Mapping[str, Any]) -> Evaluation:
        sandbox = self.sandbox
        if sandbox is None:
            from marlaas.envs.sandbox import default_sandbox

            sandbox = self.sandbox = default_sandbox()
        limits = dataclasses.replace(
            sandbox.limits, wall_seconds=PYTHON_TIMEOUT_S, cpu_seconds=PYTHON_TIMEOUT_S
        )
        program = _WRAPPER.format(source=grader.source, marker=_MARKER)
        payload = json.dumps({"sample": values["sample"], "item": values["item"]}, default=str)
        try:
            result = await sandbox.run_python(program, stdin=payload, limits=limits)
        except SandboxError as exc:
            return Evaluation(0.0).failed(Problem("python_grader_server_error", str(exc), True))
        if result.timed_out:
            detail = f"grade() did not return within {PYTHON_TIMEOUT_S:g}s"
            return Evaluation(0.0).failed(Problem("unresponsive_reward_error", detail, True))
        lines = [ln for ln in result.stdout.splitlines() if ln.startswith(_MARKER)]
        if not result.ok or not lines:
            log = "\n".join(result.stderr.strip().splitlines()[-15:])[-2000:]
            reason = result.reason or "grade() did not return (sys.exit or closed stdout?)"
            detail = f"{reason}" + (f":\n{log}" if log else "")
            return Evaluation(0.0).failed(Problem("python_grader_runtime_error", detail, True))
        out = json.loads(lines[-1][len(_MARKER) :])
        if "error" in out:
            return Evaluation(0.0).failed(
                Problem("python_grader_runtime_error", str(out["error"]), True)
            )
        score = float(out["score"])
        if not math.isfinite(score):
            detail = f"grade() returned {score}; return a finite number"
            return Evaluation(0.0).failed(Problem("python_grader_runtime_error", detail, True))
        return Evaluation(score)

    async def model(
        self, grader: ScoreModelGrader | LabelModelGrader, values: Mapping[str, Any]
    ) -> Evaluation:
        if self.judge is None:
            detail = "no judge model can be called here"
            return Evaluation(0.0).failed(Problem("model_grader_server_error", detail, True))
        messages = [("system", _instruction(grader))] + [
            (m.role, _render(m.text(), values)) for m in grader.input
        ]
        sampling = grader.sampling_params if isinstance(grader, ScoreModelGrader) else None
        try:
            reply = await self.judge(
                grader.model,
                messages,
                max_tokens=(sampling and sampling.max_completions_tokens) or JUDGE_MAX_TOKENS,
                temperature=0.0
                if sampling is None or sampling.temperature is None
                else sampling.temperature,
                top_p=1.0 if sampling is None or sampling.top_p is None else sampling.top_p,
                seed=None if sampling is None else sampling.seed,
            )
        except JudgeError as exc:
            return Evaluation(0.0).failed(Problem("model_grader_server_error", str(exc), True))
        out = Evaluation(0.0)
        _add_usage(
            out.token_usage,
            grader.model,
            {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens},
        )
        if isinstance(grader, ScoreModelGrader):
            score = _read_score(reply.text, grader.range)
            if score is None:
                detail = (
                    f"the judge's answer {reply.text[:200]!r} is no score in {list(grader.range)}"
                )
                return out.failed(Problem("model_grader_parse_error", detail, False))
            out.reward = score
            return out
        label = _read_label(reply.text, grader.labels)
        if label is None:
            detail = f"the judge's answer {reply.text[:200]!r} is none of {list(grader.labels)}"
            return out.failed(Problem("model_grader_parse_error", detail, False))
        out.reward = 1.0 if label in grader.passing_labels else 0.0
        return out


def _string_check(grader: StringCheckGrader, values: Mapping[str, Any]) -> float:
    text, ref = _render(grader.input, values), _render(grader.reference, values)
    op = grader.operation
    hit = {
        "eq": text == ref,
        "ne": text != ref,
        "like": ref in text,
        "ilike": ref.casefold() in text.casefold(),
    }[op]
    return 1.0 if hit else 0.0


def _add_usage(total: dict[str, dict[str, int]], model: str, usage: Mapping[str, int]) -> None:
    mine = total.setdefault(model, {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0})
    for key in ("prompt_tokens", "completion_tokens"):
        mine[key] += int(usage.get(key, 0))
    mine["total_tokens"] = mine["prompt_tokens"] + mine["completion_tokens"]


def _instruction(grader: ScoreModelGrader | LabelModelGrader) -> str:
    """The system message put before the grader's own messages: the judge cannot be held
    to a JSON schema while it decodes, so it is told the answer's form in words."""
    if isinstance(grader, ScoreModelGrader):
        lo, hi = grader.range
        return f"Answer with one number from {lo:g} to {hi:g}, the score, and nothing else."
    return "Answer with exactly one of these labels and nothing else: " + ", ".join(grader.labels)


_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _read_score(text: str, bounds: tuple[float, float]) -> float | None:
    """The score in a judge's answer: `{"result": x}`, or the first number in it."""
    value: object = None
    try:
        parsed = json.loads(text)
        value = parsed.get("result") if isinstance(parsed, dict) else parsed
    except ValueError:
        found = _NUMBER.search(text)
        value = float(found.group()) if found else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    score = float(value)
    return score if bounds[0] <= score <= bounds[1] else None


def _read_label(text: str, labels: Sequence[str]) -> str | None:
    """The label in a judge's answer: `{"result": label}`, the whole answer, or the
    label that occurs first in it (as a word, ignoring case)."""
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict) and isinstance(parsed.get("result"), str):
            text = parsed["result"]
    except ValueError:
        pass
    folded = text.strip().casefold()
    for label in labels:
        if folded == label.casefold():
            return label
    hits = [
        (m.start(), label)
        for label in labels
        if (m := re.search(rf"(?<!\w){re.escape(label.casefold())}(?!\w)", folded))
    ]
    return min(hits)[1] if hits else None


_WRAPPER = """\
import contextlib, json, numbers, sys, traceback
_SOURCE = {source!r}
def _main():
    payload = json.loads(sys.stdin.read())
    ns = {{"__name__": "__grader__"}}
    try:
        with contextlib.redirect_stdout(sys.stderr):
            exec(compile(_SOURCE, "<grader>", "exec"), ns)
            score = ns["grade"](payload["sample"], payload["item"])
    except Exception as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<grader>":
            tb = tb.tb_next
        text = "".join(traceback.format_exception(type(exc), exc, tb))[-2000:]
        out = {{"error": text}}
    else:
        if isinstance(score, numbers.Real):
            out = {{"score": float(score)}}
        else:
            out = {{"error": "grade() returned " + repr(score)[:200] + " ("
                    + type(score).__name__ + "); it must return a number"}}
    sys.stdout.write("\\n" + {marker!r} + json.dumps(out) + "\\n")
    sys.stdout.flush()
_main()
"""


async def evaluate(
    grader: OpenAIGrader,
    output_text: str,
    item: Mapping[str, Any],
    *,
    sandbox: Sandbox | None = None,
    judge: Judge | None = None,
) -> Evaluation:
    """Score `output_text` for the dataset row `item` (see the module docstring)."""
    values = {"sample": make_sample(output_text), "item": dict(item)}
    return await _Evaluator(sandbox, judge).run(grader, values)


def check_runnable(grader: OpenAIGrader) -> None:
    """`GraderError` when this machine cannot run a part of `grader` (e.g. meteor
    without WordNet)."""
    if isinstance(grader, MultiGrader):
        for sub in grader.graders.values():
            check_runnable(sub)
    elif isinstance(grader, TextSimilarityGrader):
        text_metrics.check_metric(grader.evaluation_metric)


class OpenAIRewardGrader:
    """An OpenAI grader as a marlaas `Grader`: the reward of an answer for a row."""

    def __init__(
        self,
        grader: OpenAIGrader | Mapping[str, Any],
        *,
        sandbox: Sandbox | None = None,
        judge: Judge | None = None,
    ) -> None:
        self.grader = grader if not isinstance(grader, Mapping) else parse_openai_grader(grader)
        check_runnable(self.grader)
        self.sandbox = sandbox
        self.judge = judge

    async def __call__(self, completion: str, reference: str, row: Mapping[str, object]) -> float:
        result = await evaluate(
            self.grader, completion, row, sandbox=self.sandbox, judge=self.judge
        )
        fatal = [p for p in result.problems if p.fatal]
        if fatal:
            raise GraderError(
                f"OpenAI grader {self.grader.name!r} failed ({fatal[0].flag}): {fatal[0].detail}"
            )
        if not 0.0 <= result.reward <= 1.0:
            raise GraderError(
                f"OpenAI grader {self.grader.name!r} gave the reward {as_text(result.reward)}; "
                "a training reward must lie in [0, 1] (rescale it, e.g. in calculate_output)"
            )
        return result.reward
