"""SCOUT detection campaign under real DDP: precision, recall, false-positive rate and latency per class.

    python -m benchmarks.detection_bench [--ranks 4] [--trials 2] [--out benchmarks/results/detection.json]

Each trial trains a small DDP model on `--ranks` gloo processes with `enable_resiliency` and
injects one fault on one rank (the rank rotates over trials):

  hang             the rank sleeps 2.5 x the hang threshold in its forward at step 6 (then goes on)
  straggler_start  the rank sleeps as long as a step's work at the start of every iteration (2x)
  straggler_layer  the rank's middle layer is 5x slower
  non_finite       one NaN in the rank's layer output at step 5
  clean            nothing (every report there is a false positive)

A trial is detected when a report of the class's kind names exactly the faulty rank; a report of
that kind naming anything else is a false positive. Latency: hang, seconds from the sleep to the
report; stragglers, steps from the start to the confirming check; non_finite, steps from the
injection to the report. Rank work is a sleep, so the timings do not depend on the machine's
speed, only on its load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional

from benchmarks._ranks import format_table, log as _log, run_ranks

CLASSES = ("hang", "straggler_start", "straggler_layer", "non_finite", "clean")
KIND = {"hang": "hang", "straggler_start": "compute_straggler", "straggler_layer": "compute_straggler",
        "non_finite": "sdc"}
WORK_S = 0.02
THRESHOLD_S = 2.0
STEPS = 12


def log(msg: str) -> None:
    _log("detection", msg)


def rank_main(rank: int, world: int, opts: dict, fault: str, faulty: int) -> dict:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lm_resiliency import ReplayHarnessConfig, enable_resiliency
    from lm_resiliency.scout.reports import replay_fault_reports

    class Tower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 16)
            self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.tanh(self.embed(x))
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return self.head(x)

    torch.manual_seed(0)
    model = Tower()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    me = rank == faulty
    state: Dict[str, Any] = {"step": 0, "hang_at": None}
    reports: List[dict] = []

    def work(module: nn.Module, args: Any) -> None:
        slow = 5 if me and fault == "straggler_layer" else 1
        time.sleep(WORK_S * slow)
        if me and fault == "hang" and state["step"] == 6:
            state["hang_at"] = time.time()
            time.sleep(2.5 * THRESHOLD_S)

    def poison(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if me and fault == "non_finite" and state["step"] == 5:
            output = output.clone()
            output[0, 0] = float("nan")
        return output

    model.layers[1].register_forward_pre_hook(work)
    model.layers[1].register_forward_hook(poison)

    def on_result(result: Any) -> None:
        reports.extend(dict(r.to_json(), at_step=result.step) for r in replay_fault_reports(result))

    session = enable_resiliency(
        ddp, optimizer, interval=4, enable_checkpoint=False, fault_callback=on_result,
        oob_fault_callback=lambda r: reports.append(dict(r.to_json(), at_step=state["step"])),
        replay=ReplayHarnessConfig(hang_stall_threshold_s=THRESHOLD_S, monitor_poll_interval_s=0.2))
    for step in range(1, STEPS + 1):
        state["step"] = step
        if me and fault == "straggler_start":
            time.sleep(WORK_S)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * rank + step))
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    session.close()
    return {"reports": reports, "hang_at": state["hang_at"]}


def score(fault: str, faulty: int, results: List[dict]) -> dict:
    """One trial: detected / false positives / latency, from every rank's reports."""
    reports = [r for result in results for r in result["reports"]]
    kinds = {KIND[fault]} if fault in KIND else set(KIND.values())
    relevant = [r for r in reports if r["kind"] in kinds]
    hits = [r for r in relevant if fault != "clean" and r["ranks"] == [faulty]]
    latency: Optional[float] = None
    if hits:
        first = min(hits, key=lambda r: r["detected_at"])
        if fault == "hang":
            hang_at = next(r["hang_at"] for r in results if r["hang_at"] is not None)
            latency = first["detected_at"] - hang_at
        else:
            latency = float(first["at_step"] - (5 if fault == "non_finite" else 0))
    return {"detected": bool(hits), "false_reports": len(relevant) - len(hits), "latency": latency}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="gloo processes (>= 3: stragglers need a majority)")
    p.add_argument("--trials", type=int, default=2, help="trials per class (the faulty rank rotates)")
    p.add_argument("--classes", default=",".join(CLASSES), help="comma-separated subset of " + ",".join(CLASSES))
    p.add_argument("--out", default="benchmarks/results/detection.json", help="JSON results path")
    p.add_argument("--timeout", type=float, default=300.0, help="limit per trial (s)")
    args = p.parse_args(argv)
    classes = [c for c in args.classes.split(",") if c]
    if args.ranks < 3 or args.trials < 1 or any(c not in CLASSES for c in classes):
        p.error(f"--ranks >= 3, --trials >= 1, --classes from {CLASSES}")
    rows, trials = [], []
    for fault in classes:
        scored = []
        for trial in range(args.trials):
            faulty = (3 * trial + 1) % args.ranks  # 1, 0, 3, 2, ... with 4 ranks
            work = tempfile.mkdtemp(prefix="detection-bench-")
            try:
                results = run_ranks(rank_main, args.ranks, {"timeout": args.timeout}, work, fault, faulty,
                                    name=f"detection {fault}", tcp=True)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            scored.append(dict(score(fault, faulty, results), fault=fault, faulty=faulty))
            log(f"{fault} trial {trial} (rank {faulty}): {scored[-1]}")
        trials += scored
        detected = sum(s["detected"] for s in scored)
        false = sum(s["false_reports"] for s in scored)
        latencies = [s["latency"] for s in scored if s["latency"] is not None]
        unit = "s" if fault == "hang" else "steps"
        rows.append({
            "class": fault,
            "trials": len(scored),
            "precision": "-" if detected + false == 0 else f"{detected / (detected + false):.2f}",
            "recall": "-" if fault == "clean" else f"{detected / len(scored):.2f}",
            "FPR": f"{sum(s['false_reports'] > 0 for s in scored) / len(scored):.2f}",
            "latency": f"{statistics.median(latencies):.2f} {unit}" if latencies else "-",
        })
    print(format_table(rows))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "trials": trials, "ranks": args.ranks, "steps": STEPS,
                   "hang_threshold_s": THRESHOLD_S, "load_average": list(os.getloadavg())}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
