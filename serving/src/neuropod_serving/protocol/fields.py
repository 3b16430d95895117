"""Reading the fields of a client's JSON objects, and showing its values in error messages.

Every fault is a :class:`~neuropod_serving.errors.ProtocolError` that says which field
was wrong and what it held.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuropod_serving.errors import ProtocolError


def tensor_name(obj: Mapping[str, Any], where: str) -> str:
    """A tensor object's ``name``: a non-empty string."""
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{where}: 'name' must be a non-empty string, not {show(name)}")
    return name


def parameters_of(obj: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An object's ``parameters`` ({} when absent or null)."""
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ProtocolError(f"{where}: 'parameters' must be an object, not {kind_of(params)}")
    return params


def json_list(value: object, what: str) -> list[Any]:
    """``value``, which must be a JSON list (``what`` names it in the error)."""
    if not isinstance(value, list):
        raise ProtocolError(f"{what} must be a JSON list, not {show(value)}")
    return value


def optional_str(obj: Mapping[str, Any], key: str) -> str | None:
    """``obj[key]``: a string, or None when absent."""
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ProtocolError(f"{key!r} must be a string, not {show(value)}")
    return value


def is_int(value: object) -> bool:
    """Whether ``value`` is a JSON integer (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def kind_of(value: object) -> str:
    """What a value is, for a message: ``null``, ``a dict``, ``a str``..."""
    return "null" if value is None else f"a {type(value).__name__}"


def show(value: object, limit: int = 80) -> str:
    """A value as a message shows it: its repr cut to ``limit`` characters (``missing`` for None)."""
    text = "missing" if value is None else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


