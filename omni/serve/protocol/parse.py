"""A JSON body as a request model, or the OpenAI-shaped 400 naming the field at fault."""
from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from omni.serve.http.errors import from_validation_error
from omni.serve.protocol.chat import PART_TAGS

M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], body: bytes, context: dict[str, Any] | None = None) -> M:
    """`context`: what the model's validators may read of the server (chat: its default output modalities)."""
    try:
        return model.model_validate_json(body, context=context)
    except ValidationError as e:
        raise from_validation_error(e, PART_TAGS) from None
