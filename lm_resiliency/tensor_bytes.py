"""A contiguous CPU tensor's memory as Python buffers, without numpy (torch does not require it,
so `Tensor.numpy()` fails on installs without it)."""

from __future__ import annotations

import ctypes
from typing import Iterator

import torch

WINDOW_BYTES = 1 << 24  # memory is handed out in windows of at most 16 MiB


def _checked(t: torch.Tensor) -> int:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"needs a contiguous CPU tensor, got one on {t.device} "
                         f"({'contiguous' if t.is_contiguous() else 'strided'})")
    return t.numel() * t.element_size()


def byte_windows(t: torch.Tensor) -> Iterator[memoryview]:
    """`t`'s bytes in order, as memoryviews over its own memory (no copy). Use each window before
    dropping `t`.

    ctypes keeps every array type it creates, one per length, for the life of the process, so the
    windows have power-of-two lengths up to WINDOW_BYTES: at most 25 types ever, whatever the
    tensor sizes."""
    n = _checked(t)
    address, offset = t.data_ptr(), 0
    while offset < n:
        size = min(WINDOW_BYTES, 1 << ((n - offset).bit_length() - 1))
        yield memoryview((ctypes.c_ubyte * size).from_address(address + offset))
        offset += size


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A copy of `t`'s bytes."""
    n = _checked(t)
    return ctypes.string_at(t.data_ptr(), n) if n else b""
