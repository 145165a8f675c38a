"""Bitwise 64-bit signatures of tensors: equal bytes, dtype and shape <=> equal signature.

A signature is 16 hex characters: BLAKE2b (8-byte digest) over a header naming the dtype and
shape, followed by the tensor's contiguous bytes on the host. Any change to a single bit of the
data, to the dtype or to the shape changes it (up to a 2**-64 collision chance). Works for every
dense dtype, bfloat16, bool and the float8 types included, because the bytes are read through a
`uint8` view rather than converted to NumPy's dtype. A DTensor is signed by its local shard.

Cost: one host copy of device tensors and one hash pass (about a gigabyte a second a core), so
sign sampled layers and bounded slices, not a whole large model every step.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Optional

import torch

SIGNATURE_BYTES = 8


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat, contiguous uint8 CPU tensor (a view when already so)."""
    if t.layout != torch.strided:
        raise TypeError(f"only dense (strided) tensors can be signed, got layout {t.layout}")
    to_local = getattr(t, "to_local", None)
    if to_local is not None and type(t).__name__ == "DTensor":
        t = to_local()
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    flat = t.reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    # view(uint8) on a 1-D contiguous tensor expands each element into its bytes (no copy).
    return flat.contiguous().view(torch.uint8)


def _header(t: torch.Tensor) -> bytes:
    return f"{str(t.dtype).removeprefix('torch.')}|{tuple(int(d) for d in t.shape)}|".encode("ascii")


def tensor_signature(t: torch.Tensor) -> str:
    """A bitwise 64-bit signature (16 hex chars) of `t`'s bytes, dtype and shape."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor_signature needs a torch.Tensor, got {type(t).__name__}")
    data = _host_bytes(t)
    h = hashlib.blake2b(digest_size=SIGNATURE_BYTES)
    h.update(_header(t))
    if data.numel():
        h.update(memoryview(data.numpy()))
    return h.hexdigest()


def structure_signature(tensors: Iterable[Optional[torch.Tensor]]) -> str:
    """One signature of an ordered collection of tensors (None entries allowed and counted).

    Order matters: the same tensors in a different order sign differently."""
    h = hashlib.blake2b(digest_size=SIGNATURE_BYTES)
    count = 0
    for t in tensors:
        h.update(b"none;" if t is None else tensor_signature(t).encode("ascii") + b";")
        count += 1
    h.update(f"#{count}".encode("ascii"))
    return h.hexdigest()
