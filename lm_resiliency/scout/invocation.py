"""A module invocation as SCOUT replays it: inputs copied out of training, moved to the module's
device, replayed under the source's autocast regions with the RNG forked and seeded alike on
every peer. Shared by the per-check replay (replay.py) and the full-catalog sweep (sweep.py)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional

import torch
from torch import nn


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`value` (nested tuples, lists and dicts) with `fn` applied to every tensor."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def clone_inputs(value: Any, by_value: bool) -> Any:
    return map_tensors(value, lambda t: t.detach().clone() if by_value else t.detach())


def tensors_in(value: Any) -> List[torch.Tensor]:
    """Every tensor in a (nested) module output, in a deterministic order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if hasattr(value, "__dataclass_fields__"):
        return [t for name in value.__dataclass_fields__ for t in tensors_in(getattr(value, name))]
    return []


def to_device(value: Any, device: torch.device) -> Any:
    """A private copy of every tensor on `device` (the replay may modify its inputs in place)."""
    return map_tensors(value, lambda t: t.to(device, copy=True))


def module_device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def preserved_buffers(module: nn.Module) -> Iterator[None]:
    """Restore every buffer of `module` (running statistics, counters) after a replay, which must
    not change the live model."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


class SeededRng:
    """Fork the CPU RNG (and the module's CUDA device RNG) and seed both; restore on exit."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self._seed = seed
        self._cuda = device.index if device.type == "cuda" else None
        if device.type == "cuda" and self._cuda is None:
            self._cuda = torch.cuda.current_device()
        self._fork = torch.random.fork_rng(devices=[] if self._cuda is None else [self._cuda])

    def __enter__(self) -> None:
        self._fork.__enter__()
        torch.default_generator.manual_seed(self._seed)
        if self._cuda is not None:
            with torch.cuda.device(self._cuda):
                torch.cuda.manual_seed(self._seed)

    def __exit__(self, *exc: Any) -> None:
        self._fork.__exit__(*exc)


def autocast_regions() -> List[List[str]]:
    """The autocast regions active now, as JSON: [[device type, dtype name], ...]."""
    return [[device, str(torch.get_autocast_dtype(device)).removeprefix("torch.")]
            for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)]


class Autocast:
    """Re-enter the autocast regions the source captured under (none: a no-op)."""

    def __init__(self, regions: Optional[List[List[str]]]) -> None:
        self._contexts = []
        for device_type, dtype in regions or []:
            dtype_obj = getattr(torch, dtype, None)
            if isinstance(dtype_obj, torch.dtype):
                self._contexts.append(torch.autocast(device_type, dtype=dtype_obj))

    def __enter__(self) -> None:
        for ctx in self._contexts:
            ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for ctx in reversed(self._contexts):
            ctx.__exit__(*exc)
