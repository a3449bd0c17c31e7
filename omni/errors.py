"""Exceptions raised at omni's edges.

Every error a user can cause (a bad config, prompt or parameter) is an
`OmniError`; the ones about bad values are also `ValueError`s so that callers
who only know the standard library can still catch them.

A request that fails while running (a stage error, a timeout, an abort) does
not raise: its RequestOutput.error says what happened, and which stage.
"""
from __future__ import annotations


class OmniError(Exception):
    """Base class of every error omni raises on purpose."""


class ConfigError(OmniError, ValueError):
    """The pipeline config (YAML, dict or stage overrides) is invalid.

    The message names the stage and the field, and the allowed values.
    """


class StageError(OmniError):
    """A stage failed (to start, or while serving a request)."""

    def __init__(self, message: str, *, stage: str | None = None, request_id: str | None = None):
        super().__init__(message)
        self.stage = stage
        self.request_id = request_id

    def __reduce__(self):  # keep the keyword attributes across processes (a Ray actor's start error)
        return (type(self), (str(self),), {"stage": self.stage, "request_id": self.request_id})


class StageStartError(StageError):
    """A stage's engine could not be created (model load, resources, ...)."""


class BackendClosedError(OmniError):
    """The pipeline was used after close()."""
