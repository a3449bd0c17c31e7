"""The errors omni raises on purpose: data, not text.

Every error carries what a program needs to act on it, next to its human message:

    stage       the stage that raised or failed it (None: before any stage, at the edge)
    field       the request path at fault, relative to one prompt (`prompt`, `prompt_token_ids`,
                `prompt.messages[1].content`, `multi_modal_data.image[0]`,
                `sampling_params.max_tokens`; with `stage`, a stage's sampling field)
    code        a stable machine name (`invalid_value`, `context_length_exceeded`, ...)
    limit, actual   the numbers, when a bound was crossed (max_model_len and the tokens asked for,
                the vocabulary size and the token id)
    request_id  the request, where one is known

    OmniError                      base; 500 in the server
    ├── ConfigError (ValueError)   a bad pipeline config
    │   └── MemoryPlanError        the stages' memory plan does not fit a device's budget (`omni plan`)
    ├── RequestError (ValueError)  a bad request (prompt, parameter, media): the caller's to fix; 400
    │   └── ContextLengthError     prompt + max_tokens exceed the stage's max_model_len
    ├── RequestTimeoutError        runtime.request_timeout_s ran out; 504
    ├── RequestAbortedError        aborted (by the caller, or on the pipeline's close)
    ├── StageError                 a stage failed (not the caller's fault); 500
    │   └── StageStartError        a stage's engine could not be created
    └── BackendClosedError         the pipeline was used after close(); 503

They pickle with all their fields (`__reduce__`), so a stage's error crosses from a Ray actor to the
driver as itself. A request that fails while running does not raise: its RequestOutput.error (and the
failing StageOutput.error) is one of these. The server maps types and codes to HTTP through a table
(omni/serve/http/errors.py), never by reading the message.
"""
from __future__ import annotations

from typing import Any

_FIELDS = ("stage", "field", "code", "limit", "actual", "request_id")
# The pydantic error type of a model validator that names its field as data (in ctx["field"]), where
# pydantic's own `loc` cannot (a check across fields): readers take the field from there, not the text.
FIELD_ERROR = "field_error"
# The code of a talker's refusal of a reply it cannot voice as it comes (fewer than 2 thinker tokens: it voices
# every reply token from the row of the next one): the server voices such a reply once its text is whole.
REPLY_TOO_SHORT_TO_VOICE = "reply_too_short_to_voice"


def _rebuild(cls: type["OmniError"], message: str, fields: dict[str, Any]) -> "OmniError":
    return cls(message, **fields)


class OmniError(Exception):
    """Base class of every error omni raises on purpose."""

    default_code = "internal_error"

    def __init__(self, message: str, *, stage: str | None = None, field: str | None = None,
                 code: str | None = None, limit: int | float | None = None, actual: int | float | None = None,
                 request_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.stage = stage
        self.field = field
        self.code = code or self.default_code
        self.limit = limit
        self.actual = actual
        self.request_id = request_id

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # the keyword fields survive pickling (a Ray actor -> the driver)
        return (_rebuild, (type(self), self.message, self.fields()))

    def fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _FIELDS}

    def replace(self, message: str | None = None, **changes: Any) -> "OmniError":
        """A copy of this error (same type) with some fields or the message changed; the original is
        left alone (it may be shared, e.g. by a stage's full output and its summary)."""
        return type(self)(self.message if message is None else message, **{**self.fields(), **changes})

    def __eq__(self, other: object) -> bool:  # value semantics: a round-tripped error equals the original
        return (type(other) is type(self) and other.message == self.message  # type: ignore[attr-defined]
                and other.fields() == self.fields())  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.message))

    def __repr__(self) -> str:
        set_fields = ", ".join(f"{k}={v!r}" for k, v in self.fields().items() if v is not None)
        return f"{type(self).__name__}({self.message!r}{', ' if set_fields else ''}{set_fields})"


class ConfigError(OmniError, ValueError):
    """The pipeline config (YAML, dict or stage overrides) is invalid.

    The message names the stage and the field, and the allowed values.
    """

    default_code = "invalid_config"


class MemoryPlanError(ConfigError):
    """The pipeline's memory plan does not fit (omni/planning/): refused before anything is allocated.

    `stage` the stage that does not fit (None: the device as a whole), `device` the device whose budget
    is exceeded ("cpu" for host RAM, "cuda:0", ...), `field` the config field that sets the number,
    `limit` the device's budget and `actual` what the plan needs there, in bytes."""

    default_code = "memory_plan_does_not_fit"

    def __init__(self, message: str, *, device: str | None = None, **fields: Any):
        super().__init__(message, **fields)
        self.device = device

    def fields(self) -> dict[str, Any]:
        return {**super().fields(), "device": self.device}


class RequestError(OmniError, ValueError):
    """A bad request: a prompt, a parameter or a piece of media the caller must fix.

    `field` names what is wrong (see the module docstring); a ValueError for callers who only know
    the standard library."""

    default_code = "invalid_value"


class ContextLengthError(RequestError):
    """prompt + max_tokens do not fit the stage's max_model_len (`limit`); `actual` is their sum."""

    default_code = "context_length_exceeded"


class RequestTimeoutError(OmniError):
    """The request ran past its timeout (runtime.request_timeout_s, `limit` seconds)."""

    default_code = "request_timeout"


class RequestAbortedError(OmniError):
    """The request was aborted (by its caller, or because the pipeline closed)."""

    default_code = "aborted"


class StageError(OmniError):
    """A stage failed (to start, or while serving a request): not the caller's fault."""

    default_code = "stage_failed"


class StageStartError(StageError):
    """A stage's engine could not be created (model load, resources, ...)."""

    default_code = "stage_start_failed"


class BackendClosedError(OmniError):
    """The pipeline was used after close(), or closed while the request was running."""

    default_code = "shutting_down"


def as_omni_error(error: OmniError | str, stage: str | None = None, request_id: str | None = None) -> OmniError:
    """A failure as a typed error: a text (a stage's own description of what broke) is a StageError."""
    if isinstance(error, OmniError):
        return error
    return StageError(str(error), stage=stage, request_id=request_id)
