"""The cycle's progress table (one line per incident as it completes) and its report
(report.json and report.md in the campaign directory)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

# How each failure type is performed on one CPU host: "faithful" when the effect is the real one,
# "represented" when a stand-in with the same consequence for the run is used.
PERFORMED = {
    "tensor_corruption": ("faithful", "the fault kit corrupts the target rank's parameters; SCOUT's replay vote "
                                      "names the rank and every rank ends the generation"),
    "stale_state": ("faithful", "the kit undoes the target's optimizer update of one step"),
    "drop": ("faithful", "the kit drops one batch of the target's data loader"),
    "duplicate": ("faithful", "the kit yields one batch of the target's data loader twice (the "
                                 "generation ends before the repeat is trained on)"),
    "reorder": ("faithful", "the kit swaps two batches of the target's data loader"),
    "delay": ("faithful", "the kit stalls the target's forward"),
    "hang": ("faithful", "the kit blocks the target before its forward (bounded); the orchestrator kills the node"),
    "timeout": ("faithful", "the kit raises a timeout in the target after a stall"),
    "exception": ("faithful", "the kit raises an exception in the target's forward"),
    "resource_exhaustion": ("faithful", "the kit fills the target's rank-local sandbox directory"),
    "process_termination": ("faithful", "the kit SIGKILLs the target worker"),
    "resource_unavailable": ("represented", "the device is gone: the orchestrator kills the node's agent"),
    "checkpoint_corruption": ("faithful", "the kit flips a byte of the target's newest flushed GEMINI shard"),
    "checkpoint_truncation": ("faithful", "the kit truncates the target's newest flushed GEMINI shard"),
    "checkpoint_missing": ("faithful", "the kit deletes the target's newest flushed GEMINI shard"),
    "io_error": ("faithful", "the kit raises an I/O error in the target"),
    "payload_corruption": ("represented", "the target's batch payload arrives sign-flipped (data-loader surface)"),
    "collective_desync": ("faithful", "the kit issues one extra all-reduce on the target"),
    "message_drop": ("represented", "the node's messages stop: the orchestrator kills the node's agent"),
    "network_partition": ("represented", "no network is cut on a shared host: performed as a whole-node loss "
                                         "(the orchestrator kills the node's agent)"),
    "config_drift": ("faithful", "the kit changes an environment variable of the target (NCCL_ALGO)"),
}
_COLUMNS = (("#", 3), ("type", 22), ("target", 7), ("step", 5), ("outcome", 12), ("selected", 9), ("seconds", 7))


def header() -> str:
    names = "  ".join(name.ljust(width) for name, width in _COLUMNS).rstrip()
    return names + "\n" + "  ".join("-" * width for _, width in _COLUMNS)


def progress_line(row: Dict[str, Any]) -> str:
    outcome = row["outcome"] or "-"
    if not row["ok"]:
        outcome += " FAIL"
    cells = (row["number"], row["type"], f"slot {row['slot']}", row["step"], outcome,
             "-" if row["selected_step"] is None else row["selected_step"], f"{row['seconds']:.1f}")
    line = "  ".join(str(c).ljust(w) for c, (_, w) in zip(cells, _COLUMNS)).rstrip()
    return line + "".join(f"\n      ! {problem}" for problem in row["problems"])


def document(campaign, rows: List[Dict[str, Any]], comparison: Dict[str, Any], codes: Dict[int, int], managed,
             args, elapsed: float) -> Dict[str, Any]:
    complete = len(rows) == len(campaign.incidents) and all(r["ok"] for r in rows)
    killed = set(managed.killed)
    agents_ok = bool(codes) and all(code == 0 for node, code in codes.items() if node not in killed)
    for row in rows:
        row["performed"], row["how"] = PERFORMED[row["type"]]
    return {
        "schema": "lm-resiliency-cycle-report/1",
        "campaign": campaign.name,
        "framework": args.framework,
        "nodes": args.nodes, "active": args.active, "steps": campaign.steps,
        "incidents": rows,
        "same_node": sum(1 for r in rows if r["outcome"] == "same-node"),
        "replacements": sum(1 for r in rows if r["outcome"] == "replacement"),
        "killed_nodes": sorted(killed),
        "agent_exit_codes": {str(node): code for node, code in sorted(codes.items())},
        "final_state": comparison,
        "wall_time_s": round(elapsed, 1),
        "ok": bool(complete and agents_ok and comparison["bitwise_equal"]),
    }


def markdown(doc: Dict[str, Any]) -> str:
    lines = [f"# Resiliency cycle: {doc['campaign']}", "",
             f"{doc['active']} active + {doc['nodes'] - doc['active']} standby torchrun agents "
             f"(`--rdzv-backend=lm_resiliency`, gloo, CPU), {doc['steps']} steps, {doc['wall_time_s']:.0f} s. "
             f"Result: **{'OK' if doc['ok'] else 'FAIL'}**.", "",
             "| # | incident | type | surface | target | step | expected | outcome | selected step | seconds | "
             "performed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["incidents"]:
        outcome = (r["outcome"] or "-") + ("" if r["ok"] else " (FAIL: " + "; ".join(r["problems"]) + ")")
        lines.append(f"| {r['number']} | {r['id']} | {r['type']} | {r['surface']} | slot {r['slot']} | {r['step']} | "
                     f"{r['expected']} | {outcome} | {'-' if r['selected_step'] is None else r['selected_step']} | "
                     f"{r['seconds']:.1f} | {r['performed']}: {r['how']} |")
    equal = doc["final_state"]["bitwise_equal"]
    tensors = sum(r["tensors"] for r in doc["final_state"]["ranks"].values())
    lines += ["", f"Final state of {doc['active']} ranks ({tensors} tensors) bitwise equal to the uninterrupted "
                  f"baseline: {'yes' if equal else 'NO'}.",
              f"Nodes killed by the orchestrator (replaced by standbys): {doc['killed_nodes'] or 'none'}; agent exit "
              f"statuses: {doc['agent_exit_codes']}.", ""]
    return "\n".join(lines)


def write(root: str, doc: Dict[str, Any]) -> None:
    for name, text in (("report.json", json.dumps(doc, indent=2, sort_keys=True) + "\n"),
                       ("report.md", markdown(doc))):
        with open(os.path.join(root, name + ".tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(root, name + ".tmp"), os.path.join(root, name))


def summary(doc: Dict[str, Any]) -> str:
    equal = "yes" if doc["final_state"]["bitwise_equal"] else "NO"
    done = sum(1 for r in doc["incidents"] if r["ok"])
    return (f"{done}/{len(doc['incidents'])} incidents as expected ({doc['same_node']} same-node, "
            f"{doc['replacements']} replacement); final state bitwise equal to the baseline: {equal}; "
            f"{doc['wall_time_s']:.0f} s\n{'OK' if doc['ok'] else 'FAIL'}: report in report.md and report.json")
