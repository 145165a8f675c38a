"""CPU tensor memory without numpy: windows, copies, and the paths that use them on an install
without numpy (torch does not require it)."""

import subprocess
import sys
import zlib

import pytest
import torch

from lm_resiliency import tensor_bytes
from lm_resiliency.tensor_bytes import byte_windows
from lm_resiliency.tensor_bytes import tensor_bytes as copy_bytes


def test_windows_and_copy_hold_every_byte_in_order(monkeypatch):
    monkeypatch.setattr(tensor_bytes, "WINDOW_BYTES", 64)
    gen = torch.Generator().manual_seed(0)
    for n in (0, 1, 63, 64, 65, 64 * 3 + 37):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        raw = bytes(t.tolist())
        windows = list(byte_windows(t))
        assert b"".join(bytes(w) for w in windows) == raw
        assert all(len(w) <= 64 and len(w) & (len(w) - 1) == 0 for w in windows)  # powers of two
        assert copy_bytes(t) == raw
    f = torch.tensor([1.5, -2.0], dtype=torch.float32)
    assert copy_bytes(f) == bytes(f.view(torch.uint8).tolist())
    assert copy_bytes(f[1:]) == bytes(f[1:].view(torch.uint8).tolist())  # storage offset honoured


def test_strided_or_non_cpu_tensors_are_refused():
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        list(byte_windows(torch.zeros(4, 4).t()))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        copy_bytes(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="on meta"):
        copy_bytes(torch.zeros(4, device="meta"))


_WITHOUT_NUMPY = r"""
import sys, zlib
sys.modules["numpy"] = None  # as on an install without numpy: Tensor.numpy() raises
import torch
from lm_resiliency import wire
from lm_resiliency.gemini.shm import _slot_crc
from lm_resiliency.gemini.storage import _shard_crc
from lm_resiliency.scout.signature import tensor_signature
assert wire.decode_json(wire.encode_json({"a": [1, 2]})) == {"a": [1, 2]}
payload = torch.arange(100, dtype=torch.uint8)
meta = b'{"k":1}'
assert _shard_crc({"k": 1}, payload) == zlib.crc32(bytes(range(100)), zlib.crc32(meta))
assert _slot_crc({"k": 1, "crc32": 5}, payload) == zlib.crc32(bytes(range(100)), zlib.crc32(meta))
assert len(tensor_signature(torch.randn(7))) == 16
print("ok")
"""


def test_json_exchange_crcs_and_signatures_work_without_numpy():
    done = subprocess.run([sys.executable, "-c", _WITHOUT_NUMPY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_crc_of_windows_equals_crc_of_the_bytes():
    t = torch.randint(0, 256, (100_003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    crc = 0
    for window in byte_windows(t):
        crc = zlib.crc32(window, crc)
    assert crc == zlib.crc32(bytes(t.tolist()))
