"""A random-weight model of any Hugging Face architecture, built from a config file alone.

For benchmarks on hardware the embedded base does not stress (`bench/gpu.sh` builds a
Qwen2.5-1.5B-shaped model this way): no hub, no download. The directory gets the
config, random weights (seeded, in the requested dtype) and the embedded byte-level
tokenizer, so every `marlaas` command that takes `--model DIR` can load it. Token ids the
tokenizer does not know decode to nothing, which is all a benchmark's graders need.

`python -m marlaas.bench.random_model CONFIG.json OUT_DIR [--dtype bfloat16] [--device cuda]`
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from marlaas.errors import ConfigError
from marlaas.model.tokenizer import build_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_random_model(
    config_path: Path, out_dir: Path, dtype: str = "float32", device: str = "cpu", seed: int = 0
) -> Path:
    """Write a random-weight causal LM of `config_path`'s architecture to `out_dir`."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    try:
        raw = json.loads(Path(config_path).read_text())
        model_type = raw.pop("model_type")
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            f"{config_path}: expected a Hugging Face config.json with a model_type: {e}"
        ) from e
    tokenizer = build_tokenizer()
    raw.setdefault("pad_token_id", tokenizer.pad_token_id)
    raw.setdefault("eos_token_id", tokenizer.eos_token_id)
    raw.setdefault("bos_token_id", tokenizer.eos_token_id)
    config = AutoConfig.for_model(model_type, **raw)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="a Hugging Face config.json")
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cpu", help="where to initialise the weights")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_random_model(args.config, args.out, args.dtype, args.device, args.seed)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
