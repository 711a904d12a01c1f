"""OpenAI graders: their specs (parse-time errors naming the field), templates, every
grader type's score against the metric libraries, multi formulas, the judge protocol,
and the marlaas `Grader` behind them (what is a 0 and what fails the work)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import sacrebleu
from nltk.translate.gleu_score import sentence_gleu
from rapidfuzz import fuzz, utils
from rouge_score import rouge_scorer

from marlaas.config.graders import parse_grader
from marlaas.config.openai_graders import OpenAIGraderError, parse_openai_grader
from marlaas.config.openai_templates import TemplateVariableError, parse_template, render_template
from marlaas.envs import text_metrics
from marlaas.envs.graders import build_grader
from marlaas.envs.openai_graders import JudgeError, JudgeReply, OpenAIRewardGrader, evaluate
from marlaas.errors import GraderError

SAMPLE = "{{sample.output_text}}"
needs_wordnet = pytest.mark.skipif(
    text_metrics.wordnet_dir() is None, reason="WordNet 3.0 (apt-get install wordnet-base)"
)


def check(operation: str, reference: str = "{{item.answer}}") -> dict[str, Any]:
    return {
        "type": "string_check",
        "name": "check",
        "input": SAMPLE,
        "reference": reference,
        "operation": operation,
    }


def similarity(metric: str) -> dict[str, Any]:
    return {
        "type": "text_similarity",
        "name": "sim",
        "input": SAMPLE,
        "reference": "{{item.answer}}",
        "evaluation_metric": metric,
    }


def python(source: str) -> dict[str, Any]:
    return {"type": "python", "name": "py", "source": source}


async def reward(spec: dict[str, Any], text: str, **item: Any) -> float:
    return (await evaluate(parse_openai_grader(spec), text, item)).reward


# --- specs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "param", "fragment"),
    [
        ({"type": "nope", "name": "x"}, "grader.type", "unknown grader type 'nope'"),
        ({"name": "x"}, "grader.type", "missing 'type'"),
        (check("eq", "{{foo.bar}}"), "grader.reference", "namespace 'foo'"),
        (check("eq", "{{item.answer"), "grader.reference", "unclosed '{{'"),
        (check("eq", "{{item}}"), "grader.reference", "needs a field"),
        (check("eq", "{{item.a..b}}"), "grader.reference", "not a variable path"),
        ({**check("eq"), "operation": "contains"}, "grader.operation", "'eq'"),
        ({**check("eq"), "extra": 1}, "grader.extra", "unknown field"),
        (similarity("cosine"), "grader.evaluation_metric", "embedding model"),
        (similarity("bertscore"), "grader.evaluation_metric", "unknown metric"),
        (python("x = 1"), "grader.source", "no top-level function `grade`"),
        (python("def grade(s):\n    return 1\n"), "grader.source", "two positional"),
        (python("def grade(:\n"), "grader.source", "does not parse"),
        (
            {**python("def grade(s, i):\n    return 1\n"), "image_tag": "2025"},
            "grader.image_tag",
            "no images",
        ),
        (
            {
                "type": "score_model",
                "name": "j",
                "model": "base",
                "input": [{"role": "user", "content": "x"}],
                "sampling_params": {"reasoning_effort": "high"},
            },
            "grader.sampling_params.reasoning_effort",
            "not reasoning models",
        ),
        (
            {
                "type": "score_model",
                "name": "j",
                "model": "base",
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
            },
            "grader.input.0.content",
            "input_image content is not supported",
        ),
        (
            {
                "type": "score_model",
                "name": "j",
                "model": "base",
                "input": [{"role": "user", "content": "x"}],
                "range": [1, 1],
            },
            "grader.range",
            "low < high",
        ),
        (
            {
                "type": "label_model",
                "name": "j",
                "model": "base",
                "input": [{"role": "user", "content": "x"}],
                "labels": ["good", "bad"],
                "passing_labels": ["great"],
            },
            "grader.passing_labels",
            "not among labels",
        ),
        (
            {
                "type": "multi",
                "name": "m",
                "graders": {"a": check("eq")},
                "calculate_output": "a + b",
            },
            "grader.calculate_output",
            "b, which name no sub-grader",
        ),
        (
            {
                "type": "multi",
                "name": "m",
                "graders": {"a": check("eq")},
                "calculate_output": "a.real",
            },
            "grader.calculate_output",
            "Attribute",
        ),
        (
            {
                "type": "multi",
                "name": "m",
                "graders": {"a": check("eq")},
                "calculate_output": "pow(a, 2)",
            },
            "grader.calculate_output",
            "may be called",
        ),
        (
            {
                "type": "multi",
                "name": "m",
                "graders": {"a-b": check("eq")},
                "calculate_output": "1",
            },
            "grader.graders",
            "cannot be a formula variable",
        ),
        (
            {
                "type": "multi",
                "name": "m",
                "graders": {
                    "a": {"type": "multi", "name": "n", "graders": {}, "calculate_output": "1"}
                },
                "calculate_output": "a",
            },
            "grader.graders.a.type",
            "unknown grader type 'multi'",
        ),
        (
            {
                "type": "multi",
                "name": "m",
                "graders": {"a": {**check("eq"), "input": "{{x.y}}"}},
                "calculate_output": "a",
            },
            "grader.graders.a.input",
            "namespace 'x'",
        ),
    ],
)
def test_bad_specs_name_the_field(spec: dict[str, Any], param: str, fragment: str) -> None:
    with pytest.raises(OpenAIGraderError) as caught:
        parse_openai_grader(spec)
    assert caught.value.param == param
    assert fragment in str(caught.value)
    assert str(caught.value).startswith(param)


def test_a_single_sub_grader_is_named_by_its_name() -> None:
    grader = parse_openai_grader(
        {"type": "multi", "name": "m", "graders": check("eq"), "calculate_output": "check * 2"}
    )
    assert list(grader.graders) == ["check"]  # type: ignore[union-attr]


def test_openai_graders_are_marlaas_grader_specs() -> None:
    spec = parse_grader({"type": "openai", "grader": check("eq")})
    assert spec.type == "openai"
    with pytest.raises(GraderError, match=r"grader\.reference"):
        parse_grader({"type": "openai", "grader": check("eq", "{{nope}}")})


# --- templates ---------------------------------------------------------------------


def test_templates_render_nested_paths_and_json() -> None:
    parts = parse_template(
        "a={{ item.a.b[1] }} n={{item.n}} o={{item.o}} t={{sample.output_text}}!"
    )
    values = {
        "item": {"a": {"b": ["x", "y"]}, "n": 3, "o": {"k": [1, True]}},
        "sample": {"output_text": "hi"},
    }
    assert render_template(parts, values) == 'a=y n=3 o={"k":[1,true]} t=hi!'
    with pytest.raises(TemplateVariableError) as caught:
        render_template(parse_template("{{item.a.c}}"), values)
    assert caught.value.namespace == "item" and "has no field 'c'" in str(caught.value)
    with pytest.raises(TemplateVariableError, match="no index 5"):
        render_template(parse_template("{{item.a.b[5]}}"), values)


# --- scores ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("operation", "text", "want"),
    [
        ("eq", "Paris", 1.0),
        ("eq", "paris", 0.0),
        ("ne", "Paris", 0.0),
        ("ne", "Lyon", 1.0),
        ("like", "It is Paris.", 1.0),
        ("like", "it is paris.", 0.0),
        ("ilike", "IT IS PARIS.", 1.0),
        ("ilike", "Lyon", 0.0),
    ],
)
async def test_string_check(operation: str, text: str, want: float) -> None:
    assert await reward(check(operation), text, answer="Paris") == want


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        ("fuzzy_match", lambda h, r: fuzz.WRatio(h, r, processor=utils.default_process) / 100),
        ("bleu", lambda h, r: sacrebleu.sentence_bleu(h, [r]).score / 100),
        ("gleu", lambda h, r: sentence_gleu([r.split()], h.split())),
        *[
            (
                f"rouge_{n}",
                lambda h, r, n=n: (
                    rouge_scorer.RougeScorer([f"rouge{n}"]).score(r, h)[f"rouge{n}"].fmeasure
                ),
            )
            for n in (1, 2, 3, 4, 5)
        ],
        (
            "rouge_l",
            lambda h, r: rouge_scorer.RougeScorer(["rougeL"]).score(r, h)["rougeL"].fmeasure,
        ),
    ],
)
async def test_text_similarity_is_the_libraries_metric(metric: str, expected: Any) -> None:
    hypothesis = "the quick brown fox jumped over the lazy dog today"
    ref = "the quick brown fox jumped over a lazy dog"
    got = await reward(similarity(metric), hypothesis, answer=ref)
    assert 0.0 < got < 1.0
    assert got == pytest.approx(expected(hypothesis, ref))
    assert await reward(similarity(metric), ref, answer=ref) == pytest.approx(1.0)


@needs_wordnet
async def test_meteor_uses_wordnet_synonyms() -> None:
    ref = "the cat sat on the mat"
    exact = await reward(similarity("meteor"), "the cat sat on the mat", answer=ref)
    synonym = await reward(similarity("meteor"), "the true cat sat on the mat", answer=ref)
    unrelated = await reward(similarity("meteor"), "a dog ran in the park", answer=ref)
    assert exact > synonym > unrelated
    # "sofa" and "couch" share a WordNet synset: a synonym scores above a word that is none.
    couch = "the cat sat on the couch"
    sofa = await reward(similarity("meteor"), "the cat sat on the sofa", answer=couch)
    stone = await reward(similarity("meteor"), "the cat sat on the stone", answer=couch)
    assert sofa > stone


def test_meteor_without_wordnet_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv(text_metrics.WORDNET_ENV, str(tmp_path))
    with pytest.raises(GraderError, match="wordnet-base"):
        OpenAIRewardGrader(similarity("meteor"))


async def test_python_grader_sees_sample_and_item() -> None:
    source = (
        "def grade(sample, item):\n"
        "    print('logs do not count')\n"
        "    got = sample['output_json'] or {}\n"
        "    return 0.25 * len(item['tags']) + (0.5 if got.get('ok') else 0.0)\n"
    )
    assert await reward(python(source), '{"ok": true}', tags=["a", "b"]) == 1.0
    assert await reward(python(source), "not json", tags=["a"]) == 0.25


async def test_python_grader_failures_are_flagged() -> None:
    raising = await evaluate(
        parse_openai_grader(python("def grade(s, i):\n    return i['x']\n")), "a", {}
    )
    flags = raising.error_flags()
    assert raising.reward == 0.0 and flags["python_grader_runtime_error"]
    assert "KeyError: 'x'" in flags["python_grader_runtime_error_details"]
    not_number = await evaluate(
        parse_openai_grader(python("def grade(s, i):\n    return 'high'\n")), "a", {}
    )
    assert "returned 'high'" in not_number.error_flags()["python_grader_runtime_error_details"]


async def test_multi_combines_named_scores_with_the_formula() -> None:
    spec = {
        "type": "multi",
        "name": "m",
        "graders": {
            "exact": check("eq"),
            "has": python(
                "def grade(sample, item):\n    return 1.0 if item['answer'] in sample['output_text'] else 0.0\n"
            ),
        },
        "calculate_output": "0.5 * exact + 0.5 * has ^ 2 + min(exact, has) - floor(0.7)",
    }
    result = await evaluate(parse_openai_grader(spec), "it is Paris", {"answer": "Paris"})
    assert result.scores == {"exact": 0.0, "has": 1.0}
    assert result.reward == pytest.approx(0.5)
    divide = {**spec, "calculate_output": "has / exact"}
    failed = await evaluate(parse_openai_grader(divide), "it is Paris", {"answer": "Paris"})
    assert failed.reward == 0.0 and failed.error_flags()["formula_parse_error"]


class FakeJudge:
    """A judge that answers from a script and records what it was asked (the protocol
    is marlaas's own; the service's judge is tested against a real engine)."""

    def __init__(self, answer: str, fail: bool = False) -> None:
        self.answer, self.fail = answer, fail
        self.asked: list[tuple[str, list[tuple[str, str]], dict[str, Any]]] = []

    async def __call__(
        self, model: str, messages: Sequence[tuple[str, str]], **kw: Any
    ) -> JudgeReply:
        self.asked.append((model, list(messages), kw))
        if self.fail:
            raise JudgeError("the judge is down")
        return JudgeReply(self.answer, prompt_tokens=10, completion_tokens=2)


def score_model(**extra: Any) -> dict[str, Any]:
    return {
        "type": "score_model",
        "name": "judge",
        "model": "base",
        "input": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "input_text",
                        "text": "Rate: {{sample.output_text}} vs {{item.answer}}",
                    }
                ],
            }
        ],
        **extra,
    }


async def test_score_model_renders_input_and_reads_the_score() -> None:
    judge = FakeJudge('{"result": 7}')
    spec = score_model(
        range=[0, 10], sampling_params={"temperature": 0.5, "seed": 3, "max_completions_tokens": 9}
    )
    result = await evaluate(parse_openai_grader(spec), "Lyon", {"answer": "Paris"}, judge=judge)
    assert result.reward == 7.0
    assert result.token_usage == {
        "base": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    }
    model, messages, kw = judge.asked[0]
    assert model == "base" and messages[-1] == ("user", "Rate: Lyon vs Paris")
    assert messages[0][0] == "system" and "from 0 to 10" in messages[0][1]
    assert kw == {"max_tokens": 9, "temperature": 0.5, "top_p": 1.0, "seed": 3}
    for answer, want in (("0.8", 0.8), ("Score: 0.25 of 1", 0.25)):
        assert (
            await evaluate(
                parse_openai_grader(score_model()), "x", {"answer": "y"}, judge=FakeJudge(answer)
            )
        ).reward == want
    outside = await evaluate(
        parse_openai_grader(score_model()), "x", {"answer": "y"}, judge=FakeJudge("5")
    )
    assert outside.reward == 0.0 and outside.error_flags()["model_grader_parse_error"]
    down = await evaluate(
        parse_openai_grader(score_model()), "x", {"answer": "y"}, judge=FakeJudge("1", fail=True)
    )
    assert down.error_flags()["model_grader_server_error_details"] == "the judge is down"


@pytest.mark.parametrize(
    ("answer", "want"),
    [
        ("good", 1.0),
        ("Bad", 0.0),
        ('{"result": "good"}', 1.0),
        ("I think it is good, not bad", 1.0),
        ("unsure", None),
    ],
)
async def test_label_model_passes_on_passing_labels(answer: str, want: float | None) -> None:
    spec = {
        "type": "label_model",
        "name": "judge",
        "model": "base",
        "input": [{"role": "user", "content": "{{sample.output_text}}"}],
        "labels": ["good", "bad"],
        "passing_labels": ["good"],
    }
    result = await evaluate(parse_openai_grader(spec), "x", {}, judge=FakeJudge(answer))
    if want is None:
        assert result.reward == 0.0 and result.error_flags()["model_grader_parse_error"]
    else:
        assert result.reward == want and not result.problems


# --- the marlaas grader ------------------------------------------------------------


async def test_reward_grader_zero_for_bad_answers_error_for_bad_graders() -> None:
    json_field = build_grader(
        {"type": "openai", "grader": check("eq", "{{sample.output_json.answer}}")}
    )
    # The answer is not JSON: the template cannot be filled, a reward of 0.
    assert await json_field("Paris", "", {}) == 0.0
    missing_item = build_grader({"type": "openai", "grader": check("eq")})
    with pytest.raises(GraderError, match="invalid_variable_error"):
        await missing_item("Paris", "", {"other": 1})
    assert await missing_item("Paris", "", {"answer": "Paris"}) == 1.0
    too_big = OpenAIRewardGrader(
        {"type": "multi", "name": "m", "graders": {"a": check("eq")}, "calculate_output": "a * 3"}
    )
    with pytest.raises(GraderError, match=r"must lie in \[0, 1\]"):
        await too_big("Paris", "", {"answer": "Paris"})
    no_judge = build_grader({"type": "openai", "grader": score_model()})
    with pytest.raises(GraderError, match="no judge"):
        await no_judge("x", "", {"answer": "y"})
    assert math.isfinite(await missing_item("x", "", {"answer": "y"}))
