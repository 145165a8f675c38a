"""Compute and communication straggler detection from per-round timings (pure logic).

Both detectors are fed one *round* of timings at a time and return `StragglerFinding`s. They
do no communication: a caller gathers the timings (for example with `wire.all_gather_json`)
and runs the same detector on every rank, so every rank reaches the same verdict from the same
numbers. A finding is `confirmed` only after its rank was flagged in
`ReplayHarnessConfig.straggler_confirmation_rounds` consecutive rounds; earlier (or ambiguous)
findings come back with `confirmed=False` and are never turned into fault reports by
`replay_fault_reports`.

Compute (`ComputeStragglerDetector`), within one equivalent-peer group, flags a rank whose time
is above the group median by *all* of:

- the ratio `straggler_min_ratio` (time > ratio * median),
- the margin `straggler_min_margin_s` (time - median > margin), and
- a robust outlier test, time > median + k * max(1.4826 * MAD, floor), where the floor
  (`scale_floor_fraction` * median) keeps a perfectly flat group from flagging tiny deviations.

Each rank also keeps a temporal baseline (an EWMA of its own *healthy* timings), reported in
the evidence together with the current time, so a rank that became slow (`onset="became_slow"`)
is told apart from one that was slow whenever it was seen (`onset="always_slow"`).

Communication (`CommunicationStragglerLocalizer`) takes one latency per process group
(cross-PG localization). A group is slow when its latency is above the round's reference by
both the ratio and the margin. The reference is the median of the *faster half* of the
groups, not the plain median: one bad rank sits in 2/n of all pairs (half of them for n=4),
which would drag a plain median up to the slow value. The endpoint is the intersection of all
slow groups' members; when that leaves several ranks, ranks that also appear in a fast group
are dropped if that leaves any. A single endpoint whose supporting (slow) groups outnumber its
contradicting (fast) groups is a suspect for the round. Everything else is *ambiguous* and is
never confirmed:

- an empty intersection (slow groups share no rank: several stragglers or a fabric-wide
  slowdown),
- several ranks left (e.g. one slow pair {0, 1} in which both also sit in fast groups: a
  slow *link* between them, or not enough groups to tell), or
- a single rank contradicted by at least as many fast groups as slow ones.

Ambiguous rounds return one unconfirmed finding listing the candidate ranks with
`evidence["localized"] = False` and `evidence["reason"]`; they also break every streak.

What a finding says about a rank. A confirmed finding is SCOUT's verdict: the same measure
flagged that rank in `straggler_confirmation_rounds` consecutive rounds. An unconfirmed finding
is one measure's evidence so far, not a verdict: it may name a healthy rank (one round of noise
in one measure, e.g. a replay timed while its host was busy), and it always says so:
`confirmed=False`, `evidence["rounds"]` below `evidence["required_rounds"]` (0 for an ambiguous
round) and `evidence["measure"]`, the detector that flagged it. Nothing acts on it: it makes no
result unhealthy, no fault report, no callback and no trust verdict, and it confirms nothing on
its own; a rank flagged by one measure builds no streak in another.
More than one simultaneous communication straggler is not localized (the faster-half
reference and the intersection both assume one); compare groups of similar size and payload.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.reports import StragglerFinding

logger = logging.getLogger(__name__)

COMPUTE = "compute"
COMMUNICATION = "communication"

_MAD_TO_SIGMA = 1.4826
_MIN_PEERS = 3   # a median needs a majority to be a reference
_TINY_S = 1e-9   # slowdown denominator floor: keeps slowdown finite (JSON-ready) for 0 s medians


def _check_config(config: ReplayHarnessConfig) -> None:
    if not isinstance(config, ReplayHarnessConfig):
        raise TypeError(f"config must be a ReplayHarnessConfig, got {type(config).__name__}")


def _check_rank(rank: Any, what: str) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"{what}: ranks must be non-negative ints, got {rank!r}")
    return rank


def _check_seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what}: timings must be finite numbers of seconds >= 0, got {value!r}")
    return float(value)


def _check_measure(measure: Any) -> str:
    if not isinstance(measure, str) or not measure:
        raise ValueError(f"measure must be a non-empty str naming what is timed, got {measure!r}")
    return measure


def _check_hosts(hosts: Optional[Mapping[int, str]]) -> Dict[int, str]:
    out: Dict[int, str] = {}
    for rank, host in dict(hosts or {}).items():
        _check_rank(rank, "hosts")
        if not isinstance(host, str):
            raise ValueError(f"hosts: host of rank {rank} must be a str, got {host!r}")
        out[rank] = host
    return out


def _persistence(rounds: int) -> float:
    """0.5 after one round, 0.75 after two, ... -> 1."""
    return 1.0 - 0.5 ** max(rounds, 0)


def _check_tuning(outlier_k: float, scale_floor_fraction: float, baseline_alpha: float) -> None:
    if isinstance(outlier_k, bool) or not isinstance(outlier_k, (int, float)) or not math.isfinite(outlier_k) \
            or outlier_k < 0:
        raise ValueError(f"outlier_k must be a finite number >= 0, got {outlier_k!r}")
    if isinstance(scale_floor_fraction, bool) or not isinstance(scale_floor_fraction, (int, float)) \
            or not math.isfinite(scale_floor_fraction) or scale_floor_fraction < 0:
        raise ValueError(f"scale_floor_fraction must be a finite number >= 0, got {scale_floor_fraction!r}")
    if isinstance(baseline_alpha, bool) or not isinstance(baseline_alpha, (int, float)) \
            or not 0 < baseline_alpha <= 1:
        raise ValueError(f"baseline_alpha must be in (0, 1], got {baseline_alpha!r}")


class _Baselines:
    """Per-key EWMA of healthy observations."""

    def __init__(self, alpha: float) -> None:
        self._alpha = alpha
        self._values: Dict[Any, float] = {}
        self._counts: Dict[Any, int] = {}

    def get(self, key: Any) -> Optional[float]:
        return self._values.get(key)

    def count(self, key: Any) -> int:
        return self._counts.get(key, 0)

    def update(self, key: Any, value: float) -> None:
        old = self._values.get(key)
        self._values[key] = value if old is None else old + self._alpha * (value - old)
        self._counts[key] = self._counts.get(key, 0) + 1

    def clear(self) -> None:
        self._values.clear()
        self._counts.clear()


class ComputeStragglerDetector:
    """Confirms compute stragglers in one equivalent-peer group from per-round timings.

    `group_ranks` are the global ranks of the group; `hosts` maps rank -> host name (missing
    hosts are reported as ""). Call `observe({rank: seconds, ...})` once per round with the
    same replay/compute work timed on every peer. A round with fewer than 3 timings has no
    majority to compare against: it flags nothing and breaks every streak. A rank absent from
    a round loses its streak.

    Tuning (keyword-only): `outlier_k` (robust z threshold, default 3), `scale_floor_fraction`
    (floor on the robust scale as a fraction of the median, default 0.05) and `baseline_alpha`
    (EWMA weight of the per-rank healthy baseline, default 0.2). `measure` names what the timings
    are (`evidence["measure"]` of every finding; default "replay_compute", the replay timings).
    """

    def __init__(self, config: ReplayHarnessConfig, group_ranks: Iterable[int],
                 hosts: Optional[Mapping[int, str]] = None, *, outlier_k: float = 3.0,
                 scale_floor_fraction: float = 0.05, baseline_alpha: float = 0.2,
                 measure: str = "replay_compute") -> None:
        _check_config(config)
        _check_tuning(outlier_k, scale_floor_fraction, baseline_alpha)
        self.measure = _check_measure(measure)
        ranks = tuple(_check_rank(r, "group_ranks") for r in group_ranks)
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"group_ranks must be a non-empty list of distinct ranks, got {list(ranks)}")
        self.config = config
        self.group_ranks: Tuple[int, ...] = ranks
        self.hosts = _check_hosts(hosts)
        self.outlier_k = float(outlier_k)
        self.scale_floor_fraction = float(scale_floor_fraction)
        self._baselines = _Baselines(float(baseline_alpha))
        self._streaks: Dict[int, int] = {}
        self.rounds_observed = 0

    def streak(self, rank: int) -> int:
        """Consecutive rounds (ending with the last one) in which `rank` was a suspect."""
        return self._streaks.get(rank, 0)

    def baseline(self, rank: int) -> Optional[float]:
        """EWMA of `rank`'s healthy timings, or None if it was never seen healthy."""
        return self._baselines.get(rank)

    def reset(self) -> None:
        """Forget streaks and baselines (e.g. after a restart or a topology change)."""
        self._streaks.clear()
        self._baselines.clear()
        self.rounds_observed = 0

    def observe(self, timings: Mapping[int, float]) -> List[StragglerFinding]:
        """Judge one round; returns this round's suspects (confirmed or not), by rank."""
        members = set(self.group_ranks)
        clean: Dict[int, float] = {}
        for rank, seconds in dict(timings).items():
            _check_rank(rank, "timings")
            if rank not in members:
                raise ValueError(f"timings: rank {rank} is not in this group {list(self.group_ranks)}")
            clean[rank] = _check_seconds(seconds, f"timings[{rank}]")
        self.rounds_observed += 1
        for rank in members - clean.keys():
            self._streaks.pop(rank, None)
        if len(clean) < _MIN_PEERS:
            logger.debug("compute round with %d timing(s) in group %s: not judged", len(clean), self.group_ranks)
            self._streaks.clear()
            return []

        values = list(clean.values())
        median = statistics.median(values)
        mad = statistics.median(abs(v - median) for v in values)
        scale = max(_MAD_TO_SIGMA * mad, self.scale_floor_fraction * median)
        ratio, margin = self.config.straggler_min_ratio, self.config.straggler_min_margin_s
        threshold = max(median * ratio, median + margin, median + self.outlier_k * scale)

        findings = []
        for rank in sorted(clean):
            seconds = clean[rank]
            suspect = (seconds > median * ratio and seconds - median > margin
                       and seconds > median + self.outlier_k * scale)
            if not suspect:
                self._streaks.pop(rank, None)
                self._baselines.update(rank, seconds)
                continue
            streak = self._streaks.get(rank, 0) + 1
            self._streaks[rank] = streak
            findings.append(self._finding(rank, seconds, median, mad, scale, threshold, streak))
        return findings

    def _finding(self, rank: int, seconds: float, median: float, mad: float, scale: float, threshold: float,
                 streak: int) -> StragglerFinding:
        ratio = self.config.straggler_min_ratio
        slowdown = seconds / max(median, _TINY_S)
        baseline = self._baselines.get(rank)
        became_slow = baseline is not None and baseline > 0 and seconds > ratio * baseline
        severity = 1.0 - math.exp(-(slowdown - 1.0) / (ratio - 1.0))
        confirmed = streak >= self.config.straggler_confirmation_rounds
        evidence: Dict[str, Any] = {
            "group_ranks": list(self.group_ranks),
            "current_s": seconds,
            "group_median_s": median,
            "group_mad_s": mad,
            "robust_scale_s": scale,
            "threshold_s": threshold,
            "baseline_s": baseline,
            "baseline_rounds": self._baselines.count(rank),
            "baseline_ratio": (seconds / baseline) if baseline else None,
            "onset": "became_slow" if became_slow else "always_slow",
            "rounds": streak,
            "required_rounds": self.config.straggler_confirmation_rounds,
            "measure": self.measure,
        }
        if confirmed:
            logger.info("compute straggler confirmed: rank %d (%s) %.4fs vs median %.4fs over %d rounds",
                        rank, self.hosts.get(rank, ""), seconds, median, streak)
        return StragglerFinding(
            kind=COMPUTE, ranks=(rank,), hosts=(self.hosts.get(rank, ""),),
            slowdown=slowdown,
            confirmed=confirmed, confidence=round(max(0.0, min(1.0, severity * _persistence(streak))), 6),
            evidence=evidence)


def _group_key(key: Any) -> Tuple[int, ...]:
    if not isinstance(key, (tuple, list)):
        raise ValueError(f"group_timings: keys must be tuples of ranks, got {key!r}")
    ranks = tuple(_check_rank(r, "group_timings") for r in key)
    if len(ranks) < 2 or len(set(ranks)) != len(ranks):
        raise ValueError(f"group_timings: a group needs >= 2 distinct ranks, got {list(ranks)}")
    return ranks


def faster_half_median(values: Sequence[float]) -> float:
    """Median of the ceil(n/2) smallest values: a reference that survives up to half slow."""
    ordered = sorted(values)
    return statistics.median(ordered[: (len(ordered) + 1) // 2])


class CommunicationStragglerLocalizer:
    """Cross-PG localization of a communication straggler from per-group collective latencies.

    Call `observe({(r0, r1, ...): seconds, ...})` once per round with one latency per process
    group (see `probes.CollectiveProbe.measure`). Returns at most one finding per round: the
    endpoint rank (confirmed after `straggler_confirmation_rounds` consecutive rounds naming
    the same rank), or an unconfirmed ambiguous finding (see the module doc). Fewer than 2
    groups in a round cannot be localized: nothing is returned and streaks break.
    `baseline_alpha` weights the per-group EWMA of healthy latencies reported in the evidence;
    `measure` names the latencies (`evidence["measure"]`; default "collective_probe").
    """

    def __init__(self, config: ReplayHarnessConfig, hosts: Optional[Mapping[int, str]] = None, *,
                 baseline_alpha: float = 0.2, measure: str = "collective_probe") -> None:
        _check_config(config)
        _check_tuning(0.0, 0.0, baseline_alpha)
        self.measure = _check_measure(measure)
        self.config = config
        self.hosts = _check_hosts(hosts)
        self._baselines = _Baselines(float(baseline_alpha))
        self._streak_rank: Optional[int] = None
        self._streak = 0
        self.rounds_observed = 0

    def streak(self, rank: int) -> int:
        """Consecutive rounds (ending with the last one) that localized `rank`."""
        return self._streak if rank == self._streak_rank else 0

    def group_baseline(self, group: Sequence[int]) -> Optional[float]:
        """EWMA of a group's latency over the rounds in which it was not slow."""
        return self._baselines.get(tuple(group))

    def reset(self) -> None:
        self._streak_rank, self._streak = None, 0
        self._baselines.clear()
        self.rounds_observed = 0

    def _break(self) -> None:
        self._streak_rank, self._streak = None, 0

    def observe(self, group_timings: Mapping[Tuple[int, ...], float]) -> List[StragglerFinding]:
        latencies: Dict[Tuple[int, ...], float] = {}
        seen = set()
        for key, seconds in dict(group_timings).items():
            group = _group_key(key)
            if frozenset(group) in seen:
                raise ValueError(f"group_timings: group {sorted(group)} appears twice")
            seen.add(frozenset(group))
            latencies[group] = _check_seconds(seconds, f"group_timings[{list(group)}]")
        self.rounds_observed += 1
        if len(latencies) < 2:
            self._break()
            return []

        ratio, margin = self.config.straggler_min_ratio, self.config.straggler_min_margin_s
        reference = faster_half_median(list(latencies.values()))
        threshold = max(reference * ratio, reference + margin)
        slow = [g for g, t in latencies.items() if t > reference * ratio and t - reference > margin]
        fast = [g for g in latencies if g not in slow]
        baselines_before = {g: self._baselines.get(g) for g in latencies}
        for group in fast:
            self._baselines.update(group, latencies[group])
        if not slow:
            self._break()
            return []

        intersection = set(slow[0]).intersection(*map(set, slow[1:]))
        candidates = set(intersection)
        if len(candidates) > 1:
            in_fast = set().union(*map(set, fast)) if fast else set()
            refined = candidates - in_fast
            if refined:
                candidates = refined

        def doc(groups: List[Tuple[int, ...]]) -> List[Dict[str, Any]]:
            return [{"ranks": list(g), "latency_s": latencies[g], "baseline_s": baselines_before[g]}
                    for g in groups]

        evidence: Dict[str, Any] = {
            "reference_latency_s": reference,
            "threshold_s": threshold,
            "slow_groups": doc(slow),
            "fast_groups": doc(fast),
            "intersection": sorted(intersection),
            "required_rounds": self.config.straggler_confirmation_rounds,
            "measure": self.measure,
        }
        slow_median = statistics.median(latencies[g] for g in slow)
        slowdown = slow_median / max(reference, _TINY_S)

        reason = None
        if not candidates:
            reason = "empty_intersection"
        elif len(candidates) > 1:
            reason = "several_candidates"
        else:
            (rank,) = candidates
            supporting = [g for g in slow if rank in g]
            contradicting = [g for g in fast if rank in g]
            if len(supporting) <= len(contradicting):
                reason = "contradicted"
        if reason is not None:
            self._break()
            shown = sorted(candidates) if candidates else sorted(set().union(*map(set, slow)))
            evidence.update(localized=False, reason=reason, candidates=sorted(candidates), rounds=0)
            if reason == "contradicted":
                evidence.update(supporting_groups=doc(supporting), contradicting_groups=doc(contradicting))
            logger.debug("communication round ambiguous (%s): slow groups %s", reason, slow)
            return [StragglerFinding(
                kind=COMMUNICATION, ranks=tuple(shown), hosts=tuple(self.hosts.get(r, "") for r in shown),
                slowdown=slowdown, confirmed=False, confidence=0.0, evidence=evidence)]

        if self._streak_rank == rank:
            self._streak += 1
        else:
            self._streak_rank, self._streak = rank, 1
        streak = self._streak
        confirmed = streak >= self.config.straggler_confirmation_rounds
        agreement = len(supporting) / (len(supporting) + len(contradicting))
        evidence.update(localized=True, endpoint_rank=rank, endpoint_host=self.hosts.get(rank, ""),
                        candidates=[rank], supporting_groups=doc(supporting),
                        contradicting_groups=doc(contradicting), rounds=streak)
        if confirmed:
            logger.info("communication straggler confirmed: rank %d (%s), %d slow / %d fast groups, %d rounds",
                        rank, self.hosts.get(rank, ""), len(supporting), len(contradicting), streak)
        return [StragglerFinding(
            kind=COMMUNICATION, ranks=(rank,), hosts=(self.hosts.get(rank, ""),), slowdown=slowdown,
            confirmed=confirmed, confidence=round(agreement * _persistence(streak), 6), evidence=evidence)]
