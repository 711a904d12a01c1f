"""The shipped search corpus is exactly what its generator produces."""

from __future__ import annotations

from importlib import resources

import pytest

from marlaas.envs.tasks.corpus import (
    CORPUS_PATH,
    generate_corpus,
    load_corpus,
    parse_corpus,
    render_corpus,
)
from marlaas.errors import DataError


def test_committed_corpus_equals_the_generated_one() -> None:
    expected = render_corpus(generate_corpus())
    assert CORPUS_PATH.read_text("utf-8") == expected
    shipped = resources.files("marlaas.envs").joinpath("data/corpus.jsonl").read_text("utf-8")
    assert shipped == expected
    assert load_corpus() == generate_corpus()


def test_corpus_shape() -> None:
    countries = load_corpus()
    assert len(countries) == 400
    names = [n.lower() for c in countries for n in (c.name, c.capital, c.river)]
    assert len(set(names)) == len(names)
    for c in countries:
        assert c.name.isalpha() and c.name == c.name.capitalize() and 5 <= len(c.name) <= 9
        for word in (c.capital, c.river):
            assert word.isalpha() and word == word.capitalize() and 4 <= len(word) <= 8
        assert 1000 <= int(c.founded) <= 1999 and len(c.founded) == 4
    assert len({c.id for c in countries}) == 400


def test_generator_is_seeded() -> None:
    assert generate_corpus(20, seed=1) == generate_corpus(20, seed=1)
    assert generate_corpus(20, seed=1) != generate_corpus(20, seed=2)


@pytest.mark.parametrize("line", ["not json", '{"id": "x", "name": "Y"}', "[1, 2]"])
def test_malformed_corpus_lines_are_data_errors(line: str) -> None:
    with pytest.raises(DataError, match="line 1"):
        parse_corpus(line + "\n")
