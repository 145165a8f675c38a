"""Command line of the demo: run the baseline, run the campaign, score, compare, report, draw."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from . import report as reporting
from . import scenario
from .supervisor import Job

def _intro(campaign) -> str:
    s = scenario
    lines = [
        f"lm-resiliency demo: {s.WORLD} CPU ranks (gloo) train a small model with enable_resiliency():",
        f"  GEMINI  in-memory checkpoints every {s.INTERVAL} steps, replicated to a peer, flushed to node-local "
        "disk with CRCs",
        f"  SCOUT   replay checks every {s.INTERVAL} steps, straggler timing, out-of-band hang monitor "
        f"(threshold {s.HANG_THRESHOLD_S}s)",
        f"The campaign '{campaign.name}' (enable_fault_injection) injects:",
    ]
    for incident in campaign.incidents:
        lines.append(f"  iter {incident.trigger.at[0]:>2}  {incident.incident_id:<12} {incident.description}")
    lines += ["A supervisor relaunches the ranks after each failure; at the end the recovered run's parameters",
              "and optimizer state must be bitwise equal to an uninterrupted baseline run."]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resiliency_demo.py", description="failure -> localization -> recovery on one CPU machine "
                                               "(what `make demo` runs)")
    parser.add_argument("--out", default="demo-output",
                        help="output folder: report.json, timeline.png, campaign.json, work/ (default: demo-output)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw timeline.png")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    started = time.time()

    def say(text: str) -> None:
        print(f"[{time.time() - started:6.1f}s] {text}", flush=True)

    root = os.path.abspath(args.out)
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(os.path.join(root, "work"), ignore_errors=True)
    for name in ("report.json", "timeline.png"):
        if os.path.exists(os.path.join(root, name)):
            os.remove(os.path.join(root, name))
    campaign = scenario.build_campaign()
    campaign.to_file(os.path.join(root, "campaign.json"))
    print(_intro(campaign), flush=True)
    print(flush=True)

    say(f"== baseline: {scenario.STEPS} steps, no faults")
    baseline = Job(root, "baseline", campaign=False, steps=scenario.STEPS, say=say)
    if not baseline.run():
        return 2
    say(f"== managed run: the same training with the campaign '{campaign.name}' "
        f"({len(campaign.incidents)} incidents)")
    managed = Job(root, "managed", campaign=True, steps=scenario.STEPS, say=say)
    completed = managed.run()

    evaluation, sdc_evaluation, records, locs, ignored = reporting.score(managed, campaign)
    rows = reporting.incident_rows(managed, campaign, evaluation, locs)
    comparison = reporting.compare_final(baseline, managed) if completed else {"bitwise_equal": False,
                                                                              "ranks": {}}
    picture = os.path.join(root, "timeline.png")
    plot_note = "--no-plot given" if args.no_plot else reporting.draw_timeline(
        picture, baseline, managed, rows, records)
    elapsed = time.time() - started

    table = reporting.format_table(rows)
    metrics = reporting.format_metrics("campaign (all incidents)", evaluation)
    sdc_metrics = reporting.format_metrics("SDC incidents", sdc_evaluation)
    lost = sum(r["work_lost_steps"] or 0 for r in rows)
    restarts = sum(1 for g in managed.generations if g.end != "finished")
    values = sum(r.get("values", 0) for r in comparison["ranks"].values())
    tensors = sum(r.get("tensors", 0) for r in comparison["ranks"].values())
    equal = comparison["bitwise_equal"]
    sdc_ok = sdc_evaluation.precision == 1.0 and sdc_evaluation.recall == 1.0
    all_injected = all(r["injected"] for r in rows) and len(rows) == len(campaign.incidents)

    doc = {
        "schema": "lm-resiliency-demo/1",
        "campaign": campaign.to_json(),
        "world_size": scenario.WORLD, "steps": scenario.STEPS, "interval": scenario.INTERVAL,
        "wall_time_s": round(elapsed, 2),
        "baseline": {"generations": [g.to_json() for g in baseline.generations],
                     "wall_time_s": round(baseline.ended_at - baseline.started_at, 2)},
        "managed": {"generations": [g.to_json() for g in managed.generations], "completed": completed,
                    "restarts": restarts, "work_lost_steps": lost,
                    "wall_time_s": round(managed.ended_at - managed.started_at, 2)},
        "incidents": rows,
        "journal": [record.to_json() for record in records],
        "localizations": [loc.to_json() for loc in locs],
        "ignored_reports": ignored,
        "evaluation": evaluation.to_json(),
        "sdc_evaluation": sdc_evaluation.to_json(),
        "final_state": comparison,
        "losses": {"baseline": reporting.losses(baseline), "managed": reporting.losses(managed)},
        "timeline_png": None if plot_note else picture,
        "ok": bool(equal and sdc_ok and all_injected and completed),
    }
    report_path = os.path.join(root, "report.json")
    reporting.write_json(report_path, doc)

    print(flush=True)
    print(table, flush=True)
    print(reporting.LEGEND, flush=True)
    print(flush=True)
    print(metrics, flush=True)
    print(sdc_metrics, flush=True)
    print(f"recovery: {restarts} restarts, {lost} steps of work lost in total; final state of {scenario.WORLD} "
          f"ranks ({tensors} tensors, {values} values) bitwise equal to the baseline: {'yes' if equal else 'NO'}",
          flush=True)
    if not equal:
        for rank, info in comparison["ranks"].items():
            if info["differing"]:
                print(f"  rank {rank} differs in: {', '.join(info['differing'][:8])}", flush=True)
    print(f"report: {report_path}", flush=True)
    print(f"timeline: {picture}" if not plot_note else f"timeline: not drawn ({plot_note})", flush=True)
    print(f"total wall time {elapsed:.1f}s", flush=True)
    if doc["ok"]:
        print("OK: every failure was injected, localized and recovered from, and the run finished bitwise "
              "equal to the uninterrupted baseline.", flush=True)
        return 0
    print("FAIL: see the table above and the logs under " + os.path.join(root, "work"), flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
