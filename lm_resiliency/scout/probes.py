"""Timing probes: collective latency per process group (for cross-PG localization) and compute time.

    probe = CollectiveProbe(default_probe_groups(dist.get_world_size()))
    localizer = CommunicationStragglerLocalizer(config, hosts)
    findings = localizer.observe(probe.measure())      # same numbers, same verdict, every rank
    probe.close()

`CollectiveProbe` measures over gloo subgroups on the host network, whatever backend the
training world uses. It creates its subgroups with `dist.new_group` at construction, which is
collective over the whole world: every rank must construct the probe with the same groups in
the same order, members or not. `measure()` is collective over the gather group (the world by
default): every rank of it calls `measure()` the same number of times.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lm_resiliency._values import is_int
from lm_resiliency import wire

logger = logging.getLogger(__name__)

_PAIRWISE_MAX_WORLD = 8


def default_probe_groups(world_size: int, *, pairwise_max_world: int = _PAIRWISE_MAX_WORLD) -> List[List[int]]:
    """Overlapping groups whose intersections single out one rank.

    Up to `pairwise_max_world` ranks: every pair (each rank sits in world_size - 1 groups, so a
    slow rank has world_size - 1 supporting groups). Beyond: the rows and columns of a
    near-square grid (rank r at row r // c, column r % c, c = ceil(sqrt(world_size))); a slow
    rank makes its row and its column slow and nothing else. Groups of one rank are dropped.
    A world of 2 has one group only, which cannot tell which end is slow (always ambiguous);
    a world of 1 has none.
    """
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if world_size <= pairwise_max_world:
        return [[a, b] for a in range(world_size) for b in range(a + 1, world_size)]
    cols = math.ceil(math.sqrt(world_size))
    rows = [list(range(start, min(start + cols, world_size))) for start in range(0, world_size, cols)]
    columns = [list(range(c, world_size, cols)) for c in range(cols)]
    return [g for g in rows + columns if len(g) >= 2]


def time_compute(fn: Callable[[], Any], *, repeat: int = 1,
                 synchronize: Optional[Callable[[], None]] = None) -> float:
    """Seconds `fn()` takes (perf_counter); the median of `repeat` runs.

    Pass `synchronize=torch.cuda.synchronize` (or an equivalent) when `fn` launches
    asynchronous device work: it runs before starting and before stopping the clock.
    """
    if not is_int(repeat) or repeat < 1:
        raise ValueError(f"repeat must be a positive int, got {repeat!r}")
    samples = []
    for _ in range(repeat):
        if synchronize is not None:
            synchronize()
        start = time.perf_counter()
        fn()
        if synchronize is not None:
            synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class CollectiveProbe:
    """Per-group all_reduce latency, agreed by every rank.

    `groups`: lists of global ranks (>= 2 distinct ranks each, no duplicate groups). One gloo
    subgroup is created per list. `measure()` runs, in each group this rank belongs to (in the
    given order, so overlapping groups cannot deadlock), an untimed barrier and `warmup`
    all_reduces, then `rounds` timed all_reduces of `payload_bytes`; a member's latency is the
    median of its rounds and a group's latency is the max over its members. Each wait is
    bounded by `timeout_s`. `gather_group` (default: the world) must contain every member of
    every group.
    """

    def __init__(self, groups: Sequence[Sequence[int]], *, payload_bytes: int = 64 * 1024, rounds: int = 5,
                 warmup: int = 1, timeout_s: float = 60.0,
                 gather_group: Optional[dist.ProcessGroup] = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("CollectiveProbe needs an initialized torch.distributed process group")
        for name, value, low in (("payload_bytes", payload_bytes, 1), ("rounds", rounds, 1), ("warmup", warmup, 0)):
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
                or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        world = dist.get_world_size()
        normalized: List[Tuple[int, ...]] = []
        for ranks in groups:
            ranks = list(ranks)
            if (len(ranks) < 2 or len(set(ranks)) != len(ranks)
                    or any(not is_int(r) or not 0 <= r < world for r in ranks)):
                raise ValueError(f"groups: each group needs >= 2 distinct ranks in [0, {world}), got {ranks}")
            key = tuple(sorted(ranks))
            if key in normalized:
                raise ValueError(f"groups: group {list(key)} appears twice")
            normalized.append(key)
        self.payload_bytes = payload_bytes
        self.rounds = rounds
        self.warmup = warmup
        self.timeout_s = float(timeout_s)
        self._gather_group = gather_group
        self._rank = dist.get_rank()
        self._groups: Tuple[Tuple[int, ...], ...] = tuple(normalized)
        self._handles: List[Any] = [wire.new_group(g, self.timeout_s, "SCOUT's collective probe group")
                                    for g in self._groups]
        self._closed = False

    @property
    def groups(self) -> Tuple[Tuple[int, ...], ...]:
        """The probed groups, each as a sorted tuple of global ranks (the keys of `measure()`)."""
        return self._groups

    def measure(self) -> Dict[Tuple[int, ...], float]:
        """{group: seconds} for every group, identical on every rank. Collective."""
        if self._closed:
            raise RuntimeError("CollectiveProbe.measure() after close()")
        local = []
        for index, (ranks, handle) in enumerate(zip(self._groups, self._handles)):
            if self._rank in ranks:
                local.append([index, self._measure_group(handle)])
        reports = wire.all_gather_json(local, group=self._gather_group)
        per_group: Dict[int, List[float]] = {}
        for report in reports:
            for index, seconds in report:
                per_group.setdefault(int(index), []).append(float(seconds))
        result = {}
        for index, ranks in enumerate(self._groups):
            samples = per_group.get(index, [])
            if len(samples) != len(ranks):
                raise RuntimeError(f"CollectiveProbe: group {list(ranks)} got {len(samples)} member latencies, "
                                   f"expected {len(ranks)}: is every member in the gather group?")
            result[ranks] = max(samples)
        logger.debug("collective probe latencies: %s", result)
        return result

    def _measure_group(self, handle: Any) -> float:
        tensor = torch.zeros(max(1, self.payload_bytes // 4), dtype=torch.float32)
        wire.wait(dist.barrier(group=handle, async_op=True), self.timeout_s)
        for _ in range(self.warmup):
            wire.wait(dist.all_reduce(tensor, group=handle, async_op=True), self.timeout_s)
        samples = []
        for _ in range(self.rounds):
            start = time.perf_counter()
            wire.wait(dist.all_reduce(tensor, group=handle, async_op=True), self.timeout_s)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def close(self) -> None:
        """Destroy the subgroups this rank belongs to. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for ranks, handle in zip(self._groups, self._handles):
            if self._rank in ranks and handle is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(handle)
                except Exception:  # teardown must release the rest
                    logger.warning("could not destroy probe group %s", list(ranks), exc_info=True)
        self._handles = []

    def __enter__(self) -> "CollectiveProbe":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
