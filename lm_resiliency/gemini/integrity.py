"""End-to-end capture checksums and the non-finite check of captured floating tensors.

With `verify_integrity`, the capture worker computes one CRC-32 per `CRC_CHUNK_BYTES` of the
slot payload right after the copy completes. That record travels with the bytes (slot
`extra`, replication header, shared-memory sidecar, shard file) and every hand-off checks
the bytes against it: the replica receiver before publishing, the flush before writing,
recovery before using a memory slot, a shard or a received replica. A bit that flips after
capture is therefore never re-stamped with a fresh, valid checksum.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from lm_resiliency._values import is_int
from lm_resiliency.checksum import tensor_crc32
from lm_resiliency.codec import StateEncodingError, encode_state
from lm_resiliency.gemini.workers import BackgroundError

CRC_KEY = "capture_crc32"
CRC_CHUNK_BYTES = 16 * 1024 * 1024


class NonFiniteState(BackgroundError):
    """A capture held NaN or Inf in a floating tensor; it was not published as recoverable.
    Raised at the next `maybe_wait()`/`save()`."""


class IntegrityError(BackgroundError):
    """Bytes no longer match their capture checksum, or belong to another timeline; they were
    not published, written or loaded."""


def capture_checksums(payload: torch.Tensor) -> Dict[str, Any]:
    """The capture record: CRC-32 of each `CRC_CHUNK_BYTES` chunk of a 1-D uint8 payload."""
    size = CRC_CHUNK_BYTES
    crcs = [tensor_crc32(payload[i: i + size]) for i in range(0, payload.numel(), size)]
    return {"chunk_bytes": size, "total_bytes": payload.numel(), "crc32": crcs}


def checksum_problem(extra: Optional[dict], payload: torch.Tensor) -> Optional[str]:
    """Why `payload` does not match the capture record in `extra`, or None when it does."""
    record = (extra or {}).get(CRC_KEY)
    if record is None:
        return ("it carries no capture checksum (captured with verify_integrity=False); with "
                "verify_integrity=True only checksummed captures are eligible")
    if (not isinstance(record, dict) or set(record) != {"chunk_bytes", "total_bytes", "crc32"}
            or not isinstance(record["crc32"], list)
            or not all(is_int(v) for v in
                       [record["chunk_bytes"], record["total_bytes"], *record["crc32"]])
            or record["chunk_bytes"] < 1):
        return f"its capture checksum record is malformed: {record!r}"
    size = record["chunk_bytes"]
    if record["total_bytes"] != payload.numel() or len(record["crc32"]) != -(-payload.numel() // size):
        return (f"it has {payload.numel()} bytes, its capture checksum covers {record['total_bytes']} "
                f"in {len(record['crc32'])} chunks")
    for index, expected in enumerate(record["crc32"]):
        actual = tensor_crc32(payload[index * size: (index + 1) * size])
        if actual != expected:
            return (f"CRC-32 mismatch in chunk {index} (bytes {index * size}..): captured "
                    f"{expected:#010x}, now {actual:#010x}; the bytes changed after capture")
    return None


def _total(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d float64 that is finite when every element of `tensor` is finite (and, rarely, not
    even though they are: an overflowing sum, re-checked by the caller). One sum, no mask: NaN
    and Inf propagate through it. Half precision is summed in float32."""
    try:
        total = tensor.sum(dtype=torch.float32) if tensor.element_size() < 4 and not tensor.is_complex() \
            else tensor.sum()
    except (RuntimeError, TypeError):  # dtypes without a sum kernel (float8)
        total = torch.where(_all_finite(tensor), 0.0, float("nan"))
    return (total.abs() if total.is_complex() else total).double()


def _all_finite(tensor: torch.Tensor) -> torch.Tensor:
    """0-d bool: every element finite. float8 has no isfinite kernel; float32 holds its NaN and Inf."""
    try:
        return torch.isfinite(tensor).all()
    except (NotImplementedError, RuntimeError):
        return torch.isfinite(tensor.float()).all()


def nonfinite_indices(tensors: List[torch.Tensor]) -> List[int]:
    """Indices of the floating (and complex) tensors that hold NaN or Inf; one host sync per
    device (tensors may live on an accelerator)."""
    by_device: Dict[torch.device, list] = {}
    for i, t in enumerate(tensors):
        if (t.is_floating_point() or t.is_complex()) and t.numel():
            by_device.setdefault(t.device, []).append(i)
    suspects = []
    for indices in by_device.values():
        flags = torch.isfinite(torch.stack([_total(tensors[i]) for i in indices])).cpu().tolist()
        suspects += [i for i, ok in zip(indices, flags) if not ok]
    # A non-finite sum of finite values (overflow) is not a non-finite tensor.
    return sorted(i for i in suspects if not bool(_all_finite(tensors[i])))


def nonfinite_values(named: Iterable[Tuple[str, Any]]) -> List[str]:
    """Paths of the NaN and Inf among (name, value) pairs whatever holds them: tensors, NumPy
    arrays and scalars, Python floats, nested in lists, tuples and dicts (e.g. an optimizer's
    ``param_groups[0]['lr']``). A value GEMINI cannot capture is skipped: it is never restored."""
    found: List[str] = []
    for name, value in named:
        try:
            encoded = encode_state(value)
        except StateEncodingError:
            continue
        found += [name + path.removeprefix("state") for path in encoded.nonfinite]
        paths = leaf_paths(encoded.structure, nonfinite_indices(encoded.tensors))
        found += [name + path.removeprefix("state") for path in paths]
    return found


def leaf_paths(structure: Any, indices: List[int]) -> List[str]:
    """Paths (e.g. ``state['model']['w']``) of the tensor leaves `indices` of an encoded structure."""
    wanted = set(indices)
    found: Dict[int, str] = {}

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        tag = node.get("t")
        if tag == "tensor" and node.get("i") in wanted:
            found[node["i"]] = path
        elif tag in ("list", "tuple"):
            for i, item in enumerate(node.get("items", [])):
                walk(item, f"{path}[{i}]")
        elif tag == "dict":
            for key, item in node.get("items", []):
                walk(item, f"{path}[{key!r}]")

    walk(structure, "state")
    return [found.get(i, f"tensor #{i}") for i in indices]
