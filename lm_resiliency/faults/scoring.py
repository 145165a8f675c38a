"""Scoring localization against ground truth.

`evaluate(records, localizations)` groups the journal's records into occurrences, attributes
each localization to one occurrence, and reports per occurrence (`FaultEvaluation`) and for the
campaign (`CampaignReport`): precision, recall and false-positive rate of localization at rank
granularity, whether the localized resources and components match the ones the faults were
labelled with, and time-to-localize. Definitions are in docs/fault_injection.md.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional,
                    Sequence, Tuple)

from lm_resiliency.files import atomic_write, json_copy

from ._fields import (ObjectReader, build, check_non_negative_int, check_str, fail, freeze_json,
                      is_int, is_number, load_document, thaw_json)
from .records import FaultInjectionRecord, InjectionStatus
from .taxonomy import DEFAULT_KINDS, FailureType

if TYPE_CHECKING:  # pragma: no cover
    from lm_resiliency.scout.reports import SCOUTFaultReport
    from .campaign import FaultCampaign

# Scopes that detect a fault without blaming particular ranks.
UNLOCALIZED_SCOPES = frozenset({"peer_group"})
# SCOUT's replay checks name their resource "<check>:<module or parameter path>".
_REPLAY_CHECKS = frozenset({"embedding", "hidden", "output", "optimizer", "parameters", "optimizer_state", "live",
                            "input", "backward", "expert"})


def names(claimed: str, truth: str) -> bool:
    """Whether a claimed resource or component names the labelled `truth`: it is `truth`, or
    lies inside it ("layers.2.weight" and "layers.2[0:64]" inside "layers.2"), also behind a
    detector's qualifier ("hidden:layers.2", "dataloader:train" for "train"). A claim broader
    than the truth ("layers" for "layers.2") or elsewhere does not name it."""
    _, qualified, rest = claimed.partition(":")
    for candidate in (claimed, rest) if qualified else (claimed,):
        if candidate == truth or candidate.startswith((truth + ".", truth + "[")):
            return True
    return False


def _tuple_of(value: Any, path: str, what: str, check: Callable[[Any, str], Any]) -> Tuple[Any, ...]:
    if isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, tuple):
        fail(path, f"must be a tuple of {what}, got {type(value).__name__}")
    for i, item in enumerate(value):
        check(item, f"{path}[{i}]")
    return value


def _labels(value: Any, path: str) -> Tuple[str, ...]:
    return tuple(dict.fromkeys(_tuple_of(value, path, "strings", lambda v, p: check_str(v, p, empty=False))))


def _ranks(value: Any, path: str) -> Tuple[int, ...]:
    return tuple(sorted(set(_tuple_of(value, path, "ranks", check_non_negative_int))))


@dataclass(frozen=True)
class LocalizationResult:
    """A neutral localization claim from any detector (SCOUT, a watchdog, a human).

    `ranks` are the blamed ranks; with `scope` "peer_group" the claim detects a fault without
    blaming any rank (no claimed ranks). `resource` is what the detector found faulty or blocked
    ("output:layers.2", "dataloader:train"; "" when it names none) and `components` the parts
    of the system it blames (model modules, devices, links). `iteration` (training iteration of
    detection) and/or `detected_at` (wall time) place it in time. `occurrence_id` pins the
    claim to one occurrence; without it, `evaluate` attributes it by time and rank overlap."""

    ranks: Tuple[int, ...]
    kind: str
    iteration: Optional[int] = None
    detected_at: Optional[float] = None
    scope: str = "rank"
    resource: str = ""
    hosts: Tuple[str, ...] = ()
    confidence: float = 1.0
    source: str = ""
    occurrence_id: Optional[str] = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    components: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", _ranks(self.ranks, "LocalizationResult.ranks"))
        object.__setattr__(self, "components", _labels(self.components, "LocalizationResult.components"))
        check_str(self.kind, "LocalizationResult.kind", empty=False)
        if self.iteration is not None:
            check_non_negative_int(self.iteration, "LocalizationResult.iteration")
        if self.detected_at is not None:
            if not is_number(self.detected_at):
                fail("LocalizationResult.detected_at", f"must be a finite number, got {self.detected_at!r}")
            object.__setattr__(self, "detected_at", float(self.detected_at))
        check_str(self.scope, "LocalizationResult.scope", empty=False)
        check_str(self.resource, "LocalizationResult.resource")
        hosts = tuple(self.hosts) if isinstance(self.hosts, list) else self.hosts
        if not isinstance(hosts, tuple) or not all(isinstance(h, str) for h in hosts):
            fail("LocalizationResult.hosts", "must be a tuple of strings")
        object.__setattr__(self, "hosts", hosts)
        if not is_number(self.confidence):
            fail("LocalizationResult.confidence", f"must be a finite number, got {self.confidence!r}")
        check_str(self.source, "LocalizationResult.source")
        if self.occurrence_id is not None:
            check_str(self.occurrence_id, "LocalizationResult.occurrence_id", empty=False)
        object.__setattr__(self, "evidence", freeze_json(self.evidence, "LocalizationResult.evidence"))

    @property
    def claimed_ranks(self) -> FrozenSet[int]:
        return frozenset() if self.scope in UNLOCALIZED_SCOPES else frozenset(self.ranks)

    @classmethod
    def from_fault_report(cls, report: "SCOUTFaultReport",
                          components: Optional[Sequence[str]] = None) -> "LocalizationResult":
        """Convert a SCOUT fault report (kind, scope, ranks, hosts, resource, step, detected_at).

        Out-of-band reports (hang, DataLoader and checkpoint I/O stalls) carry the culprit's last
        *completed* step; the stall happened in the iteration after it. Replay reports carry the
        step being checked, which is the iteration itself. `components` defaults to the module
        or parameter a replay check names ("layers.2" for "output:layers.2",
        "layers.0.weight" for "optimizer:layers.0.weight[0:4096]"), else none."""
        iteration = report.step
        if iteration is not None and report.kind in _OUT_OF_BAND_KINDS:
            iteration += 1
        if components is None:
            check, qualified, path = report.resource.partition(":")
            components = (path.split("[")[0],) if qualified and check in _REPLAY_CHECKS and path else ()
        return cls(ranks=tuple(report.ranks), kind=report.kind, iteration=iteration,
                   detected_at=report.detected_at, scope=report.scope, resource=report.resource,
                   hosts=tuple(report.hosts), confidence=float(report.confidence), source="scout",
                   evidence=_plain_json(report.evidence), components=tuple(components))

    def to_json(self) -> Dict[str, Any]:
        return {"ranks": list(self.ranks), "kind": self.kind, "iteration": self.iteration,
                "detected_at": self.detected_at, "scope": self.scope, "resource": self.resource,
                "hosts": list(self.hosts), "confidence": self.confidence, "source": self.source,
                "occurrence_id": self.occurrence_id, "evidence": thaw_json(self.evidence),
                "components": list(self.components)}

    @classmethod
    def from_json(cls, doc: Any, path: str = "$") -> "LocalizationResult":
        doc = load_document(doc, "localization result")
        keys = ("ranks", "kind", "iteration", "detected_at", "scope", "resource", "hosts", "confidence",
                "source", "occurrence_id", "evidence", "components")
        r = ObjectReader(doc, path, ("ranks", "kind"), keys[2:])
        return build(cls, path, **r.kwargs(*keys))


_OUT_OF_BAND_KINDS = frozenset({"hang", "dataloader_stall", "checkpoint_io_stall"})


def _plain_json(value: Any) -> Any:
    """Best-effort JSON view of report evidence (tuples -> lists, unknown objects -> repr)."""
    try:
        return json_copy(value, default=repr)
    except ValueError:
        return {"unserializable": repr(value)}


@dataclass(frozen=True)
class FaultEvaluation:
    """How one occurrence fared. Ranks are sorted tuples; times are seconds; latencies are from
    the first injected record to the first attributed localization; time-to-localize is to the
    localization after which the attributed claims equal the truth exactly.

    `truth_resources` / `truth_components` are the labels of the injected faults' targets
    (`FaultTarget.resource` / `.component`); when there are any, `localized_exactly` also needs
    every claimed resource (component) to name one of them (`false_positive_*` lists those that
    do not: an over-claim) and every one of them to be named (`missed_*`)."""

    occurrence_id: str
    incident_id: str
    failure_types: Tuple[str, ...]
    status: str
    injected: bool
    truth_ranks: Tuple[int, ...]
    injected_iteration: Optional[int]
    injected_at: Optional[float]
    detected: bool
    localized_exactly: bool
    kind_matches: bool
    claimed_ranks: Tuple[int, ...]
    false_positive_ranks: Tuple[int, ...]
    missed_ranks: Tuple[int, ...]
    localizations: int
    detected_iteration: Optional[int] = None
    detected_at: Optional[float] = None
    latency_iterations: Optional[int] = None
    latency_s: Optional[float] = None
    time_to_localize_iterations: Optional[int] = None
    time_to_localize_s: Optional[float] = None
    truth_resources: Tuple[str, ...] = ()
    claimed_resources: Tuple[str, ...] = ()
    false_positive_resources: Tuple[str, ...] = ()
    missed_resources: Tuple[str, ...] = ()
    truth_components: Tuple[str, ...] = ()
    claimed_components: Tuple[str, ...] = ()
    false_positive_components: Tuple[str, ...] = ()
    missed_components: Tuple[str, ...] = ()

    def to_json(self) -> Dict[str, Any]:
        doc = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k in _TUPLE_FIELDS:
            doc[k] = list(doc[k])
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> "FaultEvaluation":
        doc = dict(load_document(doc, "fault evaluation"))
        for k in _TUPLE_FIELDS:
            doc[k] = tuple(doc.get(k, ()))
        return cls(**doc)


_TUPLE_FIELDS = ("failure_types", "truth_ranks", "claimed_ranks", "false_positive_ranks", "missed_ranks",
                 "truth_resources", "claimed_resources", "false_positive_resources", "missed_resources",
                 "truth_components", "claimed_components", "false_positive_components", "missed_components")


@dataclass(frozen=True)
class CampaignReport:
    """Per-occurrence evaluations and the campaign metrics (None where undefined: no positives
    for precision, no truth for recall, no negatives for the false-positive rate)."""

    campaign: str
    world_size: int
    evaluations: Tuple[FaultEvaluation, ...]
    injected: int
    detected: int
    localized_exactly: int
    kind_matched: int
    unattributed_localizations: int
    true_positives: int
    false_positives: int
    false_negatives: int
    true_negatives: int
    precision: Optional[float]
    recall: Optional[float]
    false_positive_rate: Optional[float]
    time_to_localize_median_s: Optional[float]
    time_to_localize_max_s: Optional[float]
    time_to_localize_median_iterations: Optional[float]
    time_to_localize_max_iterations: Optional[int]

    def evaluation(self, occurrence_id: str) -> FaultEvaluation:
        for e in self.evaluations:
            if e.occurrence_id == occurrence_id:
                return e
        raise KeyError(occurrence_id)

    def to_json(self) -> Dict[str, Any]:
        doc = {k: getattr(self, k) for k in self.__dataclass_fields__}
        doc["evaluations"] = [e.to_json() for e in self.evaluations]
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> "CampaignReport":
        doc = dict(load_document(doc, "campaign report"))
        doc["evaluations"] = tuple(FaultEvaluation.from_json(e) for e in doc.get("evaluations", ()))
        return cls(**doc)

    def write(self, path: str) -> None:
        """Write the report as JSON atomically."""
        atomic_write(path, (json.dumps(self.to_json(), indent=2, allow_nan=False) + "\n").encode("utf-8"))

    def format_table(self) -> str:
        """A plain-text table of the occurrences and the campaign metrics."""
        rows = [("occurrence", "injected@", "detected@", "truth", "claimed", "exact", "kind", "ttl_s")]
        for e in self.evaluations:
            rows.append((e.occurrence_id, _fmt(e.injected_iteration) if e.injected else e.status,
                         _fmt(e.detected_iteration), _fmt_ranks(e.truth_ranks), _fmt_ranks(e.claimed_ranks),
                         "yes" if e.localized_exactly else "no", "yes" if e.kind_matches else "no",
                         _fmt(e.time_to_localize_s)))
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.append("")
        lines.append(f"precision={_fmt(self.precision)} recall={_fmt(self.recall)} "
                     f"false_positive_rate={_fmt(self.false_positive_rate)} "
                     f"time_to_localize median={_fmt(self.time_to_localize_median_s)}s "
                     f"max={_fmt(self.time_to_localize_max_s)}s")
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _fmt_ranks(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks)) if ranks else "-"


@dataclass
class _Occurrence:
    occurrence_id: str
    incident_id: str
    records: List[FaultInjectionRecord]
    matched: List[LocalizationResult] = field(default_factory=list)

    @property
    def injected_records(self) -> List[FaultInjectionRecord]:
        return [r for r in self.records if r.status is InjectionStatus.INJECTED]

    @property
    def injected(self) -> bool:
        return bool(self.injected_records)

    @property
    def truth(self) -> FrozenSet[int]:
        return frozenset(r.rank for r in self.injected_records)

    @property
    def truth_resources(self) -> Tuple[str, ...]:
        return tuple(sorted({r.resource for r in self.injected_records if r.resource is not None}))

    @property
    def truth_components(self) -> Tuple[str, ...]:
        return tuple(sorted({r.component for r in self.injected_records if r.component is not None}))

    @property
    def iteration(self) -> Optional[int]:
        recs = self.injected_records
        return min(r.iteration for r in recs) if recs else None

    @property
    def wall_time(self) -> Optional[float]:
        recs = self.injected_records
        return min(r.wall_time for r in recs) if recs else None

    @property
    def status(self) -> str:
        if self.injected:
            return InjectionStatus.INJECTED.value
        order = [s.value for s in InjectionStatus]
        return min((r.status.value for r in self.records), key=order.index)

    def order_key(self) -> Tuple[float, float]:
        return (float(self.iteration if self.iteration is not None else -1),
                float(self.wall_time if self.wall_time is not None else -1))


def _precedes(occ: _Occurrence, loc: LocalizationResult, window: Optional[int]) -> bool:
    if loc.iteration is not None and occ.iteration is not None:
        if occ.iteration > loc.iteration:
            return False
        return window is None or loc.iteration - occ.iteration <= window
    if loc.detected_at is not None and occ.wall_time is not None:
        return occ.wall_time <= loc.detected_at
    return True


def _time_key(loc: LocalizationResult) -> Tuple[float, float]:
    return (float(loc.iteration) if loc.iteration is not None else float("inf"),
            loc.detected_at if loc.detected_at is not None else float("inf"))


def _ratio(numerator: int, denominator: int) -> Optional[float]:
    return numerator / denominator if denominator else None


def evaluate(records: Iterable[FaultInjectionRecord], localizations: Sequence[LocalizationResult] = (),
             *, campaign: Optional["FaultCampaign"] = None, world_size: Optional[int] = None,
             window_iterations: Optional[int] = None) -> CampaignReport:
    """Score `localizations` against the ground-truth `records`.

    Attribution: a localization with `occurrence_id` goes to that occurrence. Otherwise the
    candidates are injected occurrences that started at or before it (by iteration, else wall
    time; within `window_iterations` if given); it goes to the latest candidate whose truth
    ranks it claims, else to the latest candidate; with no candidate it is unattributed (a
    false alarm in a fault-free window).
    Rank granularity: each injected occurrence is a window over ranks 0..world_size-1 with truth
    T (ranks it was injected on) and claims L (ranks its localizations blame): TP=|L&T|,
    FP=|L-T|, FN=|T-L|, TN=world_size-|L|T|. Unattributed localizations form one more window
    with T empty. precision=TP/(TP+FP), recall=TP/(TP+FN), false_positive_rate=FP/(FP+TN).
    """
    records = list(records)
    for i, record in enumerate(records):
        if not isinstance(record, FaultInjectionRecord):
            raise TypeError(f"evaluate: records[{i}] is a {type(record).__name__}, "
                            "not a FaultInjectionRecord")
    localizations = list(localizations)
    for i, loc in enumerate(localizations):
        if not isinstance(loc, LocalizationResult):
            raise TypeError(f"evaluate: localizations[{i}] is a {type(loc).__name__}, "
                            "not a LocalizationResult "
                            "(convert SCOUT reports with LocalizationResult.from_fault_report)")
    if world_size is None:
        seen = [r.world_size for r in records] + [r.rank + 1 for r in records]
        seen += [rank + 1 for loc in localizations for rank in loc.ranks]
        world_size = max(seen, default=1)
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"evaluate: world_size must be a positive int, got {world_size!r}")

    occurrences: Dict[str, _Occurrence] = {}
    for record in records:
        occ = occurrences.get(record.occurrence_id)
        if occ is None:
            occ = _Occurrence(record.occurrence_id, record.incident_id, [])
            occurrences[record.occurrence_id] = occ
        occ.records.append(record)
    injected = [o for o in occurrences.values() if o.injected]

    unattributed: List[LocalizationResult] = []
    for loc in sorted(localizations, key=_time_key):
        target: Optional[_Occurrence] = None
        if loc.occurrence_id is not None:
            occ = occurrences.get(loc.occurrence_id)
            target = occ if occ is not None and occ.injected else None
        else:
            candidates = [o for o in injected if _precedes(o, loc, window_iterations)]
            overlapping = [o for o in candidates if o.truth & loc.claimed_ranks]
            pool = overlapping or candidates
            target = max(pool, key=_Occurrence.order_key) if pool else None
        if target is None:
            unattributed.append(loc)
        else:
            target.matched.append(loc)

    evaluations: List[FaultEvaluation] = []
    tp = fp = fn = tn = 0
    ttl_s: List[float] = []
    ttl_it: List[int] = []
    for occ in occurrences.values():
        types = sorted({r.failure_type.value for r in (occ.injected_records or occ.records)})
        if not occ.injected:
            evaluations.append(FaultEvaluation(
                occurrence_id=occ.occurrence_id, incident_id=occ.incident_id, failure_types=tuple(types),
                status=occ.status, injected=False, truth_ranks=(), injected_iteration=None,
                injected_at=None, detected=False, localized_exactly=False, kind_matches=False,
                claimed_ranks=(), false_positive_ranks=(), missed_ranks=(), localizations=0))
            continue
        truth = occ.truth
        claimed: set = set()
        resources = _Labels(occ.truth_resources)
        components = _Labels(occ.truth_components)
        ttl: Optional[LocalizationResult] = None
        for loc in occ.matched:
            claimed |= loc.claimed_ranks
            resources.claim((loc.resource,) if loc.resource else ())
            components.claim(loc.components)
            if ttl is None and claimed == truth and resources.exact and components.exact:
                ttl = loc
        exact = occ.matched and claimed == truth and resources.exact and components.exact
        if ttl is not None and not exact:
            ttl = None  # a later claim blamed a healthy rank or another resource: not exact in the end
        accepted = _accepted_kinds(campaign, occ.incident_id, types)
        first = occ.matched[0] if occ.matched else None
        e = FaultEvaluation(
            occurrence_id=occ.occurrence_id, incident_id=occ.incident_id, failure_types=tuple(types),
            status=occ.status, injected=True, truth_ranks=tuple(sorted(truth)),
            injected_iteration=occ.iteration, injected_at=occ.wall_time, detected=first is not None,
            localized_exactly=bool(exact),
            kind_matches=any(loc.kind in accepted for loc in occ.matched),
            claimed_ranks=tuple(sorted(claimed)), false_positive_ranks=tuple(sorted(claimed - truth)),
            missed_ranks=tuple(sorted(truth - claimed)), localizations=len(occ.matched),
            detected_iteration=first.iteration if first else None,
            detected_at=first.detected_at if first else None,
            latency_iterations=_diff(first.iteration if first else None, occ.iteration),
            latency_s=_diff(first.detected_at if first else None, occ.wall_time),
            time_to_localize_iterations=_diff(ttl.iteration if ttl else None, occ.iteration),
            time_to_localize_s=_diff(ttl.detected_at if ttl else None, occ.wall_time),
            truth_resources=resources.truth, claimed_resources=resources.claimed,
            false_positive_resources=resources.over, missed_resources=resources.missed,
            truth_components=components.truth, claimed_components=components.claimed,
            false_positive_components=components.over, missed_components=components.missed)
        evaluations.append(e)
        tp += len(claimed & truth)
        fp += len(claimed - truth)
        fn += len(truth - claimed)
        tn += max(0, world_size - len(claimed | truth))
        if e.time_to_localize_s is not None:
            ttl_s.append(e.time_to_localize_s)
        if e.time_to_localize_iterations is not None:
            ttl_it.append(e.time_to_localize_iterations)
    if unattributed:
        blamed = frozenset().union(*(loc.claimed_ranks for loc in unattributed))
        fp += len(blamed)
        tn += max(0, world_size - len(blamed))

    return CampaignReport(
        campaign=campaign.name if campaign is not None else "",
        world_size=world_size, evaluations=tuple(evaluations), injected=len(injected),
        detected=sum(e.detected for e in evaluations),
        localized_exactly=sum(e.localized_exactly for e in evaluations),
        kind_matched=sum(e.kind_matches for e in evaluations),
        unattributed_localizations=len(unattributed),
        true_positives=tp, false_positives=fp, false_negatives=fn, true_negatives=tn,
        precision=_ratio(tp, tp + fp), recall=_ratio(tp, tp + fn), false_positive_rate=_ratio(fp, fp + tn),
        time_to_localize_median_s=statistics.median(ttl_s) if ttl_s else None,
        time_to_localize_max_s=max(ttl_s) if ttl_s else None,
        time_to_localize_median_iterations=statistics.median(ttl_it) if ttl_it else None,
        time_to_localize_max_iterations=max(ttl_it) if ttl_it else None)


class _Labels:
    """The claimed resources (or components) of one occurrence against its labelled truth; with
    no truth labels, nothing is scored (every claim is accepted)."""

    def __init__(self, truth: Tuple[str, ...]) -> None:
        self.truth = truth
        self._claimed: Dict[str, None] = {}

    def claim(self, labels: Iterable[str]) -> None:
        self._claimed.update(dict.fromkeys(labels))

    @property
    def claimed(self) -> Tuple[str, ...]:
        return tuple(sorted(self._claimed))

    @property
    def over(self) -> Tuple[str, ...]:
        if not self.truth:
            return ()
        return tuple(c for c in self.claimed if not any(names(c, t) for t in self.truth))

    @property
    def missed(self) -> Tuple[str, ...]:
        return tuple(t for t in self.truth if not any(names(c, t) for c in self._claimed))

    @property
    def exact(self) -> bool:
        return not self.over and not self.missed


def _diff(a: Any, b: Any) -> Any:
    return None if a is None or b is None else a - b


def _accepted_kinds(campaign: Optional["FaultCampaign"], incident_id: str,
                    types: Sequence[str]) -> FrozenSet[str]:
    if campaign is not None:
        try:
            return campaign.incident(incident_id).accepted_kinds
        except KeyError:
            pass
    return frozenset().union(*(DEFAULT_KINDS[FailureType(t)] for t in types))


__all__ = ["CampaignReport", "FaultEvaluation", "LocalizationResult", "evaluate", "names"]
