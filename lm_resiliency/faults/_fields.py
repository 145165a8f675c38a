"""Validation helpers shared by the campaign model: field checks that name the bad field.

Objects validate themselves in ``__post_init__`` and raise `CampaignSchemaError` with a path
``<ClassName>.<field>``; manifest loading rewrites that prefix to the JSON path of the object
(``$.incidents[0].trigger``), so a bad manifest names the exact bad field.
"""

from __future__ import annotations

import math
import re
from enum import Enum
from types import MappingProxyType
from typing import Any, Callable, Dict, Iterable, Mapping, Tuple, Type, TypeVar

from lm_resiliency._values import is_int
from lm_resiliency.files import loads_strict_json

from .errors import CampaignSchemaError

T = TypeVar("T")
E = TypeVar("E", bound=Enum)

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def fail(path: str, reason: str) -> None:
    raise CampaignSchemaError(path, reason)


def check_id(value: Any, path: str) -> str:
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        fail(path, "must be a non-empty identifier of letters, digits, '.', '_', ':' or '-' "
                   f"(at most 128 characters, starting with a letter or digit), got {value!r}")
    return value


def check_str(value: Any, path: str, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        fail(path, f"must be a {'' if empty else 'non-empty '}string, got {value!r}")
    return value


def check_non_negative_int(value: Any, path: str) -> int:
    if not is_int(value) or value < 0:
        fail(path, f"must be a non-negative int, got {value!r}")
    return value


def check_positive_int(value: Any, path: str) -> int:
    if not is_int(value) or value < 1:
        fail(path, f"must be a positive int, got {value!r}")
    return value


def coerce_enum(enum_cls: Type[E], value: Any, path: str) -> E:
    """Accept a member or its string value; anything else names the allowed values."""
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        try:
            return enum_cls(value)
        except ValueError:
            pass
    allowed = ", ".join(repr(m.value) for m in enum_cls)
    fail(path, f"must be one of {allowed}, got {value!r}")
    raise AssertionError  # unreachable


def freeze_json(value: Any, path: str) -> Any:
    """Deep read-only copy of plain JSON (dict -> mappingproxy, list -> tuple); enums -> values."""
    if isinstance(value, Enum):
        value = value.value
    if value is None or isinstance(value, (str, bool)) or is_int(value):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            fail(path, f"must be a finite number, got {value!r}")
        return value
    if isinstance(value, (list, tuple)):
        return tuple(freeze_json(item, f"{path}[{i}]") for i, item in enumerate(value))
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                fail(path, f"keys must be strings, got {key!r}")
            out[key] = freeze_json(item, f"{path}.{key}")
        return MappingProxyType(out)
    fail(path, f"must be plain JSON (dict, list, str, int, finite float, bool, None), "
               f"got {type(value).__name__}")


def thaw_json(value: Any) -> Any:
    """Inverse of `freeze_json`: plain dicts and lists again."""
    if isinstance(value, Mapping):
        return {k: thaw_json(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw_json(v) for v in value]
    return value


def check_json_ready(value: Any, path: str) -> Any:
    """Validate plain JSON and return a mutable deep copy (for records and reports)."""
    return thaw_json(freeze_json(value, path))


def rebase(exc: CampaignSchemaError, cls_name: str, path: str) -> CampaignSchemaError:
    """Turn ``Cls.field`` into ``<path>.field`` (``Cls`` alone into ``<path>``)."""
    if exc.path == cls_name:
        return CampaignSchemaError(path, exc.reason)
    if exc.path.startswith(cls_name + ".") or exc.path.startswith(cls_name + "["):
        return CampaignSchemaError(path + exc.path[len(cls_name):], exc.reason)
    return exc


def build(cls: Callable[..., T], path: str, **kwargs: Any) -> T:
    """Construct `cls(**kwargs)`, reporting validation errors at the JSON `path`."""
    try:
        return cls(**kwargs)
    except CampaignSchemaError as exc:
        raise rebase(exc, cls.__name__, path) from None


def load_document(doc: Any, what: str) -> Any:
    """A manifest given as JSON text, bytes or an already-parsed object."""
    if isinstance(doc, (bytes, bytearray)):
        doc = doc.decode("utf-8")
    if isinstance(doc, str):
        try:
            return loads_strict_json(doc)
        except ValueError as exc:
            fail("$", f"{what} is not valid JSON: {exc}")
    return doc


class ObjectReader:
    """Reads one JSON object at `path`: rejects unknown keys, names missing ones."""

    def __init__(self, doc: Any, path: str, required: Iterable[str], optional: Iterable[str] = ()):
        if not isinstance(doc, Mapping):
            fail(path, f"must be a JSON object, got {type(doc).__name__}")
        self.doc = doc
        self.path = path
        required, optional = tuple(required), tuple(optional)
        for key in doc:
            if key not in required and key not in optional:
                fail(f"{path}.{key}", "unknown field")
        for key in required:
            if key not in doc:
                fail(f"{path}.{key}", "required field is missing")

    def __contains__(self, key: str) -> bool:
        return key in self.doc

    def get(self, key: str, default: Any = None) -> Any:
        return self.doc.get(key, default)

    def at(self, key: str) -> str:
        return f"{self.path}.{key}"

    def list(self, key: str) -> Tuple[Tuple[Any, str], ...]:
        value = self.doc[key]
        if not isinstance(value, list):
            fail(self.at(key), f"must be a JSON array, got {type(value).__name__}")
        return tuple((item, f"{self.at(key)}[{i}]") for i, item in enumerate(value))

    def kwargs(self, *keys: str) -> Dict[str, Any]:
        """The present keys among `keys`, JSON arrays turned into tuples."""
        out = {}
        for key in keys:
            if key in self.doc:
                value = self.doc[key]
                out[key] = tuple(value) if isinstance(value, list) else value
        return out

