"""The one CRC-32: zlib's values whichever implementation runs, so files written with one read with
the other; ISA-L's when `isal` is installed (a dependency where it ships wheels), zlib otherwise."""

import importlib.util
import subprocess
import sys
import zlib

import pytest
import torch

from lm_resiliency import checksum
from lm_resiliency.gemini.integrity import CRC_KEY, capture_checksums, checksum_problem


@pytest.mark.parametrize("n", [0, 1, 3, 63, 64, 65, 4097, 1 << 20, (1 << 24) + 13])
def test_values_are_zlibs_for_every_length_and_start(n):
    data = torch.randint(0, 256, (n + 7,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    raw = bytes(data.tolist()) if n < 5000 else data.numpy().tobytes()
    for start in (0, 1, 7):  # unaligned starts and storage offsets
        view = data[start: start + n]
        expected = zlib.crc32(raw[start: start + n])
        assert checksum.tensor_crc32(view) == expected
        assert checksum.crc32(raw[start: start + n]) == expected
        assert checksum.tensor_crc32(view, 0xDEADBEEF) == zlib.crc32(raw[start: start + n], 0xDEADBEEF)


@pytest.mark.skipif(importlib.util.find_spec("isal") is None, reason="isal is not installed here")
def test_isal_is_used_where_it_is_installed():
    assert checksum.BACKEND == "isal" and "ISA-L" in checksum.backend_notice()


_FALLBACK = r"""
import sys
sys.modules["isal"] = None  # as on a platform without an isal wheel
import torch, zlib
from lm_resiliency import checksum
from lm_resiliency.gemini.integrity import capture_checksums
assert checksum.BACKEND == "zlib" and "not installed" in checksum.backend_notice()
data = torch.arange(100_003, dtype=torch.int64).view(torch.uint8)
print(capture_checksums(data)["crc32"][0], checksum.tensor_crc32(data[5:]), checksum.crc32(b"abc"))
"""


def test_fallback_without_isal_gives_identical_values():
    done = subprocess.run([sys.executable, "-c", _FALLBACK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    data = torch.arange(100_003, dtype=torch.int64).view(torch.uint8)
    here = [capture_checksums(data)["crc32"][0], checksum.tensor_crc32(data[5:]), checksum.crc32(b"abc")]
    assert done.stdout.split() == [str(v) for v in here]
    # A capture record made by either implementation verifies under the other.
    assert checksum_problem({CRC_KEY: capture_checksums(data)}, data) is None
