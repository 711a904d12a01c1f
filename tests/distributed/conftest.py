"""The Ray tests reuse the pipeline tests' helpers (tiny base, job factory, recorder) and
the service tests' (tenants and keys through the admin API)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
torch.set_num_threads(1)
