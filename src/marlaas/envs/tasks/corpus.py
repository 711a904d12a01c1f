"""The synthetic document corpus of the `search` family, and the generator that made it.

``envs/data/corpus.jsonl`` holds one fictional country per line::

    {"id": "country-000", "name": "Zorbia", "capital": "Quell", "river": "Amon", "founded": "1432"}

Country names are 5..9 letters, capitals and rivers 4..8, all capitalised and unique
across the whole corpus (case-insensitively); ``founded`` is a year 1000..1999 as a
string. The file is generated deterministically by `generate_corpus` (a seeded
``random.Random``, never the global RNG); a test checks the committed file equals
``render_corpus(generate_corpus())``. Regenerate with
``python -m marlaas.envs.tasks.corpus``.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from marlaas.errors import DataError

CORPUS_SIZE = 400
CORPUS_SEED = 7
#: Where the corpus lives in the source tree (it ships as package data).
CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "corpus.jsonl"

_ONSETS = (
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "kr",
    "st",
    "th",
    "qu",
)
_VOWELS = ("a", "e", "i", "o", "u", "a", "o", "ei")
_CODAS = ("", "", "", "n", "r", "l", "s", "m")
_COUNTRY_ENDINGS = ("ia", "ia", "or", "an", "ea", "is", "ar", "und", "")
_FIELDS = ("id", "name", "capital", "river", "founded")


@dataclass(frozen=True)
class Country:
    id: str
    name: str
    capital: str
    river: str
    founded: str

    def render(self) -> str:
        """The document as the search tool shows it."""
        return f"{self.name}: capital {self.capital}, river {self.river}, founded {self.founded}"


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def _name(
    rng: random.Random,
    syllables: tuple[int, int],
    ending: bool,
    size: tuple[int, int],
    used: set[str],
) -> str:
    while True:
        word = "".join(_syllable(rng) for _ in range(rng.randint(*syllables)))
        if ending:
            word += rng.choice(_COUNTRY_ENDINGS)
        if size[0] <= len(word) <= size[1] and word not in used:
            used.add(word)
            return word.capitalize()


def generate_corpus(n: int = CORPUS_SIZE, seed: int = CORPUS_SEED) -> list[Country]:
    rng = random.Random(seed)
    used: set[str] = set()
    countries = []
    for i in range(n):
        countries.append(
            Country(
                id=f"country-{i:03d}",
                name=_name(rng, (1, 2), True, (5, 9), used),
                capital=_name(rng, (1, 3), False, (4, 8), used),
                river=_name(rng, (1, 2), False, (4, 8), used),
                founded=str(rng.randint(1000, 1999)),
            )
        )
    return countries


def render_corpus(countries: list[Country]) -> str:
    return "".join(json.dumps(asdict(c)) + "\n" for c in countries)


def parse_corpus(text: str) -> list[Country]:
    countries = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            countries.append(Country(**{k: str(row[k]) for k in _FIELDS}))
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"corpus line {lineno}: expected a JSON object with {_FIELDS}") from exc
    return countries


def load_corpus() -> list[Country]:
    """The corpus shipped with the package (read through importlib.resources)."""
    text = resources.files("marlaas.envs").joinpath("data/corpus.jsonl").read_text("utf-8")
    return parse_corpus(text)


def write_corpus(path: Path = CORPUS_PATH) -> None:
    """Regenerate the corpus file (temporary file, then rename)."""
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text(render_corpus(generate_corpus()), encoding="utf-8")
    tmp.replace(path)


if __name__ == "__main__":
    write_corpus()
