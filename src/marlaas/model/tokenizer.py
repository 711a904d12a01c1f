"""The embedded base's tokenizer: byte-level, one token per byte, no merges.

A real Hugging Face fast tokenizer (`tokenizer.json`), loadable offline with
`AutoTokenizer.from_pretrained(dir)`. One token per byte keeps digits and letters
separate, which is what a ~1M-parameter model needs to learn arithmetic and string
manipulation; any UTF-8 text round-trips exactly.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD = "<|pad|>"
EOS = "<|endoftext|>"
SPECIAL_TOKENS = (PAD, EOS)


def _byte_symbols() -> list[str]:
    """The byte-level alphabet in byte order: byte b -> the printable character that the
    ByteLevel pre-tokenizer uses for it (printable Latin-1 bytes map to themselves, the
    rest to code points from 256 upward, in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + shift)
            shift += 1
    return [symbols[b] for b in range(256)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh byte-level tokenizer: ids 0-1 are the special tokens, 2-257 the bytes."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for sym in _byte_symbols():
        vocab[sym] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    tok = build_tokenizer()
    tok.save_pretrained(str(directory))
    return tok
