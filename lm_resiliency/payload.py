"""JSON-ready payloads: what the library hands to orchestration (decisions, fault reports, health
events).

A payload *is* its JSON document: a read-only ``dict`` of JSON values (str, int, finite float,
bool, None, lists and str-keyed dicts), so ``json.dumps(payload, allow_nan=False)``,
``payload["step"]`` and ``dict(payload)`` work as they do on any document a manager forwards.
Python code reads the same fields as attributes (``payload.step``), typed: a field declared a tuple
reads as a tuple there (``report.ranks == (2,)``) and is a list in the document, an enum field
reads as the enum and is its value in the document.

Payloads are dicts rather than frozen dataclasses because a dataclass is not JSON: the seeds'
``report_recovery`` receives "a JSON-ready RecoveryDecision", and a manager that forwards it to a
control plane must not need to know a conversion method.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import FrozenInstanceError
from typing import Any, Callable, ClassVar, Dict, Mapping, NoReturn, Tuple, Type, TypeVar

P = TypeVar("P", bound="Payload")


def json_value(value: Any, where: str) -> Any:
    """`value` as a JSON value: tuples become lists, str enums their value, non-finite floats
    their name ("inf", "-inf", "nan", since strict JSON has no such numbers). Anything else that
    is not JSON raises TypeError naming `where` (the field path)."""
    if value is None or isinstance(value, (bool, str)):
        return value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, enum.Enum):
        return json_value(value.value, where)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else repr(float(value))
    if isinstance(value, (list, tuple)):
        return [json_value(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; JSON object keys are strings")
            out[key] = json_value(item, f"{where}.{key}")
        return out
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):  # NumPy / 0-d tensor scalar
        return json_value(value.item(), where)
    raise TypeError(f"{where}: {type(value).__name__} {value!r} is not a JSON value (str, int, float, bool, None, "
                    f"list or dict)")


class Payload(Dict[str, Any]):
    """A read-only JSON document with attribute access (see the module docstring).

    Subclasses set `_FIELDS` (every key, in order) and `_ATTRS` (field -> the type its JSON value
    is read back as, e.g. ``tuple`` or an enum), declare each field's attribute type, and build the
    document with `_init`."""

    __slots__ = ()
    _FIELDS: ClassVar[Tuple[str, ...]] = ()
    _ATTRS: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}

    def _init(self, **fields: Any) -> None:
        name = type(self).__name__
        if tuple(fields) != self._FIELDS:
            raise TypeError(f"{name}: fields {list(fields)} are not {list(self._FIELDS)}")
        dict.__init__(self, {key: json_value(value, f"{name}.{key}") for key, value in fields.items()})

    def __getattr__(self, key: str) -> Any:
        try:
            value = dict.__getitem__(self, key)
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no field {key!r}; fields: "
                                 f"{', '.join(self._FIELDS)}") from None
        typed = self._ATTRS.get(key)
        return value if typed is None or value is None else typed(value)

    def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is read-only (what was reported stays as reported); "
                        f"copy it with dict(...) or .to_json() to change it")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __setattr__(self, key: str, value: Any) -> NoReturn:
        raise FrozenInstanceError(f"cannot assign to field {key!r}: {type(self).__name__} is read-only")

    def __delattr__(self, key: str) -> NoReturn:
        raise FrozenInstanceError(f"cannot delete field {key!r}: {type(self).__name__} is read-only")

    def __reduce__(self) -> Tuple[Any, ...]:
        # Pickle and copy rebuild through the constructor, not item assignment (refused above).
        return (_rebuild, (type(self), dict(self)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.items())})"

    def to_json(self) -> Dict[str, Any]:
        """A plain, mutable copy of the document."""
        return copy.deepcopy(dict(self))


def _rebuild(cls: Type[P], doc: Dict[str, Any]) -> P:
    payload = dict.__new__(cls)
    dict.__init__(payload, doc)
    return payload


def nested(cls: Type[P]) -> Callable[[Dict[str, Any]], P]:
    """The `_ATTRS` reader of a field holding another payload's document (it was validated when
    that payload was built)."""
    return lambda doc: _rebuild(cls, doc)
