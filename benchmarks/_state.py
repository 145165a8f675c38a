"""Synthetic training state for the GEMINI benchmarks, and the checks on what comes back."""

from __future__ import annotations

import math
import os
import zlib
from typing import Any, Dict


def make_state(rank: int, per_rank_bytes: int, layers: int = 8, fill: bool = True) -> dict:
    """A model + Adam-like optimizer state of ~per_rank_bytes float32 bytes (params are 1/3).
    `fill=False` gives the same structure with uninitialized tensors (a load target)."""
    import torch

    gen = torch.Generator().manual_seed(1234 + rank)
    if not fill:
        def randn(shape, generator):
            return torch.empty(shape)
        rand = randn
    else:
        randn, rand = torch.randn, torch.rand
    per_layer_floats = max(64, per_rank_bytes // 3 // layers // 4)
    d = max(8, int(math.sqrt(per_layer_floats)))
    model: Dict[str, Any] = {}
    opt_state: Dict[str, Any] = {}
    names = []
    for i in range(layers):
        for name, shape in ((f"layers.{i}.weight", (d, d)), (f"layers.{i}.bias", (d,))):
            model[name] = randn(shape, generator=gen)
            opt_state[name] = {
                "step": torch.tensor(7.0),
                "exp_avg": randn(shape, generator=gen),
                "exp_avg_sq": rand(shape, generator=gen),
            }
            names.append(name)
    return {
        "model": model,
        "optimizer": {
            "state": opt_state,
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                              "amsgrad": False, "params": names}],
        },
        "extra": {"step": 7, "epoch": 0, "rng": torch.get_rng_state()},
    }


def leaves(state: Any) -> list:
    import torch

    out = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(state)
    return out


def nbytes_of(tensors: list) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def fingerprint(state: Any) -> list:
    """Order-sensitive description of a state: paths, dtypes, shapes, CRC-32 of tensor bytes."""
    import torch

    out = []

    def walk(v, path):
        if isinstance(v, torch.Tensor):
            raw = v.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            out.append([path, str(v.dtype), list(v.shape), zlib.crc32(memoryview(raw))])
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}.{k}")
        elif isinstance(v, (list, tuple)):
            out.append([path, type(v).__name__, len(v)])
            for i, x in enumerate(v):
                walk(x, f"{path}[{i}]")
        else:
            out.append([path, repr(v)])

    walk(state, "state")
    return out


def drop_page_cache(root: str) -> int:
    """fsync + POSIX_FADV_DONTNEED every file under root (best effort); returns files touched."""
    count = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                count += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    return count
