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
GEN_COLORS = ["#2ca02c", "#17becf", "#bcbd22", "#8c564b", "#e377c2", "#7f7f7f", "#1f77b4", "#ff7f0e"]


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
    """Two panels: loss per optimizer step, and optimizer step over wall time, one colour per
    generation, with injections (dotted lines / triangles), localizations (crosses) and restarts
    (arrows back to the recovered step; shaded downtime). Returns a note when it cannot draw."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install 'lm-resiliency[demo]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = losses(managed)
    base = losses(baseline).get(0, {})
    t0 = managed.started_at
    gens = managed.generations
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 9.5), gridspec_kw={"height_ratios": [1.15, 1]})
    fig.suptitle(f"make demo: {scenario.WORLD} CPU ranks, GEMINI + SCOUT, fault campaign 'make-demo'", fontsize=13)

    def gen_color(index: int) -> str:
        return GEN_COLORS[index % len(GEN_COLORS)]

    def loss_at(index: Optional[int], step: int) -> Optional[float]:
        """Loss of generation `index` at `step` (or its last step before it); any generation as fallback."""
        order = ([index] if index is not None else []) + [g.index for g in reversed(gens)]
        for i in order:
            pts = {s: v for s, v in curves.get(i, {}).items() if s <= step}
            if pts:
                return pts[max(pts)]["loss"]
        return None

    injected: Dict[str, Any] = {}
    for rec in records:
        if rec.status.value == "injected":
            injected.setdefault(rec.occurrence_id, rec)
    by_iteration: Dict[int, List[Any]] = {}
    for rec in injected.values():
        by_iteration.setdefault(rec.iteration, []).append(rec)

    # ---- top: loss per optimizer step
    if base:
        top.plot(list(base), [v["loss"] for v in base.values()], color="#999999", lw=6, alpha=0.35,
                 label="uninterrupted baseline", zorder=1)
    for gen in gens:
        pts = curves.get(gen.index, {})
        if pts:
            label = f"generation {gen.index}: steps {min(pts)}-{max(pts)} ({gen.end.replace('_', ' ')})"
            top.plot(list(pts), [v["loss"] for v in pts.values()], "-o", ms=3.5, lw=1.6, color=gen_color(gen.index),
                     zorder=3, label=label)
    top.set_yscale("log")
    all_losses = [v["loss"] for pts in curves.values() for v in pts.values()] + [v["loss"] for v in base.values()]
    if all_losses:
        top.set_ylim(min(all_losses) / 1.45, max(all_losses) * 1.25)   # room for the labels
    ymax = top.get_ylim()[1]
    for iteration, recs in sorted(by_iteration.items()):
        for i, rec in enumerate(recs):
            color = INCIDENT_COLORS.get(rec.incident_id, "#444444")
            top.axvline(iteration + 0.08 * i, color=color, ls=":", lw=1.4, zorder=2)
        top.annotate("\n".join(f"{r.incident_id} (rank {r.rank})" for r in recs), (iteration, ymax),
                     xytext=(3, -3), textcoords="offset points", va="top", ha="left", fontsize=8,
                     color=INCIDENT_COLORS.get(recs[0].incident_id, "#444444"))
    for row in rows:
        if row["detected_by"] is None:
            continue
        color = INCIDENT_COLORS.get(row["incident"], "#333333")
        if row["detected_iteration"] is not None:
            x = row["detected_iteration"]
            y = loss_at(row["detected_generation"], x)
        else:   # found while loading: at the recovered step
            x = row["recovery_step"]
            y = loss_at(None, x)
        if x is not None and y is not None:
            top.plot([x], [y], "X", ms=12, color=color, markeredgecolor="white", zorder=6)
    for gen in gens[1:]:
        prev = gens[gen.index - 1]
        prev_pts = curves.get(prev.index, {})
        if not prev_pts or gen.resumed_step is None:
            continue
        start = (prev.last_step, prev_pts[max(prev_pts)]["loss"])
        end = (gen.resumed_step, loss_at(prev.index, gen.resumed_step) or start[1])
        top.annotate("", xy=end, xytext=start, zorder=4,
                     arrowprops=dict(arrowstyle="-|>", color="#333333", lw=1.2, connectionstyle="arc3,rad=0.5"))
        top.annotate(f"restart -> {gen.resumed_step}", end, xytext=(-8, -22), textcoords="offset points",
                     fontsize=8, color="#333333", ha="center",
                     bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8))
    top.set_xlabel("optimizer step (training iteration)")
    top.set_ylabel("training loss (mean over ranks, log)")
    top.grid(alpha=0.25)
    top.set_xlim(0, managed.steps + 1)
    top.plot([], [], ":", color="#555555", label="fault injected (dotted line)")
    top.plot([], [], "X", color="#555555", ms=9, label="localized (SCOUT / supervisor / GEMINI)")
    top.legend(loc="lower left", fontsize=8, ncol=1, framealpha=0.92)
    top.set_title("loss per step: every generation resumes from its recovered step and rejoins the baseline",
                  fontsize=10)

    # ---- bottom: progress over wall time
    first_managed = curves.get(0, {}).get(1)
    if base and first_managed is not None:
        shift = first_managed["t"] - base[min(base)]["t"]   # the baseline ran earlier: align step 1
        bottom.plot([v["t"] + shift - t0 for v in base.values()], list(base), color="#999999", lw=5, alpha=0.35,
                    label="uninterrupted baseline (aligned at step 1)")
    for gen in gens:
        pts = curves.get(gen.index, {})
        color = gen_color(gen.index)
        bottom.axvline(gen.launched_at - t0, color=color, ls="--", lw=1, alpha=0.8)
        bottom.annotate(f"gen {gen.index} launched", (gen.launched_at - t0, 0.5), xytext=(3, 0),
                        textcoords="offset points", fontsize=7, color=color, rotation=90, va="bottom")
        if pts:
            bottom.plot([v["t"] - t0 for v in pts.values()], list(pts), "-o", ms=2.5, color=color,
                        label=f"generation {gen.index}")
        following = gens[gen.index + 1] if gen.index + 1 < len(gens) else None
        first_t = min((v["t"] for v in curves.get(following.index, {}).values()), default=None) if following else None
        if first_t is not None and gen.ended_at is not None:
            began = gen.detected_at if gen.detected_at is not None else gen.ended_at
            bottom.axvspan(began - t0, first_t - t0, color="#d62728", alpha=0.07)
    for iteration, recs in sorted(by_iteration.items()):
        for rec in recs:
            color = INCIDENT_COLORS.get(rec.incident_id, "#444444")
            bottom.plot([rec.wall_time - t0], [rec.iteration], "v", ms=10, color=color, markeredgecolor="white",
                        zorder=5)
        bottom.annotate(" + ".join(r.incident_id for r in recs), (recs[0].wall_time - t0, iteration), xytext=(-6, 6),
                        textcoords="offset points", fontsize=8, ha="right",
                        color=INCIDENT_COLORS.get(recs[0].incident_id, "#444444"))
    for row in rows:
        if row["detected_by"] is None:
            continue
        color = INCIDENT_COLORS.get(row["incident"], "#333333")
        t = row.get("detected_at")
        y = row["detected_iteration"] if row["detected_iteration"] is not None else row["recovery_step"]
        if t is not None and y is not None:
            bottom.plot([t - t0], [y], "X", ms=12, color=color, markeredgecolor="white", zorder=6)
    bottom.plot([], [], "v", color="#555555", ms=8, label="fault injected")
    bottom.plot([], [], "X", color="#555555", ms=9, label="localized")
    bottom.fill_between([], [], color="#d62728", alpha=0.12, label="detection -> relaunch -> first new step")
    bottom.set_xlabel("wall time since the managed run started (s)")
    bottom.set_ylabel("optimizer step")
    bottom.set_ylim(0, managed.steps + 1)
    bottom.grid(alpha=0.25)
    bottom.legend(loc="upper left", fontsize=8, ncol=2, framealpha=0.92)
    bottom.set_title("progress over wall time: detection latency, restart cost and re-done steps of each failure",
                     fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
