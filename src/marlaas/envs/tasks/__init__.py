"""The built-in verifiable task families and their registry.

Every family prompts ``"Q: {question}\\nA: "``, takes keyword-only knobs (all with
defaults, at least ``tool_latency_s`` and ``eval_fraction``), and is found by name:

============  ======  ==========================================================
name          turns   example
============  ======  ==========================================================
arithmetic    1       ``Q: 37+485`` -> ``522``
reverse       1       ``Q: reverse hello`` -> ``olleh``
countdown     1       ``Q: make 10 from 2 3 4`` -> ``3*4-2`` (checked in the sandbox)
calculator    3       ``calc 347*29+15`` / ``= 10078`` / ``10078``
search        3       ``search Zorbia`` / ``> Zorbia: capital Quell, ...`` / ``Quell``
============  ======  ==========================================================

`common` states the split, prompt and reward contract shared by all of them.
"""

from __future__ import annotations

import inspect
from typing import Any

from marlaas.envs.base import TaskFamily
from marlaas.envs.tasks.arithmetic import ArithmeticFamily
from marlaas.envs.tasks.calculator import CalculatorFamily
from marlaas.envs.tasks.countdown import CountdownFamily
from marlaas.envs.tasks.reverse import ReverseFamily
from marlaas.envs.tasks.search import SearchFamily
from marlaas.errors import ConfigError

FAMILIES: dict[str, type[TaskFamily]] = {
    "arithmetic": ArithmeticFamily,
    "reverse": ReverseFamily,
    "countdown": CountdownFamily,
    "calculator": CalculatorFamily,
    "search": SearchFamily,
}

__all__ = [
    "FAMILIES",
    "ArithmeticFamily",
    "CalculatorFamily",
    "CountdownFamily",
    "ReverseFamily",
    "SearchFamily",
    "get_family",
]


def get_family(name: str, **kwargs: Any) -> TaskFamily:
    """A new instance of the family `name` with the given knobs.

    Raises `ConfigError` for an unknown name (listing the known ones) or unknown knobs.
    """
    try:
        cls = FAMILIES[name]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise ConfigError(f"unknown task family {name!r}; known families: {known}") from None
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        knobs = ", ".join(p for p in inspect.signature(cls).parameters)
        raise ConfigError(f"task family {name!r}: {exc}; its knobs are: {knobs}") from None
    return cls(**kwargs)
