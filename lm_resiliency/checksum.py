"""CRC-32 of bytes and of a CPU tensor's memory: the one implementation every checksum in the
package uses (capture records, shard files, shared-memory sidecars, transfer offers).

The values are zlib's CRC-32 (the IEEE 802.3 polynomial), whichever implementation computes them.
ISA-L's SIMD CRC-32 (the `isal` package, a dependency on the platforms it ships wheels for) is
used when it imports; otherwise `zlib.crc32`. Both give identical values, so a file written with
one is read with the other, and files written before this module existed stay readable.
"""

from __future__ import annotations

import zlib
from typing import Callable, Union

import torch

from lm_resiliency.tensor_bytes import byte_windows

Buffer = Union[bytes, bytearray, memoryview]

_crc32: Callable[[Buffer, int], int]
try:
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # no wheel for this platform: zlib's values, at zlib's speed
    _crc32 = zlib.crc32
    BACKEND = "zlib"
else:
    _crc32 = _isal_crc32
    BACKEND = "isal"


def crc32(data: Buffer, value: int = 0) -> int:
    """`zlib.crc32(data, value)`, computed by the fastest implementation available."""
    return _crc32(data, value)


def tensor_crc32(tensor: torch.Tensor, value: int = 0) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes (no copy), continuing from `value`."""
    for window in byte_windows(tensor):
        value = _crc32(window, value)
    return value


def backend_notice() -> str:
    """One line saying which CRC-32 implementation runs, for logs and benchmark records."""
    if BACKEND == "isal":
        return "CRC-32 by ISA-L (isal)"
    return ("CRC-32 by zlib (the isal package is not installed: same values, several times slower; "
            "`pip install isal` where a wheel exists)")
