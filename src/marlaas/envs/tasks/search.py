"""`search`: multi-turn tool use over the shipped country corpus (max_turns 3).

Question ``"{attr} of {Name}?"`` with attr in capital|river|founded, e.g.
``"Q: capital of Zorbia?\\nA: "``; the reference is that field of the country's document.
Train and eval are split by country: eval never asks about a country train asks about.

A perfect episode::

    Q: capital of Zorbia?\\nA: search Zorbia\\n
    > Zorbia: capital Quell, river Amon, founded 1432\\nA: Quell\\n

A line ``search {query}`` runs a keyword search (after the simulated latency): the query's
letter tokens are matched case-insensitively against country names, an exact token match
scoring 2 and a token of 4+ letters that is a prefix of the name scoring 1; the best
scoring document (ties: corpus order) comes back as ``"> {document}\\nA: "``, or
``"> no results\\nA: "``. Any other line is the final answer. See `ToolEnv` for turns.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from marlaas.envs.base import Env, Example, Segment, Tool
from marlaas.envs.tasks.common import (
    OBS_SUFFIX,
    Candidate,
    GeneratedFamily,
    ToolEnv,
    meta_field,
)
from marlaas.envs.tasks.corpus import Country, load_corpus
from marlaas.errors import ConfigError, DataError

ATTRS = ("capital", "river", "founded")
NO_RESULTS = "> no results"
_MIN_PREFIX = 4


class CorpusIndex:
    """Keyword search over country names."""

    def __init__(self, countries: Sequence[Country]) -> None:
        if not countries:
            raise DataError("the search corpus is empty")
        self.countries = list(countries)
        self._by_name = {c.name.lower(): c for c in self.countries}
        if len(self._by_name) != len(self.countries):
            raise DataError("country names in the search corpus must be unique")

    def get(self, name: str) -> Country:
        try:
            return self._by_name[name.lower()]
        except KeyError:
            raise DataError(f"no country named {name!r} in the corpus") from None

    def search(self, query: str) -> Country | None:
        tokens = re.findall(r"[a-z]+", query.lower())[:32]
        best: Country | None = None
        best_score = 0
        for country in self.countries:
            name = country.name.lower()
            score = sum(
                2
                if token == name
                else 1
                if len(token) >= _MIN_PREFIX and name.startswith(token)
                else 0
                for token in tokens
            )
            if score > best_score:
                best, best_score = country, score
        return best

    def output(self, query: str) -> str:
        """The tool's output line for `query`."""
        hit = self.search(query)
        return NO_RESULTS if hit is None else f"> {hit.render()}"


class SearchEnv(ToolEnv):
    tool = "search"
    tools = (
        Tool(
            "search",
            "Looks a country up in the encyclopedia by name; returns its entry.",
            "query",
            "The country's name, e.g. Zorbia",
        ),
    )

    def __init__(
        self,
        example: Example,
        *,
        index: CorpusIndex,
        max_turns: int,
        latency_s: tuple[float, float],
        rng: random.Random,
    ) -> None:
        super().__init__(example, max_turns=max_turns, latency_s=latency_s, rng=rng)
        self._index = index

    async def call_tool(self, argument: str) -> str:
        return self._index.output(argument)


class SearchFamily(GeneratedFamily):
    name = "search"
    max_turns = 3

    def __init__(
        self,
        *,
        tool_latency_s: tuple[float, float] = (0.0, 0.0),
        eval_fraction: float = 0.2,
        attrs: Sequence[str] = ATTRS,
        corpus: Sequence[Country] | None = None,
    ) -> None:
        super().__init__(tool_latency_s=tool_latency_s, eval_fraction=eval_fraction)
        if not attrs or any(a not in ATTRS for a in attrs):
            raise ConfigError(f"attrs must be a non-empty subset of {ATTRS}, got {attrs!r}")
        self.attrs = tuple(attrs)
        self.index = CorpusIndex(load_corpus() if corpus is None else corpus)

    def draw(self, rng: random.Random) -> Candidate:
        country = rng.choice(self.index.countries)
        attr = rng.choice(self.attrs)
        return Candidate(
            key=f"{country.name}:{attr}",
            split_key=country.name,
            question=f"{attr} of {country.name}?",
            reference=str(getattr(country, attr)),
            meta={"country": country.name, "attr": attr},
        )

    def make_env(self, example: Example) -> Env:
        return SearchEnv(
            example,
            index=self.index,
            max_turns=self.max_turns,
            latency_s=self.tool_latency_s,
            rng=self.env_rng(example),
        )

    def demonstration(self, example: Example) -> list[Segment]:
        name = str(meta_field(example, "country"))
        return [
            Segment(example.prompt, False),
            Segment(f"search {name}\n", True),
            Segment(self.index.output(name) + OBS_SUFFIX, False),
            Segment(example.reference + "\n", True),
        ]
