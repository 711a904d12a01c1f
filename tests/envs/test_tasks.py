"""Behaviour of the built-in task families: splits, demonstrations, rewards, tools."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import pytest

from marlaas.envs.base import Example, StepResult, TaskFamily
from marlaas.envs.tasks import FAMILIES, get_family
from marlaas.envs.tasks.calculator import CalculatorFamily, safe_eval
from marlaas.envs.tasks.corpus import Country
from marlaas.envs.tasks.countdown import EVALUATOR, CountdownFamily
from marlaas.envs.tasks.search import SearchFamily
from marlaas.errors import ConfigError


@dataclass(frozen=True)
class LocalResult:
    ok: bool
    stdout: str


class LocalRunner:
    """Runs the sandbox program in a plain subprocess: tests the evaluator without the sandbox."""

    async def run_python(self, code: str, *, stdin: str = "") -> LocalResult:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-c",
            code,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate(stdin.encode())
        return LocalResult(ok=proc.returncode == 0, stdout=out.decode())


def make(name: str, **kwargs: object) -> TaskFamily:
    if name == "countdown":
        kwargs.setdefault("sandbox", LocalRunner())
    return get_family(name, **kwargs)


async def play(family: TaskFamily, example: Example) -> StepResult:
    """Play the demonstration through a fresh env; every observation must match it."""
    segments = family.demonstration(example)
    env = family.make_env(example)
    assert not segments[0].trainable
    assert segments[0].text == await env.initial_observation() == example.prompt
    i, result = 1, None
    while i < len(segments):
        turn = segments[i]
        assert turn.trainable and turn.text.endswith("\n") and turn.text.count("\n") == 1
        result = await env.step(turn.text[:-1])
        i += 1
        if result.done:
            break
        assert not segments[i].trainable
        assert result.observation == segments[i].text
        i += 1
    assert i == len(segments), "the episode ended before the demonstration did"
    assert result is not None and result.done
    assert len(segments) // 2 <= family.max_turns
    return result


NAMES = sorted(FAMILIES)


@pytest.mark.parametrize("name", NAMES)
def test_examples_are_deterministic_and_prefix_stable(name: str) -> None:
    a = make(name).examples("train", 40, seed=3)
    b = make(name).examples("train", 40, seed=3)
    assert a == b
    assert make(name).examples("train", 10, seed=3) == a[:10]
    assert make(name).examples("train", 40, seed=4) != a
    assert [e.id for e in a[:2]] == [f"{name}-train-3-0", f"{name}-train-3-1"]
    assert all(e.prompt.startswith("Q: ") and e.prompt.endswith("\nA: ") for e in a)
    assert all(e.reference == e.reference.strip() and "\n" not in e.reference for e in a)


def _instance_key(name: str, example: Example) -> object:
    if name == "countdown":
        return (example.meta["target"], tuple(sorted(example.meta["numbers"])))  # type: ignore[call-overload]
    if name == "search":
        return example.meta["country"]
    return example.prompt


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_train_and_eval_are_disjoint(name: str, seed: int) -> None:
    family = make(name)
    train = {_instance_key(name, e) for e in family.examples("train", 400, seed)}
    evals = {_instance_key(name, e) for e in family.examples("eval", 100, seed)}
    assert train and evals and not train & evals


@pytest.mark.parametrize("name", NAMES)
async def test_demonstrations_replay_to_reward_one(name: str) -> None:
    family = make(name)
    for split in ("train", "eval"):
        for example in family.examples(split, 12, seed=0):  # type: ignore[arg-type]
            result = await play(family, example)
            assert result.reward == 1.0


@pytest.mark.parametrize("name", NAMES)
async def test_wrong_and_malformed_answers_get_zero(name: str) -> None:
    family = make(name)
    example = family.examples("eval", 1, seed=0)[0]
    bad = ["", "   ", example.reference + "0", "-" + example.reference, "x" * 5000, "\x00é(",
           "calc", "calc ((", "search", "search", "A: " + example.reference]  # fmt: skip
    for action in bad:
        env = family.make_env(example)
        await env.initial_observation()
        result = await env.step(action)
        for _ in range(family.max_turns + 1):
            if result.done:
                break
            assert result.observation is not None and result.observation.endswith("\nA: ")
            result = await env.step(action)
        assert result.done and result.reward == 0.0, action


@pytest.mark.parametrize("name", NAMES)
async def test_answer_tolerates_surrounding_whitespace_and_no_replay(name: str) -> None:
    family = make(name)
    example = family.examples("train", 1, seed=0)[0]
    segments = family.demonstration(example)
    env = family.make_env(example)
    await env.initial_observation()
    result = None
    for seg in segments[1:]:
        if seg.trainable:
            result = await env.step(f"  {seg.text[:-1]} \t")
    assert result is not None and result.done and result.reward == 1.0
    again = await env.step(example.reference)
    assert again.done and again.reward == 0.0


def test_arithmetic_formats_and_mixed_difficulty() -> None:
    examples = make("arithmetic").examples("train", 300)
    ops = {str(e.meta["op"]) for e in examples}
    assert ops == {"+", "-", "*"}
    for e in examples:
        a, b, op = int(e.meta["a"]), int(e.meta["b"]), str(e.meta["op"])  # type: ignore[call-overload]
        assert e.prompt == f"Q: {a}{op}{b}\nA: "
        assert e.reference == str(safe_eval(f"{a}{op}{b}"))
        assert max(a, b) < 100  # default: 1-2 digit operands for every op
    widths = {len(str(e.meta["a"])) for e in examples}
    assert widths == {1, 2}
    assert any(e.reference.startswith("-") for e in examples)


def test_reverse_format() -> None:
    examples = make("reverse").examples("eval", 100)
    lengths = {len(e.reference) for e in examples}
    assert min(lengths) == 3 and max(lengths) == 10
    for e in examples:
        word = e.prompt.removeprefix("Q: reverse ").removesuffix("\nA: ")
        assert word.isalpha() and word.islower() and e.reference == word[::-1]


@pytest.mark.parametrize(
    "expr",
    ["__import__('os')", "9**9**9", "2**10", "7/2", "7//2", "a+1", "().__class__", "1+", "",
     "open('x')", "[1][0]", "1 if 1 else 2", "9" * 81, "999999*999999*999999", "True+1"],
)  # fmt: skip
async def test_calculator_rejects_unsafe_expressions(expr: str) -> None:
    family = CalculatorFamily()
    env = family.make_env(family.examples("train", 1)[0])
    result = await env.step(f"calc {expr}")
    assert not result.done and result.observation == "= error\nA: "


async def test_calculator_evaluates_and_ends_after_last_turn() -> None:
    family = CalculatorFamily()
    example = family.examples("train", 1)[0]
    env = family.make_env(example)
    assert env.max_turns == 3
    first = await env.step("calc (2+3)*-4 - 1")
    assert first.observation == "= -21\nA: "
    second = await env.step("calc 347*29+15")
    assert second.observation == "= 10078\nA: "
    third = await env.step("calc 1+1")  # a tool call on the last turn: out of turns
    assert third.done and third.reward == 0.0 and third.metrics["tool_calls"] == 2.0
    late = await env.step(example.reference)
    assert late.done and late.reward == 0.0


async def test_tool_latency_is_applied() -> None:
    lo = 0.05
    for family in (
        CalculatorFamily(tool_latency_s=(lo, lo * 1.2)),
        SearchFamily(tool_latency_s=(lo, lo)),
    ):
        example = family.examples("train", 1)[0]
        tool_line = family.demonstration(example)[1].text.strip()
        env = family.make_env(example)
        start = time.perf_counter()
        result = await env.step(tool_line)
        assert not result.done
        assert time.perf_counter() - start >= lo * 0.9


def test_search_finds_every_country_by_name() -> None:
    family = SearchFamily()
    index = family.index
    assert len(index.countries) == 400
    for country in index.countries:
        assert index.search(country.name) == country
        assert index.search(f"what is the capital of {country.name.upper()}?") == country
    first = index.countries[0]
    assert index.output(first.name) == (
        f"> {first.name}: capital {first.capital}, river {first.river}, founded {first.founded}"
    )
    assert index.output("zzzz qqqq") == "> no results"
    assert index.output("") == "> no results"
    assert index.search(first.name[:6]) is not None  # a prefix of 4+ letters still matches


async def test_search_episode_and_split_by_country() -> None:
    family = SearchFamily()
    example = family.examples("eval", 1)[0]
    env = family.make_env(example)
    miss = await env.step("search Atlantis")
    assert miss.observation == "> no results\nA: "
    hit = await env.step(f"search {str(example.meta['country']).lower()}")
    assert hit.observation is not None and hit.observation.startswith(
        f"> {example.meta['country']}: "
    )
    done = await env.step(example.reference)
    assert done.done and done.reward == 1.0 and done.metrics["tool_calls"] == 2.0
    train_attrs = {(e.meta["country"], e.meta["attr"]) for e in family.examples("train", 600)}
    assert len(train_attrs) == 600  # distinct while the split has room


def test_get_family_errors_list_known_names() -> None:
    with pytest.raises(ConfigError) as info:
        get_family("chess")
    for name in FAMILIES:
        assert name in str(info.value)
    with pytest.raises(ConfigError, match="max_digits"):
        get_family("arithmetic", max_digitz=2)
    with pytest.raises(ConfigError, match="tool_latency_s"):
        get_family("calculator", tool_latency_s=(0.2, 0.1))
    with pytest.raises(ConfigError):
        get_family("countdown", n_numbers=5)
    assert isinstance(get_family("countdown", n_numbers=4), CountdownFamily)
    for name, cls in FAMILIES.items():
        assert cls.name == name
        assert isinstance(get_family(name, tool_latency_s=(0.0, 0.0)), cls)


def test_evaluator_is_self_contained() -> None:
    assert "marlaas" not in EVALUATOR


def test_small_instance_space_is_used_up_before_repeating() -> None:
    family = get_family("arithmetic", max_digits=1, ops=("+",))
    train = family.examples("train", 300)
    evals = family.examples("eval", 300)
    n_eval = len({e.prompt for e in evals})
    assert 0 < n_eval < 100 and len({e.prompt for e in train}) == 100 - n_eval
    assert len({e.prompt for e in evals[:n_eval]}) == n_eval  # all distinct before any repeat
    assert family.examples("eval", 300) == evals


async def test_exact_episode_text_of_the_tool_families() -> None:
    calc = CalculatorFamily()
    example = Example(
        id="calculator-x-0-0",
        prompt="Q: 347 times 29 plus 15\nA: ",
        reference="10078",
        meta={"expression": "347*29+15"},
    )
    text = "".join(s.text for s in calc.demonstration(example))
    assert text == "Q: 347 times 29 plus 15\nA: calc 347*29+15\n= 10078\nA: 10078\n"
    assert (await play(calc, example)).reward == 1.0

    zorbia = Country("country-000", "Zorbia", "Quell", "Amon", "1432")
    other = Country("country-001", "Zorbiana", "Pell", "Tam", "1001")
    search = SearchFamily(corpus=[zorbia, other], attrs=("capital",))
    example = next(e for e in search.examples("train", 2) if e.meta["country"] == "Zorbia")
    assert example.prompt == "Q: capital of Zorbia?\nA: " and example.reference == "Quell"
    text = "".join(s.text for s in search.demonstration(example))
    assert text == (
        "Q: capital of Zorbia?\nA: search Zorbia\n"
        "> Zorbia: capital Quell, river Amon, founded 1432\nA: Quell\n"
    )
    assert (await play(search, example)).reward == 1.0
