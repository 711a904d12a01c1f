"""Text-similarity metrics of OpenAI's `text_similarity` grader, each in [0, 1], computed
by the libraries that define them (nothing is re-implemented here):

| metric | library, call |
| --- | --- |
| `fuzzy_match` | rapidfuzz `fuzz.WRatio` with `utils.default_process` (case and punctuation folded), / 100 |
| `bleu` | sacrebleu `sentence_bleu` (13a tokenizer, exp smoothing), / 100 |
| `gleu` | nltk `sentence_gleu` over whitespace tokens |
| `meteor` | nltk `meteor_score` over whitespace tokens, synonyms from WordNet 3.0 |
| `rouge_1`..`rouge_5`, `rouge_l` | rouge-score `RougeScorer`, the F-measure |

METEOR needs the WordNet 3.0 database, which nltk would download at run time; marlaas
never downloads anything, so it reads the copy Debian's `wordnet-base` package installs
(`/usr/share/wordnet`; `apt-get install wordnet-base`), or `MARLAAS_WORDNET_DIR`. Where
neither exists, `check_metric("meteor")` raises a `GraderError` saying how to install it.
The database is read once per process, on the first METEOR score (a few seconds).

Every function is blocking and CPU-bound: callers run it in a worker thread.
"""

from __future__ import annotations

import functools
import io
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marlaas.errors import GraderError

if TYPE_CHECKING:
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

WORDNET_ENV = "MARLAAS_WORDNET_DIR"
DEBIAN_WORDNET = Path("/usr/share/wordnet")
_WORDNET_FILES = ("data.noun", "index.noun", "data.verb", "data.adj", "data.adv", "noun.exc")

#: WordNet 3.0's lexicographer files in number order (lexnames(5WN)). nltk's reader
#: loads them from a `lexnames` file, which Debian's package does not ship.
_LEXNAMES = [
    "adj.all",
    "adj.pert",
    "adv.all",
    "noun.Tops",
    "noun.act",
    "noun.animal",
    "noun.artifact",
    "noun.attribute",
    "noun.body",
    "noun.cognition",
    "noun.communication",
    "noun.event",
    "noun.feeling",
    "noun.food",
    "noun.group",
    "noun.location",
    "noun.motive",
    "noun.object",
    "noun.person",
    "noun.phenomenon",
    "noun.plant",
    "noun.possession",
    "noun.process",
    "noun.quantity",
    "noun.relation",
    "noun.shape",
    "noun.state",
    "noun.substance",
    "noun.time",
    "verb.body",
    "verb.change",
    "verb.cognition",
    "verb.communication",
    "verb.competition",
    "verb.consumption",
    "verb.contact",
    "verb.creation",
    "verb.emotion",
    "verb.motion",
    "verb.perception",
    "verb.possession",
    "verb.social",
    "verb.stative",
    "verb.weather",
    "adj.ppl",
]
_SYNTACTIC = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}


def wordnet_dir() -> Path | None:
    """Where the WordNet 3.0 database lies, or None when it is not installed."""
    configured = os.environ.get(WORDNET_ENV)
    where = Path(configured) if configured else DEBIAN_WORDNET
    return where if all((where / f).is_file() for f in _WORDNET_FILES) else None


def check_metric(metric: str) -> None:
    """`GraderError` when `metric` cannot be computed on this machine."""
    if metric == "meteor" and wordnet_dir() is None:
        raise GraderError(
            "the meteor metric needs the WordNet 3.0 database, which is not installed here; "
            "install it (apt-get install wordnet-base, or set MARLAAS_WORDNET_DIR to a "
            "WordNet 3.0 dict directory) or pick another evaluation_metric"
        )


_wordnet_lock = threading.Lock()


@functools.cache
def _wordnet() -> WordNetCorpusReader:
    import nltk.data
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    where = wordnet_dir()
    if where is None:
        check_metric("meteor")
    assert where is not None
    lexnames = "".join(
        f"{i:02d}\t{name}\t{_SYNTACTIC[name.split('.')[0]]}\n" for i, name in enumerate(_LEXNAMES)
    )

    class _Reader(WordNetCorpusReader):  # type: ignore[misc]
        """nltk's reader over a plain WordNet 3.0 dict directory: `lexnames` from the
        table above, and no mapping to other WordNet versions (that mapping serves the
        multilingual data, which METEOR does not use)."""

        def open(self, fileid: str) -> Any:
            if fileid == "lexnames":
                return io.StringIO(lexnames)
            return super().open(fileid)

        def map_wn(self, version: str = "wordnet") -> None:
            return None

    # nltk reads corpora only below its data path.
    if str(where) not in nltk.data.path:
        nltk.data.path.append(str(where))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "multilingual functions are not available"
        return _Reader(str(where), None)


def fuzzy_match(text: str, reference: str) -> float:
    from rapidfuzz import fuzz, utils

    return float(fuzz.WRatio(text, reference, processor=utils.default_process)) / 100.0


def bleu(text: str, reference: str) -> float:
    import sacrebleu

    return float(sacrebleu.sentence_bleu(text, [reference]).score) / 100.0


def gleu(text: str, reference: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    hypothesis, ref = text.split(), reference.split()
    if not hypothesis or not ref:
        return 1.0 if hypothesis == ref else 0.0
    return float(sentence_gleu([ref], hypothesis))


def meteor(text: str, reference: str) -> float:
    from nltk.translate.meteor_score import meteor_score

    with _wordnet_lock:  # one thread builds the reader; the rest wait for it
        wordnet = _wordnet()
    return float(meteor_score([reference.split()], text.split(), wordnet=wordnet))


@functools.cache
def _rouge(kind: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([kind])


def _rouge_metric(kind: str) -> Callable[[str, str], float]:
    def score(text: str, reference: str) -> float:
        return float(_rouge(kind).score(reference, text)[kind].fmeasure)

    return score


METRICS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": fuzzy_match,
    "bleu": bleu,
    "gleu": gleu,
    "meteor": meteor,
    **{f"rouge_{n}": _rouge_metric(f"rouge{n}") for n in range(1, 6)},
    "rouge_l": _rouge_metric("rougeL"),
}


def similarity(metric: str, text: str, reference: str) -> float:
    """`metric` of `text` against `reference`, clamped to [0, 1] (float rounding)."""
    check_metric(metric)
    value = METRICS[metric](text, reference)
    return min(1.0, max(0.0, value))
