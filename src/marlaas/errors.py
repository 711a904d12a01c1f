"""The project's exception hierarchy.

Every error we raise on purpose derives from `MarlaasError` and from the builtin that
matches its meaning, so callers can catch either. Messages say what was wrong and what
to do about it.
"""

from __future__ import annotations


class MarlaasError(Exception):
    """Base of every error raised on purpose by marlaas."""


class ConfigError(MarlaasError, ValueError):
    """A spec or setting is invalid; the message names the field and the fix."""


class DataError(MarlaasError, ValueError):
    """A dataset row or file is malformed; the message names the row and the field."""


class GraderError(MarlaasError, ValueError):
    """A grader spec is invalid, or a grader could not score a completion."""


class SandboxError(MarlaasError, RuntimeError):
    """The sandbox itself could not run (not: the sandboxed code failed)."""


class ModelError(MarlaasError, RuntimeError):
    """A base model or adapter could not be loaded, saved or used."""


class CapacityError(MarlaasError, RuntimeError):
    """A bounded resource (adapter slots, queue, quota) is exhausted."""


class TenantNotFound(MarlaasError, KeyError):
    """No tenant (or no adapter version) by that name is registered."""


class InvalidRequest(MarlaasError, ValueError):
    """A rollout request the model cannot serve (empty or too long prompt, bad token ids)."""


class EngineClosed(MarlaasError, RuntimeError):
    """The rollout engine was closed; the request was not (or not fully) served."""
