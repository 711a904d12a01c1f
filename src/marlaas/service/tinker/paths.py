"""Tinker's names: session, model and sampler ids, and `tinker://` paths.

- A session id is `ses_<hex>`; a model (training run) id is `<session id>:train:<n>`,
  the SDK's own form (it derives the id of a model created by loading a checkpoint
  from the session and the client's counter, before the server answers).
- A saved state is `tinker://<run id>/weights/<name>`, sampler weights are
  `tinker://<run id>/sampler_weights/<name>`. Names are 1-128 letters, digits, `.`,
  `_` or `-` (no `/`: the SDK splits paths into exactly three parts).

Invariant: ids are random (unguessable), and nothing here says which tenant owns a
path; ownership is always checked against the database (`store`).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Literal

from marlaas.service.tinker.errors import UserError

SCHEME = "tinker://"
CheckpointKind = Literal["training", "sampler"]
_SEGMENT: dict[str, CheckpointKind] = {"weights": "training", "sampler_weights": "sampler"}
_SEGMENT_OF: dict[CheckpointKind, str] = {v: k for k, v in _SEGMENT.items()}
NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
NAME_RULE = "use 1-128 letters, digits, '.', '_' or '-'"
_SESSION = re.compile(r"^ses_[0-9a-f]{16}$")
_MODEL = re.compile(r"^(?P<session>ses_[0-9a-f]{16}):train:(?P<seq>\d{1,9})$")


def new_session_id() -> str:
    return f"ses_{secrets.token_hex(8)}"


def new_sampler_id(session_id: str) -> str:
    return f"{session_id}:sample:{secrets.token_hex(6)}"


def model_id(session_id: str, model_seq_id: int) -> str:
    """The id the SDK expects for the session's `model_seq_id`-th training client."""
    return f"{session_id}:train:{model_seq_id}"


def is_session_id(value: str) -> bool:
    return _SESSION.match(value) is not None


def is_model_id(value: str) -> bool:
    return _MODEL.match(value) is not None


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise UserError(f"checkpoint name {name!r} is not valid; {NAME_RULE}")
    return name


@dataclass(frozen=True)
class TinkerPath:
    """A parsed `tinker://RUN/weights/NAME` or `tinker://RUN/sampler_weights/NAME`."""

    run_id: str
    kind: CheckpointKind
    name: str

    @classmethod
    def parse(cls, path: str) -> TinkerPath:
        """`UserError` naming the expected form for anything else."""
        form = "tinker://RUN/weights/NAME or tinker://RUN/sampler_weights/NAME"
        if not path.startswith(SCHEME):
            raise UserError(f"{path!r} is not a tinker path; expected {form}")
        parts = path[len(SCHEME) :].split("/")
        if len(parts) != 3 or parts[1] not in _SEGMENT or not is_model_id(parts[0]):
            raise UserError(f"{path!r} is not a tinker path of this server; expected {form}")
        return cls(run_id=parts[0], kind=_SEGMENT[parts[1]], name=check_name(parts[2]))

    @property
    def checkpoint_id(self) -> str:
        """What the REST routes call it: `weights/NAME` or `sampler_weights/NAME`."""
        return f"{_SEGMENT_OF[self.kind]}/{self.name}"

    def __str__(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.checkpoint_id}"


def parse_checkpoint_id(run_id: str, checkpoint_id: str) -> TinkerPath:
    """The path of `checkpoint_id` (`weights/NAME` or `sampler_weights/NAME`) of a run."""
    return TinkerPath.parse(f"{SCHEME}{run_id}/{checkpoint_id}")
