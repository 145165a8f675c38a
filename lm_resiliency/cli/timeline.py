"""`lm-resiliency timeline RUN_DIR`: a run's launches, recoveries, captures and SCOUT reports, read
from the event log its sessions wrote next to their state (lm_resiliency.events), as a table,
JSON and the two-panel picture (lm_resiliency.cli.picture)."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Dict, List, Optional, Set, Tuple

from lm_resiliency.cli.picture import Generation, Mark, Picture, draw
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.events import EventLogRejected, read_events

_RANK_RE = re.compile(r"rank-(\d{5})")
_NAMESPACE_RE = re.compile(r"gemini-[0-9a-f]{24}")
REPORT_COLORS = {"sdc": "#d62728", "sdc_peer_group": "#d62728", "sdc_inconclusive": "#e377c2",
                 "compute_straggler": "#ff7f0e", "communication_straggler": "#ff7f0e", "hang": "#1f77b4"}


class TimelineError(ResiliencyError):
    """No run (or no unambiguous run) can be read at the given path; the message says what to pass."""


def find_run_dir(path: str, run_id: Optional[str] = None) -> str:
    """`path` itself when it is a run directory (it holds rank-* directories), else the one run of
    the disk folder `path` (with `run_id` when it holds several)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise TimelineError(f"{path}: no such directory; pass a run directory (`lm-resiliency inspect` lists them) "
                            "or the disk folder with --run-id")
    if _rank_dirs(path):
        return path
    runs: Dict[str, List[str]] = {}
    for name in sorted(os.listdir(path)):
        candidate = os.path.join(path, name)
        if _NAMESPACE_RE.fullmatch(name) and os.path.isdir(candidate) and not os.path.islink(candidate):
            for found in _run_ids(candidate):
                runs.setdefault(found, []).append(candidate)
    if run_id is not None:
        runs = {run_id: runs[run_id]} if run_id in runs else {}
    if not runs:
        raise TimelineError(f"{path}: no event log of {'run ' + repr(run_id) if run_id else 'any run'} here; pass "
                            "a run directory or a disk folder that holds one")
    if len(runs) > 1:
        raise TimelineError(f"{path} holds the event logs of several runs ({', '.join(map(repr, sorted(runs)))}); "
                            "pass --run-id")
    [(found_id, dirs)] = runs.items()
    if len(dirs) > 1:
        raise TimelineError(f"run {found_id!r} has state for several topologies here ({', '.join(dirs)}); pass one "
                            "of these run directories")
    return dirs[0]


def _rank_dirs(run_dir: str) -> List[Tuple[int, str]]:
    return sorted((int(m.group(1)), os.path.join(run_dir, name)) for name in os.listdir(run_dir)
                  if (m := _RANK_RE.fullmatch(name)) and os.path.isdir(os.path.join(run_dir, name)))


def _run_ids(run_dir: str) -> List[str]:
    ids: Set[str] = set()
    for _, rank_dir in _rank_dirs(run_dir)[:1]:
        try:
            ids.update(e["run_id"] for e in read_events(rank_dir).events)
        except (EventLogRejected, OSError):
            continue
    return sorted(ids)


def build(run_dir: str) -> Tuple[Picture, Dict[str, Any]]:
    """The picture of the run in `run_dir` and its summary (JSON-ready)."""
    ranks: Dict[int, List[dict]] = {}
    refused = 0
    for rank, rank_dir in _rank_dirs(run_dir):
        found = read_events(rank_dir)
        refused += found.refused_lines
        if found.events:
            ranks[rank] = list(found.events)
    if not ranks:
        raise TimelineError(f"{run_dir}: no event log in its rank directories (written by lm-resiliency 0.2 "
                            "sessions; state written by InMemoryCheckpointManager alone has none)")
    lead = ranks[min(ranks)]
    starts = [e for e in lead if e["event"] == "start"]
    if not starts:
        raise TimelineError(f"{run_dir}: the event log of rank {min(ranks)} holds no session start (rotated away?)")
    everyone = sorted((e for events in ranks.values() for e in events), key=lambda e: e["t"])
    generations, marks, vetoed, seen = [], [], [], set()
    for index, start in enumerate(starts):
        until = starts[index + 1]["t"] if index + 1 < len(starts) else float("inf")
        mine = [e for e in lead if start["t"] <= e["t"] < until]
        span = [e for e in everyone if start["t"] <= e["t"] < until]
        resumed = next((e for e in mine if e["event"] in ("recovered", "fresh")), None)
        close = next((e for e in mine if e["event"] == "close"), None)
        resumed_step = resumed["step"] if resumed is not None else None
        captures = tuple(e["step"] for e in mine if e["event"] == "capture")
        points: List[Tuple[int, float, Optional[float]]] = []
        if resumed_step is not None:
            points.append((resumed_step, start["t"], None))
        points += [(e["step"], e["t"], None) for e in mine if e["event"] == "capture"]
        if close is not None:
            points.append((close["step"], close["t"], None))
        reports = [e for e in span if e["event"] == "report"]
        for report in reports:
            key = (report.get("kind"), tuple(report.get("ranks") or ()), report.get("step"))
            if key in seen:
                continue  # every rank of the vote reports the same fault
            seen.add(key)
            ranks_text = ",".join(map(str, key[1]))
            marks.append(Mark(kind="localized", label=f"{key[0]} (rank {ranks_text})", step=report.get("step"),
                              t=report["t"], color=REPORT_COLORS.get(str(key[0]), "#333333"), generation=index))
        vetoed += [{"step": e["step"], "reason": e.get("reason"), "generation": index}
                   for e in mine if e["event"] == "vetoed"]
        ended_at = close["t"] if close is not None else (span[-1]["t"] if span else None)
        if close is not None and close.get("abnormal"):
            end = f"stopped at step {close['step']} on a failure"
        elif close is not None:
            end = f"closed at step {close['step']}"
        elif index + 1 < len(starts):
            end = "ended without closing: killed or crashed"
        else:
            end = "no close recorded: still running, or killed"
        started = {e["rank"] for e in span if e["event"] == "start"}
        unclosed = sorted(started - {e["rank"] for e in span if e["event"] == "close"})
        if unclosed and close is not None:
            end += f"; rank{'s' if len(unclosed) > 1 else ''} {', '.join(map(str, unclosed))} never closed (killed)"
        generations.append(Generation(
            index=index, launched_at=start["t"], ended_at=ended_at, resumed_step=resumed_step, end=end,
            points=tuple(points), captures=captures,
            stopped_at=reports[-1]["t"] if reports and close is None else None))  # what ended it: the last report
    steps = [s for g in generations for s, _, _ in g.points] + [m.step for m in marks if m.step is not None]
    first = starts[0]
    picture = Picture(
        title=(f"lm-resiliency timeline: run {first['run_id']!r}, {first['world_size']} ranks "
               f"({first.get('framework', '?')}), {len(generations)} launch{'es' if len(generations) != 1 else ''}"),
        started_at=first["t"], max_step=max(steps, default=1), generations=tuple(generations), marks=tuple(marks),
        localized_legend="SCOUT report")
    summary = {
        "run_id": first["run_id"], "world_size": first["world_size"], "framework": first.get("framework"),
        "directory": run_dir, "ranks_with_events": sorted(ranks), "refused_lines": refused,
        "generations": [{"index": g.index, "launched_at": g.launched_at, "ended_at": g.ended_at,
                         "resumed_step": g.resumed_step, "last_step": g.last_step, "end": g.end,
                         "captures": list(g.captures)} for g in generations],
        "reports": [{"kind": m.label.split(" (")[0], "label": m.label, "step": m.step, "t": m.t,
                     "generation": m.generation} for m in marks],
        "vetoed": vetoed,
    }
    return picture, summary


def run(args: Any) -> int:
    try:
        run_dir = find_run_dir(args.run_dir, args.run_id)
        picture, summary = build(run_dir)
    except (TimelineError, EventLogRejected, OSError) as exc:
        print(f"lm-resiliency timeline: error: {exc}", file=sys.stderr)
        return 1
    note = None
    path = None
    if not args.no_picture:
        path = os.path.abspath(args.out or f"timeline-{_safe(summary['run_id'])}.png")
        note = draw(picture, path)
        if note is not None:
            path = None
    summary.update(picture=path, note=note)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
    return 3 if note is not None else 0


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:80] or "run"


def format_summary(summary: Dict[str, Any]) -> str:
    lines = [f"run {summary['run_id']!r}: {summary['world_size']} ranks ({summary['framework']}), "
             f"{len(summary['generations'])} launches, events of ranks {summary['ranks_with_events']} in "
             f"{summary['directory']}"]
    for g in summary["generations"]:
        resumed = "fresh" if not g["resumed_step"] else f"resumed at step {g['resumed_step']}"
        captures = g["captures"]
        captured = f"captures {captures[0]}..{captures[-1]} ({len(captures)})" if captures else "no capture"
        lines.append(f"  generation {g['index']}: {resumed}, {captured}, {g['end']}")
    for r in summary["reports"]:
        lines.append(f"  SCOUT report: {r['label']} at step {r['step']} (generation {r['generation']})")
    for v in summary["vetoed"]:
        lines.append(f"  capture of step {v['step']} vetoed (generation {v['generation']}): {v['reason']}")
    if summary["refused_lines"]:
        lines.append(f"  {summary['refused_lines']} event log line(s) refused (torn by a crash, or not an event)")
    if summary.get("picture"):
        lines.append(f"picture: {summary['picture']}")
    elif summary.get("note"):
        lines.append(f"no picture: {summary['note']}")
    return "\n".join(lines)


def add_arguments(parser: Any) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run directory (<disk_folder>/gemini-..., as `lm-resiliency inspect` lists it), or "
                             "the disk folder itself with --run-id")
    parser.add_argument("--run-id", default=None, help="which run of a disk folder that holds several")
    parser.add_argument("--out", default=None, help="the picture's path (PNG; default ./timeline-<run id>.png)")
    parser.add_argument("--no-picture", action="store_true", help="only the table (or JSON); draw nothing")
    parser.add_argument("--json", action="store_true", help="print the timeline as JSON")
