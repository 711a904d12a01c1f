"""Fixtures of the Ray tests (which use the shared helpers of `tests/helpers`): one
torch thread."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
