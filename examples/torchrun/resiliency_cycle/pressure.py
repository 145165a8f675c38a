"""The torchrun resiliency cycle: an uninterrupted baseline, then the same training under a fault
campaign with `--nodes` agents (`--active` train, the rest park as standbys), every incident
followed to the generation that replaces it, and a bitwise comparison of the final state.

    python -m examples.torchrun.resiliency_cycle.pressure orchestrate --framework pytorch \\
        --fault-campaign-dir DIR [--nodes 8 --active 4 --gpus 0,...,7]

DIR must hold `campaign.json` (copy one from campaigns/). The report lands in DIR/report.json and
DIR/report.md, the runs' files under DIR/work/. Exit status 0 only when every incident ended as
expected and the final state is bitwise equal to the baseline's.

The orchestrator is the run's manager: it reads each incident's marker, kills the target node's
agent for whole-node incidents (a parked standby then takes the slot), and checks every successor
generation against the restart contexts the agents wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

from . import campaign as cycle_campaign
from . import report
from .agents import Cluster


def _json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _generation(run: Cluster, generation: int) -> Optional[Dict[int, Dict[str, Any]]]:
    """The progress records of every training slot in `generation`, or None while any is missing."""
    records = {slot: _json(run.path("progress", f"g{generation:03d}-s{slot}.json")) for slot in range(run.active)}
    return None if any(r is None for r in records.values()) else records  # type: ignore[return-value]


def _successor(run: Cluster, after: int) -> Optional[Dict[int, Dict[str, Any]]]:
    """The first generation after `after` in which every training slot started."""
    names = os.listdir(run.path("progress")) if os.path.isdir(run.path("progress")) else []
    for generation in sorted({int(n[1:4]) for n in names if n.startswith("g")}):
        if generation > after:
            found = _generation(run, generation)
            if found is not None:
                return found
    return None


def _scout(run: Cluster, incident_id: str) -> List[int]:
    """The ranks SCOUT's sdc verdicts named, as every rank reported them for this incident."""
    named = set()
    folder = run.path("scout")
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.startswith(f"{incident_id}-rank"):
            for verdict in (_json(os.path.join(folder, name)) or {}).get("verdicts", []):
                named.update(verdict["faulty"])
    return sorted(named)


def follow(run: Cluster, campaign: cycle_campaign.CycleCampaign, timeout: float, say) -> List[Dict[str, Any]]:
    """Act on and check every incident in order; one row per incident."""
    rows: List[Dict[str, Any]] = []
    run.wait_for(lambda: _generation(run, 0) is not None, timeout, "generation 0 to start")
    digest = (_generation(run, 0) or {})[0]["topology_digest"]
    say(report.header())
    for number, incident in enumerate(campaign.incidents, 1):
        began = time.time()
        row: Dict[str, Any] = {"number": number, "id": incident.id, "type": incident.type.value,
                               "surface": incident.surface.value, "slot": incident.slot, "step": incident.step,
                               "expected": incident.expected, "outcome": None, "selected_step": None, "problems": []}
        rows.append(row)
        try:
            _follow_one(run, incident, row, digest, timeout)
        except (TimeoutError, RuntimeError, KeyError) as exc:
            row["problems"].append(str(exc))
        row["seconds"] = round(time.time() - began, 1)
        row["ok"] = not row["problems"]
        say(report.progress_line(row))
        if not row["ok"] and row.get("selected_step") is None:
            break  # the run did not recover: later incidents cannot be followed
    return rows


def _follow_one(run: Cluster, incident: cycle_campaign.CycleIncident, row: Dict[str, Any], digest: str,
                timeout: float) -> None:
    marker_path = run.path("markers", f"{incident.id}.json")
    run.wait_for(lambda: os.path.exists(marker_path), timeout, f"incident {incident.id}")
    marker = _json(marker_path) or {}
    generation = marker["generation"]
    row.update(injected_iteration=marker.get("iteration"), generation=generation)
    before = _generation(run, generation) or {}
    if incident.node_loss:
        node = run.node_of_agent(before[incident.slot]["agent_pid"]) if incident.slot in before else None
        if node is None:
            raise RuntimeError(f"no live agent holds slot {incident.slot} of generation {generation}")
        run.kill(node)
        row["killed_node"] = node
    run.wait_for(lambda: _successor(run, generation) is not None, timeout,
                 f"the generation after incident {incident.id}")
    row.update(_check(incident, row, before, _successor(run, generation), digest))
    if incident.type.value == "tensor_corruption":
        row["scout_named"] = _scout(run, incident.id)
        if row["scout_named"] != [incident.slot]:
            row["problems"].append(f"SCOUT named ranks {row['scout_named']}, not [{incident.slot}]")


def _check(incident, row, before, after, digest) -> Dict[str, Any]:
    """What the successor generation shows: every slot loaded the one step the agents selected,
    before the incident struck, on the run's topology; who holds the target slot now."""
    problems = row["problems"]
    steps = {r["checkpoint_step"] for r in after.values()}
    starts = {r["start"] for r in after.values()}
    if len(steps) != 1 or steps != starts:
        problems.append(f"slots disagree on the selected step: contexts {sorted(steps)}, loop starts {sorted(starts)}")
    selected = min(steps)
    if not 0 < selected < incident.step:
        problems.append(f"selected step {selected} is not a capture before the incident (step {incident.step})")
    if {r["topology_digest"] for r in after.values()} != {digest}:
        problems.append("the successor runs on another topology digest")
    if any(r["checkpoint_source"] != "gemini" for r in after.values()):
        problems.append("a slot started without GEMINI state")
    # Same-node: the target's node trains in the successor (in any slot: a restart round admits
    # nodes in arrival order). Replacement: it is gone and a node that was parked joined.
    target = before.get(incident.slot, {}).get("node_id")
    nodes_before, nodes_after = {r["node_id"] for r in before.values()}, {r["node_id"] for r in after.values()}
    outcome = "same-node" if target in nodes_after else "replacement"
    if outcome == "replacement" and not nodes_after - nodes_before:
        problems.append("the target node is gone but no standby joined")
    if outcome != incident.expected:
        problems.append(f"expected {incident.expected}, got {outcome}")
    target_after = after[incident.slot]
    return {"outcome": outcome, "selected_step": selected, "successor_generation": target_after["generation"],
            "decision": target_after["decision"]}


def compare(baseline: Cluster, managed: Cluster) -> Dict[str, Any]:
    """Every rank's final parameters and optimizer state, byte for byte."""
    ranks: Dict[str, Any] = {}
    for rank in range(managed.active):
        a, b = _json(baseline.path("final", f"rank{rank}.json")), _json(managed.path("final", f"rank{rank}.json"))
        if a is None or b is None:
            ranks[str(rank)] = {"tensors": 0, "differing": ["<missing final state>"]}
            continue
        differing = sorted(k for k in set(a["tensors"]) | set(b["tensors"])
                           if a["tensors"].get(k) != b["tensors"].get(k))
        ranks[str(rank)] = {"tensors": len(a["tensors"]), "differing": differing, "managed_start": b["start"]}
    return {"bitwise_equal": all(not r["differing"] for r in ranks.values()), "ranks": ranks}


def orchestrate(args: argparse.Namespace) -> int:
    started = time.time()

    def say(text: str) -> None:
        print(text, flush=True)

    root = os.path.abspath(args.fault_campaign_dir)
    standbys = args.nodes - args.active
    try:
        campaign = cycle_campaign.load(os.path.join(root, "campaign.json"), args.active, standbys)
    except cycle_campaign.CycleCampaignError as exc:
        say(f"error: {exc}")
        return 2
    if args.gpus:
        say(f"note: --gpus {args.gpus} is ignored on CPU; each of the {args.nodes} synthetic nodes is one torchrun "
            "agent with one gloo worker")
    manifest = os.path.join(root, "fault_campaign.json")
    campaign.fault_campaign().to_file(manifest)
    say(f"resiliency cycle '{campaign.name}': {len(campaign.incidents)} incidents "
        f"({len(campaign.incidents) - campaign.replacements()} same-node, {campaign.replacements()} replacement), "
        f"{args.active} active + {standbys} standby torchrun agents, {campaign.steps} steps")
    baseline = Cluster(root, "baseline", active=args.active, nodes=args.active, steps=campaign.steps,
                       fault_campaign=None)
    managed = Cluster(root, "managed", active=args.active, nodes=args.nodes, steps=campaign.steps,
                      fault_campaign=manifest)
    rows: List[Dict[str, Any]] = []
    codes: Dict[int, int] = {}
    try:
        say(f"[{time.time() - started:6.1f}s] baseline: {args.active} agents, no faults")
        baseline.start_all(args.timeout)
        baseline_codes = baseline.finish(args.timeout * 2)
        if set(baseline_codes.values()) != {0}:
            say(f"error: the baseline failed (agent exit statuses {baseline_codes}); logs in {baseline.path('logs')}")
            return 1
        say(f"[{time.time() - started:6.1f}s] managed run: {args.nodes} agents")
        managed.start_all(args.timeout)
        rows = follow(managed, campaign, args.timeout, say)
        codes = managed.finish(args.timeout * 2)
    finally:
        baseline.stop()
        managed.stop()
    comparison = compare(baseline, managed)
    doc = report.document(campaign, rows, comparison, codes, managed, args, time.time() - started)
    report.write(root, doc)
    say(report.summary(doc))
    return 0 if doc["ok"] else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m examples.torchrun.resiliency_cycle.pressure",
                                     description="the torchrun resiliency cycle on one host")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("orchestrate", help="run the baseline and the campaign, then report")
    run.add_argument("--framework", choices=["pytorch"], default="pytorch",
                     help="the training framework (this example: a plain PyTorch DDP module)")
    run.add_argument("--fault-campaign-dir", required=True, help="a directory holding campaign.json")
    run.add_argument("--nodes", type=int, default=8, help="torchrun agents in all (default 8)")
    run.add_argument("--active", type=int, default=4, help="agents that train; the rest park as standbys (default 4)")
    run.add_argument("--gpus", default="", help="accepted for the GPU command line; ignored on CPU")
    run.add_argument("--timeout", type=float, default=300.0, help="bound of every wait, in seconds (default 300)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if not 1 < args.active <= args.nodes:
        print("error: --active must be at least 2 and at most --nodes", file=sys.stderr)
        return 2
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
