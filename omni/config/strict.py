"""Where YAML and pydantic's lax mode are too forgiving for a config file.

- `load_yaml`: a mapping with the same key twice is an error naming both lines
  (PyYAML silently keeps the last value: `cache:` written twice loses the first).
- `no_bool_for_number`: `block_size: true` is an error (pydantic's lax mode reads it as 1).
- `StrictFlag`: a boolean field takes true or false only (pydantic's lax mode reads 1, "yes", "true",
  "on" as true: `enable_prefix_caching: "no"` would be false by luck, `enable_prefix_caching: 2` an error).
"""
from __future__ import annotations

import types
import typing
from typing import Annotated, Any

import yaml
from pydantic import StrictBool, ValidationError, ValidationInfo, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key]})", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """yaml.safe_load, but a repeated key in one mapping raises yaml.YAMLError."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _is_number(ann: Any) -> bool:
    """int, float, or an Optional/union of them (bool excluded: it is an int subclass)."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return bool(args) and all(_is_number(a) for a in args)
    return ann in (int, float)


def no_bool_for_number(cls: Any, value: Any, info: ValidationInfo) -> Any:
    """A `mode="before"` field validator body: refuse true/false for a numeric field."""
    if isinstance(value, bool) and info.field_name and _is_number(cls.model_fields[info.field_name].annotation):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


def _true_or_false(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        # One message naming the two values the field takes, in YAML's words, not pydantic's "valid boolean".
        raise PydanticCustomError("bool_type", "expected true or false") from None


StrictFlag = Annotated[StrictBool, WrapValidator(_true_or_false)]
