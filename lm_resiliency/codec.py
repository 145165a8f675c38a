"""Turn a nested training state into (JSON structure, tensor leaves) and back.

No pickle anywhere: the structure is a schema-checked JSON document. Tensors are leaves
referenced by index; they live in a host slot's flat byte buffer described by a `Layout`.
Supported non-tensor values: None, bool, int, float (incl. nan/inf), str, list, tuple,
dict (str/int/float/bool/None keys), NumPy arrays and scalars, torch.dtype, torch.device.
Anything else fails at encode time with the path of the offending value.
"""

from __future__ import annotations

import base64
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from lm_resiliency._values import is_int as _is_int
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.files import RecordRejected, RecordSchema, array, check_record, integer, nested, text

ALIGNMENT = 64
# Containers (dict/list/tuple) nested deeper than this are refused at capture: each level is three
# JSON levels in the structure, which must stay within what readers accept (files.MAX_JSON_DEPTH).
MAX_STATE_DEPTH = 64

_DTYPES: Dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.complex64, torch.complex128,
        torch.uint16, torch.uint32, torch.uint64,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}


_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_PLAIN_SCALARS = (str, int, bool)
_PLAIN_KEYS = (str, int)


class StateEncodingError(ResiliencyError, TypeError):
    """A value in the state cannot be captured safely (no pickle fallback exists)."""


class StateTooDeepError(StateEncodingError, ValueError):
    """The state nests containers deeper than `MAX_STATE_DEPTH`; refused at capture, never at load."""


class StateSchemaError(RecordRejected):
    """A stored or received structure does not match the schema; it is never applied."""


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise StateEncodingError(f"tensor dtype {dtype} is not supported by GEMINI capture")
    return name


def dtype_from_name(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise StateSchemaError(f"unknown tensor dtype {name!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor leaf lives in a slot buffer."""

    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes}


_TENSOR_SPEC_SCHEMA = RecordSchema(what="tensor spec", fields={
    "dtype": text(choices=tuple(_DTYPES)), "shape": array(integer(0), max_length=None), "offset": integer(0),
    "nbytes": integer(0)})
# `Layout.to_json`: every place that reads a layout (shards, sidecars, replica headers, transfer
# offers, SCOUT invocations) checks it against this first.
LAYOUT_SCHEMA = RecordSchema(what="tensor layout", fields={
    "total_bytes": integer(0), "tensors": array(nested(_TENSOR_SPEC_SCHEMA), max_length=None)})


@dataclass(frozen=True)
class Layout:
    """The byte layout of every tensor leaf in a slot buffer. Equal layouts share buffers."""

    specs: Tuple[TensorSpec, ...]
    total_bytes: int

    @staticmethod
    def for_tensors(tensors: List[torch.Tensor]) -> "Layout":
        specs = []
        offset = 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            specs.append(TensorSpec(dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes))
            offset += (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        return Layout(tuple(specs), offset)

    def to_json(self) -> dict:
        return {"total_bytes": self.total_bytes, "tensors": [s.to_json() for s in self.specs]}

    @staticmethod
    def from_json(doc: object) -> "Layout":
        checked = check_record(doc, LAYOUT_SCHEMA, "layout", error=StateSchemaError)
        total = checked["total_bytes"]
        specs = []
        end = 0
        for i, raw in enumerate(checked["tensors"]):
            where = f"layout.tensors[{i}]"
            dtype = _DTYPES[raw["dtype"]]
            shape = raw["shape"]
            offset, nbytes = raw["offset"], raw["nbytes"]
            if offset < end or offset % ALIGNMENT:
                raise StateSchemaError(f"{where}: offset {offset!r} overlaps or is misaligned")
            numel = math.prod(shape)
            if nbytes != numel * torch.empty((), dtype=dtype).element_size():
                raise StateSchemaError(f"{where}: nbytes {nbytes!r} does not match shape {shape} and dtype")
            end = offset + nbytes
            if end > total:
                raise StateSchemaError(f"{where}: extends past layout.total_bytes")
            specs.append(TensorSpec(raw["dtype"], tuple(shape), offset, nbytes))
        return Layout(tuple(specs), total)

    def views(self, buffer: torch.Tensor) -> List[torch.Tensor]:
        """Typed views of each leaf inside a flat uint8 `buffer` (no copy)."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < self.total_bytes:
            raise StateSchemaError(
                f"buffer of {buffer.numel()} bytes cannot hold layout of {self.total_bytes} bytes")
        out = []
        for spec in self.specs:
            dtype = _DTYPES[spec.dtype]
            raw = buffer[spec.offset: spec.offset + spec.nbytes]
            out.append(raw.view(dtype).view(spec.shape))
        return out


@dataclass(frozen=True)
class EncodedState:
    """A state dict split into a JSON-able structure and its tensor leaves (in order).
    `nonfinite` names the values outside tensors that hold NaN or Inf (Python floats, NumPy
    arrays and scalars), found while encoding; the tensors are checked after their copy."""

    structure: Any
    tensors: List[torch.Tensor]
    nonfinite: Tuple[str, ...] = ()


def _local_tensor(value: torch.Tensor) -> Tuple[torch.Tensor, Optional[dict]]:
    """DTensors are captured as their local shard plus enough metadata to check the restore."""
    to_local = getattr(value, "to_local", None)
    if to_local is not None and type(value).__name__ == "DTensor":
        return to_local(), {"global_shape": list(value.shape),
                            "placements": [str(p) for p in value.placements]}
    return value, None


def encode_state(state: Any) -> EncodedState:
    """Split `state` into its JSON structure and tensor leaves. Runs on the training thread at
    every capture, so the common leaves (tensors, str/int keys) take the shortest path and the
    path of a value is only spelled out when it is rejected."""
    tensors: List[torch.Tensor] = []
    keys: List[Any] = []
    nonfinite: List[str] = []

    def where() -> str:
        return "state" + "".join(f"[{k!r}]" for k in keys)

    def too_deep() -> StateTooDeepError:
        return StateTooDeepError(f"{where()}: the state nests dicts/lists/tuples deeper than "
                                 f"{MAX_STATE_DEPTH} levels, the most GEMINI captures; flatten it")

    def enc(value: Any) -> Any:
        kind = type(value)
        if kind is torch.Tensor or isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise StateEncodingError(f"{where()}: only dense tensors can be captured (got {value.layout})")
            local, dt = _local_tensor(value)
            if local.dtype not in _DTYPE_NAMES:
                _checked_dtype(local.dtype, where())
            tensors.append(local.detach())
            node = {"t": "tensor", "i": len(tensors) - 1}
            if dt is not None:
                node["dtensor"] = dt
            return node
        if kind in _PLAIN_SCALARS or value is None:
            return value
        if kind is dict or isinstance(value, dict):
            if len(keys) >= MAX_STATE_DEPTH:
                raise too_deep()
            items = []
            for key, item in value.items():
                if type(key) not in _PLAIN_KEYS and not (key is None or isinstance(key, (str, bool, float))
                                                          or _is_int(key)):
                    raise StateEncodingError(f"{where()}: dict key {key!r} of type {type(key).__name__} "
                                             "is not supported (use str or int keys)")
                keys.append(key)
                items.append([key if type(key) in _PLAIN_KEYS else enc(key), enc(item)])
                keys.pop()
            return {"t": "dict", "items": items}
        if kind is list or kind is tuple or isinstance(value, (list, tuple)):
            if len(keys) >= MAX_STATE_DEPTH:
                raise too_deep()
            encoded = []
            for index, item in enumerate(value):
                keys.append(index)
                encoded.append(enc(item))
                keys.pop()
            return {"t": "list" if isinstance(value, list) else "tuple", "items": encoded}
        numpy_node = _encode_numpy(value, where, nonfinite)
        if numpy_node is not None:  # before float: numpy.float64 subclasses float
            return numpy_node
        if isinstance(value, (bool, str)) or _is_int(value):
            return value
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            nonfinite.append(where())
            return {"t": "float", "v": repr(value)}
        if isinstance(value, torch.dtype):
            return {"t": "dtype", "v": _checked_dtype(value, where())}
        if isinstance(value, torch.device):
            return {"t": "device", "v": str(value)}
        raise StateEncodingError(
            f"{where()}: value of type {type(value).__module__}.{type(value).__qualname__} cannot be captured "
            "without pickle. Convert it to plain Python/NumPy/tensor values in your state_dict or "
            "extra_state_fn.")

    return EncodedState(enc(state), tensors, tuple(nonfinite))


def _checked_dtype(dtype: torch.dtype, path: str) -> str:
    try:
        return dtype_name(dtype)
    except StateEncodingError as exc:
        raise StateEncodingError(f"{path}: {exc}") from None


def _encode_numpy(value: Any, where: Callable[[], str], nonfinite: List[str]) -> Optional[dict]:
    np = sys.modules.get("numpy")
    if np is None:  # values of NumPy types cannot exist without NumPy imported
        return None
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise StateEncodingError(f"{where()}: NumPy object arrays cannot be captured without pickle")
        if value.dtype.kind in "fc" and value.size and not np.isfinite(value).all():
            nonfinite.append(where())
        data = base64.b64encode(np.ascontiguousarray(value).tobytes()).decode("ascii")
        return {"t": "ndarray", "dtype": value.dtype.str, "shape": list(value.shape), "b64": data}
    if isinstance(value, np.generic):
        return {"t": "npscalar", "dtype": value.dtype.str,
                "v": _encode_numpy(np.asarray(value), where, nonfinite)}
    return None


def check_structure(structure: Any, layout: Layout) -> None:
    """Raise StateSchemaError unless `structure` decodes with the tensors of `layout`, each
    referenced exactly once: what `decode_state` requires, checked while a copy can still be
    refused (before recovery chooses it), not when its bytes arrive."""
    placeholder = torch.empty(0)
    decode_state(structure, [placeholder] * len(layout.specs))


def decode_state(structure: Any, tensors: List[torch.Tensor]) -> Any:
    """Rebuild the nested state. Every tensor leaf must be referenced exactly once."""
    used = [False] * len(tensors)

    def dec(node: Any, path: str) -> Any:
        if node is None or isinstance(node, (bool, str, float)) or _is_int(node):
            return node
        if not isinstance(node, dict) or "t" not in node:
            raise StateSchemaError(f"{path}: expected a tagged object, got {type(node).__name__}")
        tag = node["t"]
        if tag == "tensor":
            index = node.get("i")
            if not _is_int(index) or not 0 <= index < len(tensors) or used[index]:
                raise StateSchemaError(f"{path}: bad or repeated tensor index {index!r}")
            used[index] = True
            return tensors[index]
        if tag in ("list", "tuple"):
            items = node.get("items")
            if not isinstance(items, list):
                raise StateSchemaError(f"{path}: {tag} items must be a list")
            values = [dec(v, f"{path}[{i}]") for i, v in enumerate(items)]
            return values if tag == "list" else tuple(values)
        if tag == "dict":
            items = node.get("items")
            if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 for p in items):
                raise StateSchemaError(f"{path}: dict items must be [key, value] pairs")
            out = {}
            for key_node, value_node in items:
                key = dec(key_node, f"{path}.<key>")
                if not (key is None or isinstance(key, (str, bool, float)) or _is_int(key)):
                    raise StateSchemaError(f"{path}: dict key must be str, int, float, bool or None")
                out[key] = dec(value_node, f"{path}[{key!r}]")
            return out
        if tag == "float":
            if node.get("v") not in ("nan", "inf", "-inf"):
                raise StateSchemaError(f"{path}: bad special float {node.get('v')!r}")
            return float(node["v"])
        if tag == "dtype":
            return dtype_from_name(node.get("v"))
        if tag == "device":
            try:
                return torch.device(node.get("v"))
            except (RuntimeError, TypeError) as exc:
                raise StateSchemaError(f"{path}: bad device {node.get('v')!r}") from exc
        if tag in ("ndarray", "npscalar"):
            return _decode_numpy(node, path)
        raise StateSchemaError(f"{path}: unknown type tag {tag!r}")

    state = dec(structure, "state")
    if not all(used):
        raise StateSchemaError(f"{used.count(False)} tensor leaves are not referenced by the structure")
    return state


def _decode_numpy(node: dict, path: str) -> Any:
    import numpy as np

    if node["t"] == "npscalar":
        inner = node.get("v")
        if not isinstance(inner, dict) or inner.get("t") != "ndarray":
            raise StateSchemaError(f"{path}: numpy scalar must wrap an ndarray node")
        return _decode_numpy(inner, path)[()]
    try:
        dtype = np.dtype(node["dtype"])
        shape = tuple(node["shape"])
        raw = base64.b64decode(node["b64"], validate=True)
    except (KeyError, TypeError, ValueError) as exc:
        raise StateSchemaError(f"{path}: malformed ndarray node ({exc})") from exc
    if dtype.hasobject or not all(_is_int(d) and d >= 0 for d in shape):
        raise StateSchemaError(f"{path}: ndarray dtype/shape not allowed")
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise StateSchemaError(f"{path}: ndarray byte count does not match its shape")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
