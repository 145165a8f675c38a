"""The `parameters` each failure type accepts, checked at construction.

Keys starting with ``x_`` are passed through unchecked for custom executors; any other key a
type does not know is rejected, so a typo fails when the campaign is built, not mid-run.
"""

from __future__ import annotations

import signal
from typing import Any, Callable, Dict, Mapping

from ._fields import fail, is_int, is_number
from .corruption import CorruptionOperation, FaultMagnitude, FaultScope
from .taxonomy import FailureType, FaultSurface

Check = Callable[[Any, str], None]


def _enum(enum_cls) -> Check:
    return _choice(*(m.value for m in enum_cls))


def _number(lo: float = float("-inf"), hi: float = float("inf"), *, lo_open: bool = False,
            hi_open: bool = False) -> Check:
    def check(value: Any, path: str) -> None:
        ok = is_number(value) and (value > lo if lo_open else value >= lo) and (
            value < hi if hi_open else value <= hi)
        if not ok:
            left, right = "(" if lo_open else "[", ")" if hi_open else "]"
            fail(path, f"must be a finite number in {left}{lo}, {hi}{right}, got {value!r}")
    return check


def _int(lo: int = 0) -> Check:
    def check(value: Any, path: str) -> None:
        if not is_int(value) or value < lo:
            fail(path, f"must be an int >= {lo}, got {value!r}")
    return check


def _str(value: Any, path: str) -> None:
    if not isinstance(value, str) or not value:
        fail(path, f"must be a non-empty string, got {value!r}")


def _scalar(value: Any, path: str) -> None:
    if not (isinstance(value, (str, bool)) or is_number(value)):
        fail(path, f"must be a string, number or boolean, got {value!r}")


def _signal_name(value: Any, path: str) -> None:
    if not isinstance(value, str) or not value.startswith("SIG") or not hasattr(signal, value):
        fail(path, f"must be a signal name such as 'SIGKILL', got {value!r}")


def _choice(*allowed: str) -> Check:
    def check(value: Any, path: str) -> None:
        if value not in allowed:
            fail(path, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return check


_kind = _choice("own", "peer")


def _rank_list(value: Any, path: str) -> None:
    if not isinstance(value, tuple) or not all(is_int(x) and x >= 0 for x in value):
        fail(path, f"must be a list of non-negative ranks, got {value!r}")


_CORRUPTION: Dict[str, Check] = {
    "operation": _enum(CorruptionOperation),
    "scope": _enum(FaultScope),
    "magnitude": _enum(FaultMagnitude),
    "fraction": _number(0.0, 1.0, lo_open=True),
    "index": _int(0),
    "bit": _int(0),
    "factor": _number(),
    "addend": _number(),
    "parameter": _str,          # PARAMETER/GRADIENT/OPTIMIZER_STATE: one parameter name
    "state_key": _str,          # OPTIMIZER_STATE: one state entry (e.g. "exp_avg")
    "index_in_output": _int(0),  # OUTPUT/INPUT: which tensor of a tuple (default 0)
}
_STALL = {"seconds": _number(0.0)}
_SHARD = {"disk_folder": _str, "step": _int(0), "kind": _kind, "owner_rank": _int(0)}

F = FailureType
SCHEMA: Dict[FailureType, Dict[str, Check]] = {
    F.TENSOR_CORRUPTION: _CORRUPTION,
    F.STALE_STATE: {"parameter": _str},
    F.DROP: {},
    F.DUPLICATE: {},
    F.REORDER: {},
    F.DELAY: _STALL,
    F.HANG: _STALL,
    F.TIMEOUT: dict(_STALL, message=_str),
    F.EXCEPTION: {"message": _str},
    F.RESOURCE_EXHAUSTION: {"resource": _choice("disk", "host_memory", "device_memory"),
                            "bytes": _int(1)},
    F.PROCESS_TERMINATION: {"signal": _signal_name},
    F.RESOURCE_UNAVAILABLE: {"resource": _str},
    F.CHECKPOINT_CORRUPTION: dict(_SHARD, offset=_int(0), bytes=_int(1)),
    F.CHECKPOINT_TRUNCATION: dict(_SHARD, keep_fraction=_number(0.0, 1.0, hi_open=True),
                                  keep_bytes=_int(0)),
    F.CHECKPOINT_MISSING: dict(_SHARD),
    F.IO_ERROR: {"message": _str, "errno": _int(1)},
    F.PAYLOAD_CORRUPTION: dict(_CORRUPTION),
    F.COLLECTIVE_DESYNC: {},
    F.MESSAGE_DROP: {"peer": _int(0)},
    F.NETWORK_PARTITION: {"peers": _rank_list},
    F.CONFIG_DRIFT: {"key": _str, "value": _scalar, "param_group": _int(0), "env": _str},
}
del F

_REQUIRED: Dict[FailureType, tuple] = {
    FailureType.TENSOR_CORRUPTION: ("operation",),
    FailureType.DELAY: ("seconds",),
    FailureType.HANG: ("seconds",),
    FailureType.CONFIG_DRIFT: ("value",),
}


def validate_parameters(failure_type: FailureType, surface: FaultSurface,
                        params: Mapping[str, Any], path: str) -> None:
    """Check `params` (already frozen JSON) for `failure_type`; raise with `<path>.<key>`."""
    schema = SCHEMA[failure_type]
    for key, value in params.items():
        if key.startswith("x_"):
            continue
        if key not in schema:
            known = ", ".join(sorted(schema)) or "none"
            fail(f"{path}.{key}", f"unknown parameter for {failure_type.value} (known: {known}; "
                                  "prefix custom executor parameters with 'x_')")
        schema[key](value, f"{path}.{key}")
    for key in _REQUIRED.get(failure_type, ()):
        if key not in params:
            fail(f"{path}.{key}", f"required for {failure_type.value}")
    if failure_type in (FailureType.TENSOR_CORRUPTION, FailureType.PAYLOAD_CORRUPTION):
        _validate_corruption(params, surface, path)
    if failure_type is FailureType.HANG and params["seconds"] <= 0:
        fail(f"{path}.seconds", "a hang must last a positive, bounded number of seconds")
    if failure_type is FailureType.CHECKPOINT_TRUNCATION and {"keep_fraction", "keep_bytes"} <= set(params):
        fail(path, "give keep_fraction or keep_bytes, not both")
    if failure_type is FailureType.CONFIG_DRIFT:
        if ("key" in params) == ("env" in params):
            fail(path, "config_drift needs exactly one of key (an optimizer hyperparameter) or "
                       "env (an environment variable)")
        if "env" in params and "param_group" in params:
            fail(f"{path}.param_group", "applies to optimizer hyperparameters, not to env")


def _validate_corruption(params: Mapping[str, Any], surface: FaultSurface, path: str) -> None:
    scope = params.get("scope", FaultScope.FULL.value)
    operation = params.get("operation")
    if scope == FaultScope.FRACTION.value and "fraction" not in params:
        fail(f"{path}.fraction", "required when scope is 'fraction'")
    if "fraction" in params and scope != FaultScope.FRACTION.value:
        fail(f"{path}.fraction", "only applies when scope is 'fraction'")
    if "index" in params and scope != FaultScope.ELEMENT.value:
        fail(f"{path}.index", "only applies when scope is 'element'")
    for key, op in (("bit", CorruptionOperation.BIT_FLIP), ("factor", CorruptionOperation.SCALE),
                    ("addend", CorruptionOperation.ADD)):
        if key in params and operation != op.value:
            fail(f"{path}.{key}", f"only applies when operation is '{op.value}'")
    if "state_key" in params and surface is not FaultSurface.OPTIMIZER_STATE:
        fail(f"{path}.state_key", "only applies to the optimizer_state surface")
    if "index_in_output" in params and surface not in (FaultSurface.OUTPUT, FaultSurface.INPUT):
        fail(f"{path}.index_in_output", "only applies to the output and input surfaces")


__all__ = ["SCHEMA", "validate_parameters"]
