"""Replication chunk sizing from measured training communication slack."""

from __future__ import annotations

import math

from lm_resiliency.config import MAX_CHUNK_BYTES

_MIB = 1024 * 1024


def estimate_chunk_size(
    nic_bandwidth_gbps: float,
    layer_compute_ms: float,
    ag_time_ms: float,
    max_ag_delay_fraction: float,
) -> int:
    """Largest replication chunk (bytes, a whole number of MiB) that keeps prefetch hidden.

    FSDP prefetches the next layer's all-gather while the current layer computes, so the
    all-gather has ``layer_compute_ms - ag_time_ms`` of slack. A replication chunk queued
    ahead of it on the NIC delays it by ``chunk / bandwidth``. The bound allows that delay
    to be at most ``max_ag_delay_fraction`` of the layer's compute time and never more than
    the slack itself, within 1 MiB to 1 GiB (`replication_chunk_size` accepts at most 1 GiB).
    This is arithmetic on the numbers you measured, not a network probe.
    """
    for name, value in (("nic_bandwidth_gbps", nic_bandwidth_gbps),
                        ("layer_compute_ms", layer_compute_ms),
                        ("ag_time_ms", ag_time_ms)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                or value <= 0:
            raise ValueError(f"estimate_chunk_size: {name} must be a positive number, got {value!r}")
    if not (isinstance(max_ag_delay_fraction, (int, float)) and not isinstance(max_ag_delay_fraction, bool)
            and 0 < max_ag_delay_fraction <= 1):
        raise ValueError("estimate_chunk_size: max_ag_delay_fraction must be in (0, 1], "
                         f"got {max_ag_delay_fraction!r}")
    slack_ms = layer_compute_ms - ag_time_ms
    if slack_ms <= 0:
        raise ValueError(
            f"estimate_chunk_size: ag_time_ms ({ag_time_ms}) >= layer_compute_ms ({layer_compute_ms}); "
            "the all-gather is already exposed, so no replication chunk can be hidden. "
            "Measure again or pick replication_chunk_size by hand.")
    budget_ms = min(max_ag_delay_fraction * layer_compute_ms, slack_ms)
    bytes_per_ms = nic_bandwidth_gbps * 1e9 / 8 / 1e3
    chunk = int(bytes_per_ms * budget_ms) // _MIB * _MIB
    return min(max(chunk, _MIB), MAX_CHUNK_BYTES)
