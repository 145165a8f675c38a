"""Tensor corruption: what to do to the values (operation), to which elements (scope), how hard
(magnitude), and the out-of-place implementation that verifies what actually changed."""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import Any, Dict, Optional, Tuple

import torch

from .errors import UnsupportedFaultError


class CorruptionOperation(str, Enum):
    SIGN_FLIP = "sign_flip"     # v -> -v
    BIT_FLIP = "bit_flip"       # flip one bit of the stored representation (`bit`)
    SCALE = "scale"             # v -> v * factor
    ADD = "add"                 # v -> v + addend
    ZERO = "zero"               # v -> 0
    NAN = "nan"                 # v -> NaN
    INF = "inf"                 # v -> +inf
    RANDOM = "random"           # v -> a seeded standard-normal draw


class FaultScope(str, Enum):
    FULL = "full"               # every element
    ELEMENT = "element"         # one element (`index`, or a seeded choice); with BIT_FLIP, one bit
    FRACTION = "fraction"       # a seeded random `fraction` of the elements (at least one)


class FaultMagnitude(str, Enum):
    """Default strength when a corruption does not give `factor`, `addend` or `bit` explicitly.

    scale factor: 1.001 / 2.0 / 1e4; addend: 1e-3 / 1.0 / 1e4; flipped bit: the lowest mantissa
    bit / the highest mantissa bit / the highest exponent bit (integers: bit 0 / the middle bit /
    the bit below the sign)."""

    SUBTLE = "subtle"
    MODERATE = "moderate"
    SEVERE = "severe"


_FACTOR = {FaultMagnitude.SUBTLE: 1.001, FaultMagnitude.MODERATE: 2.0, FaultMagnitude.SEVERE: 1e4}
_ADDEND = {FaultMagnitude.SUBTLE: 1e-3, FaultMagnitude.MODERATE: 1.0, FaultMagnitude.SEVERE: 1e4}

# dtype -> (same-width integer dtype, bits, highest mantissa bit, highest exponent bit)
_FLOAT_BITS = {
    torch.float64: (torch.int64, 64, 51, 62),
    torch.float32: (torch.int32, 32, 22, 30),
    torch.float16: (torch.int16, 16, 9, 14),
    torch.bfloat16: (torch.int16, 16, 6, 14),
}
_INT_BITS = {torch.int64: 64, torch.int32: 32, torch.int16: 16, torch.int8: 8, torch.uint8: 8}
_SIGNED_INT = {torch.int64, torch.int32, torch.int16, torch.int8}


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any printable parts (campaign seed, occurrence id, fault id, call)."""
    text = "\0".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1


def _int_view(t: torch.Tensor) -> Tuple[torch.Tensor, int]:
    if t.dtype in _FLOAT_BITS:
        itype, nbits, _, _ = _FLOAT_BITS[t.dtype]
        return t.contiguous().view(itype), nbits
    if t.dtype in _INT_BITS:
        return t.contiguous(), _INT_BITS[t.dtype]
    raise TypeError(f"no bit representation for dtype {t.dtype}")


def default_bit(dtype: torch.dtype, magnitude: FaultMagnitude) -> int:
    if dtype in _FLOAT_BITS:
        _, _, mantissa_msb, exponent_msb = _FLOAT_BITS[dtype]
        return {FaultMagnitude.SUBTLE: 0, FaultMagnitude.MODERATE: mantissa_msb,
                FaultMagnitude.SEVERE: exponent_msb}[magnitude]
    nbits = _INT_BITS[dtype]
    return {FaultMagnitude.SUBTLE: 0, FaultMagnitude.MODERATE: nbits // 2 - 1,
            FaultMagnitude.SEVERE: nbits - 2}[magnitude]


def count_changed(before: torch.Tensor, after: torch.Tensor) -> Tuple[int, list]:
    """Elements whose stored bits differ (NaN-safe), and up to 8 of their flat indices."""
    a, _ = _int_view(before.detach())
    b, _ = _int_view(after.detach())
    diff = (a.reshape(-1) != b.reshape(-1))
    changed = int(diff.sum().item())
    indices = diff.nonzero().reshape(-1)[:8].tolist() if changed else []
    return changed, indices


# Applying these twice gives the value back: a fault that lasts is held, never applied again.
INVOLUTIVE = frozenset({CorruptionOperation.SIGN_FLIP, CorruptionOperation.BIT_FLIP})


def _flat(t: torch.Tensor, fault_id: str) -> torch.Tensor:
    """A flat view that writes through to `t` (state tensors are contiguous)."""
    if not t.is_contiguous():
        raise UnsupportedFaultError(fault_id, "the state tensor is not contiguous; it cannot be held or restored "
                                              "in place")
    return t.detach().view(-1)


def _bits(values: torch.Tensor) -> torch.Tensor:
    return values.view(_FLOAT_BITS[values.dtype][0]) if values.dtype in _FLOAT_BITS else values


def trace_change(before: torch.Tensor, after: torch.Tensor,
                 trace: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """What an in-place corruption changed in one state tensor, merged into `trace`: the flat
    `indices` of the changed elements, their `original` bits (before the first corruption) and
    the `flipped` bits (original XOR corrupted), which a held fault keeps in effect."""
    a, _ = _int_view(before.detach())
    b, _ = _int_view(after.detach())
    a, b = a.reshape(-1), b.reshape(-1)
    indices = (a != b).nonzero().reshape(-1)
    if trace is not None:
        new = indices[~torch.isin(indices, trace["indices"])]
        return {"indices": torch.cat([trace["indices"], new]), "original": torch.cat([trace["original"], a[new]]),
                "flipped": torch.cat([trace["flipped"], a[new] ^ b[new]])}
    return {"indices": indices, "original": a[indices].clone(), "flipped": a[indices] ^ b[indices]}


def hold_change(t: torch.Tensor, trace: Dict[str, torch.Tensor], fault_id: str) -> int:
    """Keep a traced involutive corruption in effect: force the flipped bits of the traced
    elements to their corrupted values again, leaving every other bit as training made it (a
    stuck-at fault). Returns how many elements had to be forced."""
    flat = _flat(t, fault_id)
    idx, flipped = trace["indices"], trace["flipped"]
    current = _bits(flat[idx])
    held = (current & ~flipped) | ((trace["original"] ^ flipped) & flipped)
    changed = int((held != current).sum().item())
    flat[idx] = held.view(t.dtype) if t.dtype in _FLOAT_BITS else held
    return changed


def restore_change(t: torch.Tensor, trace: Dict[str, torch.Tensor], fault_id: str) -> int:
    """Write the traced elements' original values back; returns how many differed."""
    flat = _flat(t, fault_id)
    idx, original = trace["indices"], trace["original"]
    changed = int((_bits(flat[idx]) != original).sum().item())
    flat[idx] = original.view(t.dtype) if t.dtype in _FLOAT_BITS else original
    return changed


def corrupt_tensor(x: torch.Tensor, *, fault_id: str, operation: CorruptionOperation,
                   scope: FaultScope = FaultScope.FULL, seed: int = 0,
                   fraction: Optional[float] = None, index: Optional[int] = None,
                   bit: Optional[int] = None, factor: Optional[float] = None,
                   addend: Optional[float] = None,
                   magnitude: FaultMagnitude = FaultMagnitude.MODERATE) -> Tuple[torch.Tensor, Dict]:
    """Return a corrupted copy of `x` (out of place, autograd-friendly) and the verified evidence.

    Differentiable operations (sign flip, scale, add, zero) keep the autograd graph; the others
    replace values with constants. Raises UnsupportedFaultError when the dtype cannot take the
    operation (complex, bool, NaN into an integer tensor, a bit beyond the dtype's width)."""
    if not isinstance(x, torch.Tensor):
        raise UnsupportedFaultError(fault_id, f"the target value is a {type(x).__name__}, not a tensor")
    dtype = x.dtype
    floating = dtype in _FLOAT_BITS
    if not floating and dtype not in _INT_BITS:
        raise UnsupportedFaultError(fault_id, f"cannot corrupt a {dtype} tensor")
    if not floating and operation in (CorruptionOperation.NAN, CorruptionOperation.INF,
                                      CorruptionOperation.RANDOM, CorruptionOperation.SCALE):
        raise UnsupportedFaultError(fault_id, f"{operation.value} needs a floating-point tensor, "
                                              f"the target is {dtype}")
    if operation is CorruptionOperation.SIGN_FLIP and dtype is torch.uint8:
        raise UnsupportedFaultError(fault_id, "sign_flip of an unsigned uint8 tensor")
    evidence: Dict[str, Any] = {"operation": operation.value, "scope": scope.value,
                                "dtype": str(dtype).replace("torch.", ""), "shape": list(x.shape),
                                "elements": x.numel()}
    numel = x.numel()
    if numel == 0:
        evidence.update(elements_changed=0, indices=[])
        return x, evidence
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)

    mask: Optional[torch.Tensor] = None
    if scope is FaultScope.ELEMENT:
        if index is None:
            index = int(torch.randint(numel, (1,), generator=generator).item())
        if index >= numel:
            raise UnsupportedFaultError(fault_id, f"element index {index} is out of range for a tensor "
                                                  f"of {numel} elements")
        chosen = torch.tensor([index])
        evidence["index"] = index
    elif scope is FaultScope.FRACTION:
        if fraction is None:
            raise UnsupportedFaultError(fault_id, "scope 'fraction' needs `fraction`, the share of elements "
                                                  "to corrupt in (0, 1]")
        count = max(1, min(numel, int(round(float(fraction) * numel))))
        chosen = torch.randperm(numel, generator=generator)[:count]
        evidence["fraction"] = fraction
    else:
        chosen = None
    if chosen is not None:
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[chosen] = True
        mask = mask.reshape(x.shape).to(x.device)

    if operation is CorruptionOperation.SIGN_FLIP:
        corrupted = -x
    elif operation is CorruptionOperation.SCALE:
        factor = _FACTOR[magnitude] if factor is None else factor
        evidence["factor"] = factor
        corrupted = x * factor
    elif operation is CorruptionOperation.ADD:
        addend = _ADDEND[magnitude] if addend is None else addend
        if not floating:
            addend = int(addend)
        evidence["addend"] = addend
        corrupted = x + addend
    elif operation is CorruptionOperation.ZERO:
        corrupted = torch.zeros_like(x.detach())
    elif operation is CorruptionOperation.NAN:
        corrupted = torch.full_like(x.detach(), float("nan"))
    elif operation is CorruptionOperation.INF:
        corrupted = torch.full_like(x.detach(), float("inf"))
    elif operation is CorruptionOperation.RANDOM:
        corrupted = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(
            device=x.device, dtype=dtype)
    elif operation is CorruptionOperation.BIT_FLIP:
        ints, nbits = _int_view(x.detach())
        bit = default_bit(dtype, magnitude) if bit is None else bit
        if bit >= nbits:
            raise UnsupportedFaultError(fault_id, f"bit {bit} does not exist in a {nbits}-bit "
                                                  f"{dtype} element")
        evidence["bit"] = bit
        if dtype in _SIGNED_INT or dtype in _FLOAT_BITS:
            flip = (1 << bit) if bit < nbits - 1 else -(1 << (nbits - 1))
        else:
            flip = 1 << bit
        corrupted = (ints ^ flip).view(dtype).reshape(x.shape)
    else:  # pragma: no cover - enum is closed
        raise UnsupportedFaultError(fault_id, f"unknown operation {operation!r}")
    out = corrupted if mask is None else torch.where(mask, corrupted, x)
    if mask is None and not out.requires_grad and x.requires_grad:
        out = torch.where(torch.ones_like(x, dtype=torch.bool), out, x)
    changed, indices = count_changed(x, out)
    evidence.update(elements_changed=changed, indices=indices)
    return out, evidence


__all__ = ["INVOLUTIVE", "CorruptionOperation", "FaultMagnitude", "FaultScope", "corrupt_tensor", "count_changed",
           "default_bit", "derive_seed", "hold_change", "restore_change", "trace_change"]
