"""The stop-string check decodes every row's tail in one call where the tokenizer's own
decode is its Rust backend's (`FinishPolicy.decode_many`): the same texts as a `decode`
per row, and a tokenizer with more around its decode keeps the per-row path."""

from __future__ import annotations

import copy

from marlaas.model.tokenizer import build_tokenizer
from marlaas.rollout.finish import FinishPolicy


def test_one_call_decodes_as_a_decode_per_row() -> None:
    tokenizer = build_tokenizer()
    policy = FinishPolicy(tokenizer, eos_ids=[1])
    assert policy._decode_batch is not None
    # Bytes that spell multi-byte characters across rows' cuts, specials, an empty tail.
    rows = [[104, 105, 32, 226, 130], [172, 33], [], [1, 2, 0, 120], list(range(3, 40))]
    assert policy.decode_many(rows) == [policy.decode(ids) for ids in rows]


def test_a_tokenizer_that_cleans_up_keeps_the_per_row_decode() -> None:
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.clean_up_tokenization_spaces = True
    policy = FinishPolicy(tokenizer, eos_ids=[1])
    assert policy._decode_batch is None
    rows = [[104, 105, 32, 46], [33]]
    assert policy.decode_many(rows) == [policy.decode(ids) for ids in rows]
