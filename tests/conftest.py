"""Shared fixtures. Tests run on the CPU with few threads: the CI machine has 2 cores."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The test process runs devices beside a busy event loop, as `marlaas run` does: it
# makes the same process-wide setting (`marlaas.cli.process`).
from marlaas.cli.process import favour_the_device_thread

favour_the_device_thread()
