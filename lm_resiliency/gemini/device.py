"""The one seam between GEMINI and CUDA: host buffer allocation and device-to-host copy launch.

On CPU a capture copies in the background worker. On CUDA the training thread only
enqueues non-blocking copies on a side stream into pinned memory and records an event;
the worker waits on that event. Elsewhere GEMINI touches CUDA only to page-lock and release
shared-memory slots (`shm.py`, cudaHostRegister) and to count local GPUs for the replication
layout (`replication.py`).
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch

logger = logging.getLogger(__name__)


def allocate_host_buffer(nbytes: int, pin_memory: bool) -> torch.Tensor:
    """A flat uint8 host buffer; page-locked when CUDA is present and `pin_memory` is set."""
    pin = pin_memory and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class PendingCopy:
    """Copies launched for one capture. `finish()` runs on the completion worker."""

    def __init__(self, cpu_pairs: list, event: Optional["torch.cuda.Event"]) -> None:
        self._cpu_pairs = cpu_pairs
        self._event = event

    def finish(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        for dst, src in self._cpu_pairs:
            dst.copy_(src)
        self._cpu_pairs = []


_side_streams: dict = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    stream = _side_streams.get(device)
    if stream is None:
        stream = torch.cuda.Stream(device=device)
        _side_streams[device] = stream
    return stream


def launch_copy(destinations: List[torch.Tensor], sources: List[torch.Tensor]) -> PendingCopy:
    """Start copying each source into its host view. CUDA sources are copied asynchronously on a
    side stream that first waits for the producing stream, so the copy sees finished values."""
    cpu_pairs = []
    event = None
    by_device: dict = {}
    for dst, src in zip(destinations, sources):
        if src.is_cuda:
            by_device.setdefault(src.device, []).append((dst, src))
        else:
            cpu_pairs.append((dst, src))
    for device, pairs in by_device.items():
        stream = _side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                # The caller may free `src` (a snapshot clone) before the copy runs: without this
                # the caching allocator could hand its memory to the training stream meanwhile.
                src.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
    if len(by_device) > 1:
        # One event per device would be needed to overlap them; synchronizing is correct and rare.
        for device in by_device:
            _side_stream(device).synchronize()
        event = None
    return PendingCopy(cpu_pairs, event)
