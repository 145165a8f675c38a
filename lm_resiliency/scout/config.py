"""ReplayHarnessConfig: SCOUT configuration. Every field is validated; errors name the field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from lm_resiliency._values import MAX_SECONDS, MAX_STEP_INTERVAL, ConfigError, is_int, is_seconds, is_step_interval
from lm_resiliency.scout.alltoall_policy import AllToAllReplayPolicy, BalancedAndPermutationPolicy
from lm_resiliency.scout.moe_workload import ReplayWorkload

# The probe is a third of a check's cost and a slow link is a throughput problem, not a
# correctness one: by default it runs at every 5th check, which keeps its amortized cost a fifth
# of what it was while confirming a slow endpoint within 2 x 5 checks (confirmation rounds x 5).
PROBE_EVERY_CHECKS = 5
# The dense check classes, each with its own `*_check_interval`.
CHECK_CLASSES = ("embedding", "hidden", "output", "optimizer")


def _positive_int_or_none(value: Any) -> bool:
    return value is None or (is_int(value) and value >= 1)


def _steps_or_none(value: Any) -> bool:
    """None (inherit), 0 (off) or a positive number of optimizer steps."""
    return value is None or (is_int(value) and value >= 0)


@dataclass(frozen=True)
class ReplayHarnessConfig:
    """SCOUT replay, straggler and out-of-band monitor settings (see docs/scout.md).

    `check_interval` is the base cadence in optimizer steps; each `*_check_interval` left at
    None inherits it. The top-level `enable_resiliency(interval=...)` overrides a positive base.
    0 switches replay off: ``check_interval=0`` turns periodic replay off (every check class
    left at None, the workload and AllToAll replay; the out-of-band hang and stall monitor stays
    on, and a class given its own positive interval still runs), ``output_check_interval=0``
    (or any other class at 0) turns that one check class off. The top-level `interval` never
    turns replay back on.
    `communication_probe_interval` is the cadence of the collective straggler probe, which runs
    at a check step that is a multiple of it; None means PROBE_EVERY_CHECKS x `check_interval`,
    0 turns it off.
    """

    check_interval: int = 10
    rotate_layers: bool = True
    embedding_check_interval: Optional[int] = None
    hidden_check_interval: Optional[int] = None
    output_check_interval: Optional[int] = None
    optimizer_check_interval: Optional[int] = None
    optimizer_check_max_elements: int = 4096
    straggler_confirmation_rounds: int = 2
    straggler_min_ratio: float = 1.5
    straggler_min_margin_s: float = 0.005
    communication_probe_interval: Optional[int] = None
    hang_stall_threshold_s: float = 300.0
    dataloader_stall_threshold_s: float = 120.0
    checkpoint_io_stall_threshold_s: float = 600.0
    monitor_poll_interval_s: float = 1.0
    full_sweep_timeout_s: float = 120.0
    capture_inputs_by_value: bool = True
    reference_max_bytes: int = 1 << 30
    seed: int = 0
    # MoE / custom workload replay (scout/moe_replay.py) and AllToAll replay (scout/alltoall.py).
    workload: Optional[ReplayWorkload] = None
    all_to_all_policy: Optional[AllToAllReplayPolicy] = dataclasses.field(
        default_factory=BalancedAndPermutationPolicy)

    def __post_init__(self) -> None:
        name = type(self).__name__

        def require(ok: bool, field: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"{name}.{field}: {message}, got {getattr(self, field)!r}")

        require(is_int(self.check_interval) and (self.check_interval == 0 or is_step_interval(self.check_interval)),
                "check_interval", "must be a non-negative integer number of optimizer steps (0: periodic replay "
                f"off), at most {MAX_STEP_INTERVAL}")
        for field in ("embedding_check_interval", "hidden_check_interval", "output_check_interval",
                      "optimizer_check_interval", "communication_probe_interval"):
            value = getattr(self, field)
            require(value is None or value == 0 and is_int(value) or is_step_interval(value), field,
                    "must be None (inherit check_interval), 0 (off) or a positive integer, at most "
                    f"{MAX_STEP_INTERVAL}")
        for field in ("rotate_layers", "capture_inputs_by_value"):
            require(isinstance(getattr(self, field), bool), field, "must be True or False")
        require(_positive_int_or_none(self.optimizer_check_max_elements), "optimizer_check_max_elements",
                "must be a positive integer")
        require(_positive_int_or_none(self.straggler_confirmation_rounds), "straggler_confirmation_rounds",
                "must be a positive integer")
        ratio = self.straggler_min_ratio
        require(isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 1 < ratio < float("inf"),
                "straggler_min_ratio", "must be a finite number > 1")
        require(is_seconds(self.straggler_min_margin_s, allow_zero=True), "straggler_min_margin_s",
                f"must be a finite number >= 0, at most {MAX_SECONDS:g}")
        for field in ("hang_stall_threshold_s", "dataloader_stall_threshold_s", "checkpoint_io_stall_threshold_s",
                      "monitor_poll_interval_s", "full_sweep_timeout_s"):
            require(is_seconds(getattr(self, field)), field,
                    f"must be a positive, finite number of seconds, at most {MAX_SECONDS:g}")
        require(is_int(self.reference_max_bytes) and self.reference_max_bytes >= 0, "reference_max_bytes",
                "must be a non-negative integer number of bytes (0: no reference replays)")
        require(is_int(self.seed), "seed", "must be an int")
        require(self.workload is None or isinstance(self.workload, ReplayWorkload), "workload",
                "must be None or a ReplayWorkload (ReplayWorkload.from_moe_catalog / from_shapes)")
        require(self.all_to_all_policy is None or isinstance(self.all_to_all_policy, AllToAllReplayPolicy),
                "all_to_all_policy", "must be None (AllToAll replay off) or an AllToAllReplayPolicy")

    def interval_for(self, check: str) -> int:
        """The cadence of one check class: 'embedding', 'hidden', 'output' or 'optimizer' (0: off)."""
        specific = getattr(self, f"{check}_check_interval")
        return specific if specific is not None else self.check_interval

    def due(self, check: str, step: int) -> bool:
        """Whether check class `check` is scheduled at optimizer step `step`."""
        interval = self.interval_for(check)
        return interval > 0 and step % interval == 0

    @property
    def replay_enabled(self) -> bool:
        """Some replay runs periodically: a check class, or the workload's base cadence."""
        return self.check_interval > 0 or any(self.interval_for(c) > 0 for c in CHECK_CLASSES)

    @property
    def round_interval(self) -> int:
        """The cadence that numbers replay rounds (AllToAll matrices): `check_interval`, or with
        periodic replay off, the finest class that still runs (0: none does)."""
        if self.check_interval > 0:
            return self.check_interval
        return min((self.interval_for(c) for c in CHECK_CLASSES if self.interval_for(c) > 0), default=0)

    @property
    def probe_interval(self) -> int:
        """The collective probe's cadence in optimizer steps (see `communication_probe_interval`;
        0: off)."""
        if self.communication_probe_interval is not None:
            return self.communication_probe_interval
        return PROBE_EVERY_CHECKS * self.check_interval
