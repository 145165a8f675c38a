"""Scoring, the final table, the bitwise check against the baseline, the report JSON, the picture.

Localizations come from three detectors, each turned into a neutral `LocalizationResult`:
  SCOUT         replay verdicts (SDC, stragglers) and the out-of-band monitor (hang), as reported
                to orchestration by the ranks (`LocalizationResult.from_fault_report`)
  supervisor    a rank that died of a signal it was not sent (kind "process_termination")
  GEMINI        a node-local shard refused at load (kind "checkpoint_rejected"; it has no
                training iteration, so it is placed in time by wall clock only)
The kit's `evaluate` scores them against the journal's ground truth.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

from . import scenario
from .worker import fingerprint

# A localization of this kind ends its generation with this supervisor outcome (a restart).
RESTART_END = {"sdc": "sdc_stop", "sdc_peer_group": "sdc_stop", "sdc_inconclusive": "sdc_stop",
               "hang": "hang", "process_termination": "rank_died"}
SDC_KINDS = ("sdc", "sdc_peer_group", "sdc_inconclusive")
INCIDENT_COLORS = {"hidden-sdc": "#d62728", "slow-rank": "#ff7f0e", "bad-shard": "#9467bd",
                   "killed-rank": "#111111", "hung-rank": "#1f77b4"}


def localizations(job) -> Tuple[List[Any], List[dict]]:
    """Every localization of the managed run, deduplicated (each rank reports the same vote), and
    the SCOUT reports left out: those a rank wrote after the supervisor had begun tearing its
    generation down (a dying job is not a new fault)."""
    from lm_resiliency import SCOUTFaultReport
    from lm_resiliency.faults import LocalizationResult

    teardown = {g.index: g.detected_at for g in job.generations if g.detected_at is not None}
    out, seen, ignored = [], set(), []
    for event in job.events:
        if event["event"] == "fault" and event["t"] > teardown.get(event["gen"], math.inf):
            ignored.append(event)
            continue
        if event["event"] == "fault":
            doc = dict(event["report"])
            key = ("scout", doc["kind"], tuple(doc["ranks"]), doc["step"], doc["resource"])
            if key in seen:
                continue
            seen.add(key)
            doc["ranks"], doc["hosts"] = tuple(doc["ranks"]), tuple(doc["hosts"])
            out.append(LocalizationResult.from_fault_report(SCOUTFaultReport(**doc)))
        elif event["event"] == "rejected":
            key = ("gemini", event["owner"], event["step"], event["gen"])
            if key in seen:
                continue
            seen.add(key)
            out.append(LocalizationResult(
                ranks=(event["owner"],), kind="checkpoint_rejected", detected_at=event["t"], source="gemini",
                resource=f"node-local shard of step {event['step']}", evidence={"reason": event["reason"]}))
    for death in job.deaths:
        gen = job.generations[death["gen"]]
        out.append(LocalizationResult(
            ranks=tuple(death["ranks"]), kind="process_termination", iteration=gen.last_step + 1,
            detected_at=death["detected_at"], source="supervisor", resource="exit by " + "/".join(death["signals"])))
    return sorted(out, key=lambda loc: loc.detected_at or 0.0), ignored


def score(job, campaign) -> Tuple[Any, Any, list, list, list]:
    """(campaign report, SDC-only report, records, localizations, ignored SCOUT reports)."""
    from lm_resiliency.faults import CampaignJournal, FailureType, evaluate

    records = list(CampaignJournal(job.paths["journal"]).records())
    locs, ignored = localizations(job)
    report = evaluate(records, locs, campaign=campaign, world_size=scenario.WORLD)
    sdc_records = [r for r in records if r.failure_type is FailureType.TENSOR_CORRUPTION]
    sdc_report = evaluate(sdc_records, [loc for loc in locs if loc.kind in SDC_KINDS], campaign=campaign,
                          world_size=scenario.WORLD)
    return report, sdc_report, records, locs, ignored


def _generation_at(job, t: float):
    for gen in job.generations:
        if gen.launched_at <= t <= (gen.ended_at if gen.ended_at is not None else math.inf):
            return gen
    return None


def incident_rows(job, campaign, report, locs) -> List[Dict[str, Any]]:
    """One row per occurrence: what was injected, what localized it, how the run recovered."""
    rows = []
    evaluations = sorted(report.evaluations, key=lambda e: (e.injected_iteration or 0, e.injected_at or 0))
    for e in evaluations:
        accepted = campaign.incident(e.incident_id).accepted_kinds
        truth = set(e.truth_ranks)
        hits = [loc for loc in locs if loc.kind in accepted and set(loc.claimed_ranks) & truth
                and (e.injected_at is None or loc.detected_at is None or loc.detected_at >= e.injected_at)]
        first = hits[0] if hits else None
        row: Dict[str, Any] = {
            "incident": e.incident_id, "occurrence": e.occurrence_id, "failure_type": ",".join(e.failure_types),
            "injected": e.injected, "status": e.status, "injected_iteration": e.injected_iteration,
            "truth_ranks": list(e.truth_ranks), "localized_ranks": list(e.claimed_ranks),
            "localized_exactly": e.localized_exactly, "kind_matches": e.kind_matches,
            "detected_by": f"{first.source}:{first.kind}" if first else None,
            "detected_at": first.detected_at if first else None,
            "detected_iteration": e.detected_iteration, "time_to_localize_s": e.time_to_localize_s,
            "recovery": "-", "recovery_step": None, "work_lost_steps": None,
        }
        gen = _generation_at(job, first.detected_at) if first is not None and first.detected_at else None
        row["detected_generation"] = gen.index if gen is not None else None
        end = RESTART_END.get(first.kind) if first is not None else None
        if gen is not None and end is not None and gen.end == end and gen.index + 1 < len(job.generations):
            following = job.generations[gen.index + 1]
            step = following.resumed_step or 0
            row.update(recovery_step=step, work_lost_steps=gen.last_step - step,
                       recovery=f"restart from step {step}" + (" (RECOVERY_VERIFIED)" if end == "sdc_stop" else ""))
        elif gen is not None and first.kind == "checkpoint_rejected":
            holders = [h for h, s in gen.sources.items() for r in e.truth_ranks if f"held:{r}" in s]
            row.update(recovery_step=gen.resumed_step, work_lost_steps=0,
                       recovery=f"step {gen.resumed_step} from rank {holders[0]}'s replica" if holders
                       else f"step {gen.resumed_step}")
        elif first is not None:
            row.update(recovery="none needed (kept training)", work_lost_steps=0)
        rows.append(row)
    return rows


def _fmt(value: Any, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}{suffix}"
    return f"{value}{suffix}"


def _ranks(ranks: List[int]) -> str:
    return ",".join(map(str, ranks)) if ranks else "-"


def format_table(rows: List[Dict[str, Any]]) -> str:
    header = ("incident", "failure type", "injected@", "detected@", "truth", "localized", "exact",
              "ttl", "recovery", "work lost")
    lines = [header]
    for r in rows:
        if r["detected_iteration"] is not None:
            detected = f"step {r['detected_iteration']}"
        elif r["detected_by"] is not None:
            detected = "at load"
        else:
            detected = "-"
        lines.append((
            r["incident"], r["failure_type"],
            f"iter {r['injected_iteration']}" if r["injected"] else r["status"], detected,
            _ranks(r["truth_ranks"]),
            _ranks(r["localized_ranks"]) + (f" ({r['detected_by']})" if r["detected_by"] else ""),
            "yes" if r["localized_exactly"] else "no", _fmt(r["time_to_localize_s"], "s"), r["recovery"],
            "-" if r["work_lost_steps"] is None else
            f"{r['work_lost_steps']} step{'' if r['work_lost_steps'] == 1 else 's'}"))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    text = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


LEGEND = """\
columns: injected@ = the iteration the fault was first injected in; detected@ = the step it was localized at
  ("at load": a shard GEMINI refused while recovering); truth = the rank(s) it was injected on; localized = the
  rank(s) the detector blamed (source:kind); exact = the blamed ranks equal the truth; ttl = time to localize, from
  the injection to that localization; work lost = steps the failed generation ran past the recovered step (trained
  again). A generation is one launch of the ranks: the supervisor relaunches them after each failure, and each
  generation resumes from the step it recovered."""


def format_metrics(label: str, report) -> str:
    def f(v: Optional[float], digits: int = 2) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    return (f"{label}: precision={f(report.precision)} recall={f(report.recall)} "
            f"false_positive_rate={f(report.false_positive_rate)} "
            f"time_to_localize median={f(report.time_to_localize_median_s, 1)}s "
            f"max={f(report.time_to_localize_max_s, 1)}s "
            f"({report.localized_exactly}/{report.injected} localized exactly, "
            f"{report.unattributed_localizations} unattributed)")


def compare_final(baseline, managed) -> Dict[str, Any]:
    """Bitwise comparison of every rank's final parameters and optimizer state."""
    ranks: Dict[str, Any] = {}
    equal = True
    for rank in range(scenario.WORLD):
        a_path = os.path.join(baseline.paths["final"], f"rank{rank}.pt")
        b_path = os.path.join(managed.paths["final"], f"rank{rank}.pt")
        if not (os.path.exists(a_path) and os.path.exists(b_path)):
            ranks[str(rank)] = {"tensors": 0, "values": 0, "differing": ["<missing final state>"]}
            equal = False
            continue
        a, b = fingerprint(a_path), fingerprint(b_path)
        differing = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        ranks[str(rank)] = {"tensors": sum(1 for v in a.values() if v.startswith("tensor ")), "values": len(a),
                            "differing": differing}
        equal = equal and not differing
    return {"bitwise_equal": equal, "ranks": ranks}


def losses(job) -> Dict[int, Dict[int, Dict[str, float]]]:
    """gen -> step -> {"loss": mean over ranks, "t": when the last rank finished the step}."""
    acc: Dict[int, Dict[int, List[Tuple[float, float]]]] = {}
    for event in job.events:
        if event["event"] == "step":
            acc.setdefault(event["gen"], {}).setdefault(event["step"], []).append((event["loss"], event["t"]))
    return {g: {s: {"loss": sum(v[0] for v in vals) / len(vals), "t": max(v[1] for v in vals)}
                for s, vals in sorted(steps.items())} for g, steps in sorted(acc.items())}


def write_json(path: str, doc: Dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, default=repr, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def draw_timeline(path: str, baseline, managed, rows: List[Dict[str, Any]], records) -> Optional[str]:
    """The library's two-panel picture (lm_resiliency.cli.picture, also `lm-resiliency timeline`):
    loss per optimizer step and optimizer step over wall time, one colour per generation, with
    injections (dotted lines / triangles), localizations (crosses) and restarts (arrows back to the
    recovered step; shaded downtime). Returns a note when it cannot draw."""
    from lm_resiliency.cli.picture import Generation, Mark, Picture, draw

    curves = losses(managed)
    base = losses(baseline).get(0, {})
    generations = tuple(Generation(
        index=gen.index, launched_at=gen.launched_at, ended_at=gen.ended_at, resumed_step=gen.resumed_step,
        end=gen.end.replace("_", " "), stopped_at=gen.detected_at,
        points=tuple((step, v["t"], v["loss"]) for step, v in curves.get(gen.index, {}).items()))
        for gen in managed.generations)
    injected: Dict[str, Any] = {}
    for rec in records:
        if rec.status.value == "injected":
            injected.setdefault(rec.occurrence_id, rec)
    marks = [Mark(kind="injected", label=rec.incident_id, detail=f"rank {rec.rank}", step=rec.iteration,
                  t=rec.wall_time, color=INCIDENT_COLORS.get(rec.incident_id, "#444444"))
             for rec in injected.values()]
    for row in rows:
        if row["detected_by"] is None:
            continue
        found_at_load = row["detected_iteration"] is None  # a refused shard: placed at the recovered step
        marks.append(Mark(kind="localized", label=row["incident"], t=row.get("detected_at"),
                          step=row["recovery_step"] if found_at_load else row["detected_iteration"],
                          generation=None if found_at_load else row["detected_generation"],
                          color=INCIDENT_COLORS.get(row["incident"], "#333333")))
    picture = Picture(
        title=f"make demo: {scenario.WORLD} CPU ranks, GEMINI + SCOUT, fault campaign 'make-demo'",
        started_at=managed.started_at, max_step=managed.steps, generations=generations, marks=tuple(marks),
        baseline=tuple((step, v["t"], v["loss"]) for step, v in base.items()),
        localized_legend="localized (SCOUT / supervisor / GEMINI)")
    return draw(picture, path)
