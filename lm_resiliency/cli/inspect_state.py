"""`lm-resiliency inspect [DISK_FOLDER]`: every run whose GEMINI state is on this node (run id,
topology, world size, per rank the newest complete step and the RECOVERY_VERIFIED step, sizes,
ages, shared-memory slots) and which step a relaunch of each would resume from, and why not a
newer one (lm_resiliency.inventory). Nothing is loaded or changed."""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Optional

from lm_resiliency.gemini.shm import default_shared_memory_dir
from lm_resiliency.inventory import (DISK, SHARED, Inventory, RunView, age_text, newest_resumable_step, resume_choice,
                                     scan)


def add_arguments(parser: Any) -> None:
    parser.add_argument("disk_folder", metavar="DISK_FOLDER", nargs="?", default="./checkpoints",
                        help="the runs' InMemoryCkptConfig.disk_folder (default %(default)s, its default)")
    parser.add_argument("--shared-memory-dir", default=None,
                        help=f"InMemoryCkptConfig.shared_memory_dir (default {default_shared_memory_dir()})")
    parser.add_argument("--run-id", default=None, help="only this run, and say which step its relaunch resumes from")
    parser.add_argument("--world-size", type=int, default=None,
                        help="with --run-id: the number of ranks of the relaunch (state of another topology "
                             "cannot be loaded by it)")
    parser.add_argument("--json", action="store_true", help="print what was found as JSON")


def run(args: Any) -> int:
    if args.world_size is not None and args.world_size < 1:
        print("lm-resiliency inspect: error: --world-size must be a positive number of ranks", file=sys.stderr)
        return 2
    inventory = scan(args.disk_folder, args.shared_memory_dir)
    runs = list(inventory.runs)
    relaunch = None
    if args.run_id is not None:
        runs = [r for r in runs if r.run_id == args.run_id]
        relaunch = _relaunch(inventory, args.run_id, args.world_size)
    doc = {"disk_folder": inventory.disk_folder, "shared_memory_dir": inventory.shared_memory_dir,
           "runs": [run_json(r) for r in runs],
           "other_shared_memory": [run_json(r) for r in inventory.other_shared] if args.run_id is None else [],
           "problems": list(inventory.problems), "relaunch": relaunch}
    print(json.dumps(doc, indent=2) if args.json else format_inventory(doc))
    if relaunch is not None and relaunch["step"] is None:
        return 1  # nothing this relaunch could resume from
    return 0


def _relaunch(inventory: Inventory, run_id: str, world_size: Optional[int]) -> Dict[str, Any]:
    """Which step a relaunch of `run_id` (on `world_size` ranks) would resume from, or why none."""
    same = inventory.matching(run_id)
    fitting = [r for r in same if world_size is None or r.world_size in (None, world_size)]
    who = f"run {run_id!r}" + (f" on {world_size} ranks" if world_size is not None else "")
    if not fitting:
        others = "; ".join(f"{r.describe()} (step {newest_resumable_step(r)})" for r in same)
        why = (f"state of run {run_id!r} exists only for another topology: {others}" if same
               else f"no state of run {run_id!r} in {inventory.disk_folder} or {inventory.shared_memory_dir}")
        return {"run_id": run_id, "world_size": world_size, "step": None, "reason": f"a relaunch of {who} starts "
                f"fresh: {why}", "namespace": None}
    if len(fitting) > 1:
        return {"run_id": run_id, "world_size": world_size, "step": None, "namespace": None,
                "reason": f"{who} has state for {len(fitting)} topologies ("
                          + "; ".join(f"{r.namespace}: {r.describe()}" for r in fitting)
                          + "); the relaunch's own topology (framework, parallel layout, replication) picks one"}
    choice = resume_choice(fitting[0])
    if choice.step is None:
        return {"run_id": run_id, "world_size": world_size, "step": None, "namespace": fitting[0].namespace,
                "reason": f"a relaunch of {who} starts fresh: {choice.reason}",
                "newer": [{"step": s, "why_not": w} for s, w in choice.newer]}
    return {"run_id": run_id, "world_size": world_size, "step": choice.step, "trust": choice.trust,
            "namespace": fitting[0].namespace, "reason": f"a relaunch of {who} resumes at step {choice.step}: "
            f"{choice.reason}", "newer": [{"step": s, "why_not": w} for s, w in choice.newer]}


def run_json(run: RunView) -> Dict[str, Any]:
    choice = resume_choice(run)
    return {
        "run_id": run.run_id, "namespace": run.namespace, "directory": run.directory,
        "shared_memory_directory": run.shm_directory, "topology": run.topology, "world_size": run.world_size,
        "framework": run.framework, "replication_jump": run.jump, "launches": run.starts,
        "last_written": run.last_written,
        "ranks": [{
            "rank": r.rank, "newest_complete_step": r.newest_own_step, "recovery_verified_step": r.verified_step,
            "sdc_pending": r.sdc_pending, "disk_bytes": r.disk_bytes,
            "shared_memory_bytes": sum(c.nbytes for c in r.copies if c.tier == SHARED),
            "shared_memory_owner_pid": r.shm_owner_pid, "shared_memory_owner_alive": r.shm_owner_alive,
            "copies": [{"owner_rank": c.owner_rank, "step": c.step, "tier": c.tier, "bytes": c.nbytes,
                        "written_at": c.written_at} for c in r.copies],
            "problems": list(r.problems)} for r in run.ranks],
        "resume": {"step": choice.step, "trust": choice.trust, "reason": choice.reason,
                   "sources": {str(k): v for k, v in choice.sources.items()},
                   "newer": [{"step": s, "why_not": w} for s, w in choice.newer]},
    }


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def format_inventory(doc: Dict[str, Any]) -> str:
    lines = [f"GEMINI state in {doc['disk_folder']} (shared memory: {doc['shared_memory_dir']})"]
    if not doc["runs"] and not doc["other_shared_memory"]:
        lines.append("  no runs found")
    for run in doc["runs"] + doc["other_shared_memory"]:
        lines += [""] + _format_run(run)
    if doc["problems"]:
        lines += ["", "problems:"] + [f"  {p}" for p in doc["problems"]]
    relaunch = doc["relaunch"]
    if relaunch is not None:
        lines += ["", relaunch["reason"]]
        lines += [f"  not step {n['step']}: {n['why_not']}" for n in relaunch.get("newer", [])]
    return "\n".join(lines)


def _format_run(run: Dict[str, Any]) -> List[str]:
    ranks = f"{run['world_size']} ranks" if run["world_size"] else "world size unknown (no event log)"
    where = run["directory"] or f"{run['shared_memory_directory']} (shared memory only: another disk folder)"
    name = repr(run["run_id"]) if run["run_id"] is not None else "(id unknown: no event log or sidecar names it)"
    lines = [f"run {name}: {ranks}, {run['framework'] or 'framework unknown'}, topology "
             f"{(run['topology'] or '?')[:12]}, {run['launches']} launch(es), last written "
             f"{age_text(run['last_written'])} ago", f"  {where}",
             "  rank  newest step  RECOVERY_VERIFIED  node-local disk         shared memory"]
    for r in run["ranks"]:
        disk = [c for c in r["copies"] if c["tier"] == DISK]
        shm = [c for c in r["copies"] if c["tier"] == SHARED]
        owner = ""
        if r["shared_memory_owner_pid"] is not None:
            owner = f", pid {r['shared_memory_owner_pid']} {'alive' if r['shared_memory_owner_alive'] else 'dead'}"
        newest = "-" if r["newest_complete_step"] is None else f"step {r['newest_complete_step']}"
        verified = "-" if r["recovery_verified_step"] is None else f"step {r['recovery_verified_step']}"
        disk_text = f"{len(disk)} shard(s), {_size(r['disk_bytes'])}"
        shm_text = f"{len(shm)} slot(s), {_size(r['shared_memory_bytes'])}{owner}" if shm or owner else "-"
        lines.append(f"  {r['rank']:<5} {newest:<12} {verified:<18} {disk_text:<23} {shm_text}")
    resume = run["resume"]
    if resume["step"] is None:
        lines.append(f"  a relaunch with this run id and topology starts fresh: {resume['reason']}")
    else:
        sources = ", ".join(f"rank {k} from {v}" for k, v in resume["sources"].items())
        lines.append(f"  a relaunch with this run id and topology resumes at step {resume['step']} "
                     f"({resume['reason']}): {sources}")
    lines += [f"    not step {n['step']}: {n['why_not']}" for n in resume["newer"]]
    return lines
