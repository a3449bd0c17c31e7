"""omni's typed errors: every one pickles with its fields (a Ray actor's error reaches the driver as
itself), copies leave the original alone, and the message stays the human one."""
from __future__ import annotations

import pickle

import pytest

from omni import errors
from omni.messages import RequestOutput, StageOutput, error_output

ALL = [errors.OmniError, errors.ConfigError, errors.RequestError, errors.ContextLengthError,
       errors.RequestTimeoutError, errors.RequestAbortedError, errors.StageError, errors.StageStartError,
       errors.BackendClosedError]


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_error_pickles_with_its_fields(cls):
    err = cls("stage 'thinker': prompt: 300 tokens exceed 256", stage="thinker", field="prompt", limit=256,
              actual=300, request_id="r1")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and back == err
    assert (back.stage, back.field, back.code, back.limit, back.actual, back.request_id) == (
        "thinker", "prompt", cls.default_code, 256, 300, "r1")
    assert str(back) == "stage 'thinker': prompt: 300 tokens exceed 256"


def test_codes_and_the_standard_library_view():
    assert errors.ContextLengthError("x").code == "context_length_exceeded"
    assert errors.RequestError("x", code="duplicate_request_id").code == "duplicate_request_id"
    assert isinstance(errors.RequestError("x"), ValueError) and isinstance(errors.ConfigError("x"), ValueError)
    assert not isinstance(errors.StageError("x"), ValueError)  # not the caller's fault


def test_replace_copies():
    err = errors.RequestError("a", stage="s", field="prompt")
    other = err.replace("b", stage="t")
    assert (err.message, err.stage) == ("a", "s") and (other.message, other.stage, other.field) == ("b", "t", "prompt")
    assert type(other) is errors.RequestError


def test_outputs_carry_typed_errors_across_pickling():
    out = error_output("talker", "r", "the actor died")
    assert isinstance(out.error, errors.StageError) and out.error.stage == "talker" and out.error.request_id == "r"
    aborted = error_output("talker", "r", "aborted", "abort")
    assert isinstance(aborted.error, errors.RequestAbortedError)
    err = errors.ContextLengthError("too long", stage="thinker", field="sampling_params.max_tokens", limit=8, actual=9)
    res = pickle.loads(pickle.dumps(RequestOutput("r", outputs={"t": StageOutput("r", "t")}, error=err)))
    assert res.error == err and res.error.limit == 8
