"""SCOUT detection campaign under real DDP: precision, recall, false-positive rate and latency per class.

    python -m benchmarks.detection_bench --quick                  # a few minutes on 2 cores
    python -m benchmarks.detection_bench                          # the full campaign (make detection)
    python -m benchmarks.detection_bench --classes sdc --kinds nan,sign_flip --positions final_norm

Every trial trains a small model (an embedding, 3 residual blocks in a ModuleList, a final
LayerNorm, a head) on `--ranks` gloo processes with DDP, AdamW and `enable_resiliency(interval=4)`,
and injects one fault on one rank with the fault kit (`enable_fault_injection`), as a user would:

  sdc         kinds (sign flip, highest exponent bit flip, lowest mantissa bit flip, +1e-3) of one
              element x surfaces (output, parameter, gradient, optimizer state) x positions (the
              embedding, the middle block, the final norm, the head) x lifetimes (recurring from
              step 5, one-shot at the check of step 8, one-shot at step 6 between checks)
  non_finite  the same grid with one NaN
  clean       nothing injected: every report is a false positive
  hang        a rank blocks 2.5 x the 2 s hang threshold in its middle block at step 6, under DDP
              and under FSDP2
  straggler   from step 3 on, a rank sleeps at the start of every iteration until it is about 2x
              (`start_2x`) or 5x (`start_5x`) slower, or its middle block is 5x slower (`layer_5x`)

Trials run in batches in the same processes (`--batch`); a batch that fails is rerun one trial
per process group, and a trial that still fails is scored `error`. Scoring, by-design misses and
the table's columns: benchmarks/_detection_cells.py and benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any, Callable, List, Optional

from benchmarks import _detection_cells as cells_mod
from benchmarks._detection_ranks import run_cells
from benchmarks._ranks import format_table, log as _log, run_ranks

QUICK = dict(kinds=("sign_flip", "low_mantissa_bit", "nan"), surfaces=cells_mod.SURFACES,
             positions=("middle", "final_norm"), lifetimes=("recurring", "at_check"), clean_runs=4,
             stragglers=("start_2x", "layer_5x"))


def log(msg: str) -> None:
    _log("detection", msg)


def _run_batch(batch: List[dict], ranks: int, timeout: float) -> List[List[dict]]:
    work = tempfile.mkdtemp(prefix="detection-bench-")
    try:
        per_rank = run_ranks(run_cells, ranks, {"timeout": timeout * len(batch)}, work, batch,
                             name="detection campaign", tcp=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [[per_rank[r][i] for r in range(ranks)] for i in range(len(batch))]


def run_campaign(cells: List[dict], ranks: int, batch_size: int, timeout: float,
                 on_scored: Callable[[dict], None] = lambda s: None) -> List[dict]:
    """Run and score `cells`; `on_scored` sees each scored trial as it comes."""
    batches: List[List[dict]] = []
    for cell in cells:
        if batches and len(batches[-1]) < batch_size:
            batches[-1].append(cell)
        else:
            batches.append([cell])
    scored = []
    for batch in batches:
        try:
            outcomes: List[Any] = _run_batch(batch, ranks, timeout)
        except RuntimeError as exc:
            if len(batch) == 1:
                outcomes = [exc]
            else:
                log(f"a batch of {len(batch)} failed, rerunning its trials one by one: {str(exc)[:2000]}")
                outcomes = []
                for cell in batch:
                    try:
                        outcomes += _run_batch([cell], ranks, timeout)
                    except RuntimeError as one:
                        outcomes.append(one)
        for cell, outcome in zip(batch, outcomes):
            if isinstance(outcome, RuntimeError):
                result = {"outcome": "error", "false_reports": [], "latency": None, "reason": str(outcome)[-4000:]}
                raw: List[dict] = []
            else:
                result, raw = cells_mod.score(cell, outcome), outcome
            entry = dict(result, cell=cell, name=cells_mod.cell_name(cell), ranks=raw)
            scored.append(entry)
            on_scored(entry)
    return scored


def _csv(value: str, allowed: Any, what: str, p: argparse.ArgumentParser) -> tuple:
    chosen = tuple(v for v in value.split(",") if v)
    bad = [v for v in chosen if v not in allowed]
    if bad:
        p.error(f"--{what}: {bad} not in {list(allowed)}")
    return chosen


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="gloo processes (>= 3: a vote needs a majority)")
    p.add_argument("--trials", type=int, default=1, help="trials per cell (the faulty rank rotates)")
    p.add_argument("--clean-runs", type=int, default=30, help="clean runs")
    p.add_argument("--classes", default=",".join(cells_mod.CLASSES), help="subset of " + ",".join(cells_mod.CLASSES))
    p.add_argument("--kinds", default=",".join(cells_mod.KINDS))
    p.add_argument("--surfaces", default=",".join(cells_mod.SURFACES))
    p.add_argument("--positions", default=",".join(cells_mod.POSITIONS))
    p.add_argument("--lifetimes", default=",".join(cells_mod.LIFETIMES))
    p.add_argument("--frameworks", default=",".join(cells_mod.FRAMEWORKS), help="hang trials")
    p.add_argument("--stragglers", default=",".join(cells_mod.STRAGGLERS))
    p.add_argument("--quick", action="store_true",
                   help="a few minutes: kinds sign_flip,low_mantissa_bit,nan at the middle block and the final "
                        "norm, recurring and at-check, 4 clean runs, stragglers start_2x,layer_5x")
    p.add_argument("--batch", type=int, default=80, help="trials run in the same processes")
    p.add_argument("--out", default="benchmarks/results/detection.json", help="JSON results path")
    p.add_argument("--timeout", type=float, default=120.0, help="limit per trial (s)")
    args = p.parse_args(argv)
    if args.ranks < 3 or args.trials < 1 or args.clean_runs < 0 or args.batch < 1:
        p.error("--ranks >= 3, --trials >= 1, --clean-runs >= 0, --batch >= 1")
    grid = dict(kinds=_csv(args.kinds, cells_mod.KINDS, "kinds", p),
                surfaces=_csv(args.surfaces, cells_mod.SURFACES, "surfaces", p),
                positions=_csv(args.positions, cells_mod.POSITIONS, "positions", p),
                lifetimes=_csv(args.lifetimes, cells_mod.LIFETIMES, "lifetimes", p),
                frameworks=_csv(args.frameworks, cells_mod.FRAMEWORKS, "frameworks", p),
                stragglers=_csv(args.stragglers, cells_mod.STRAGGLERS, "stragglers", p),
                clean_runs=args.clean_runs)
    if args.quick:
        grid.update(QUICK)
    todo = cells_mod.cells(_csv(args.classes, cells_mod.CLASSES, "classes", p), args.trials, args.ranks, **grid)
    log(f"{len(todo)} trials on {args.ranks} ranks")
    started = time.time()
    scored = run_campaign(todo, args.ranks, args.batch, args.timeout,
                          on_scored=lambda s: log(f"{s['name']}: {s['outcome']}"
                                                  + (f" latency {s['latency']}" if s["latency"] is not None else "")
                                                  + (f", {len(s['false_reports'])} false" if s["false_reports"] else "")))
    rows = cells_mod.summarize(scored)
    coverage = next((s["ranks"][0]["coverage"] for s in scored if s["ranks"] and s["cell"].get("framework") != "fsdp2"),
                    None)
    if coverage is not None:
        print(f"SCOUT coverage of the DDP model: {coverage['parameters']:.0%} of the parameters "
              f"({coverage['bytes']:.0%} of their bytes) in one rotation of {coverage['checks']} checks, "
              f"{coverage['steps']} steps" + (f"; not reached: {coverage['uncovered']}" if coverage["uncovered"] else ""))
    print(format_table(rows))
    for title, outcome in (("misses", "miss"), ("by-design misses", "by_design"), ("masked", "masked"),
                           ("not injected / errors", "not_injected"), ("", "error")):
        listed = [s for s in scored if s["outcome"] == outcome]
        if listed:
            print(f"\n{title or 'errors'} ({len(listed)}):")
            for s in listed:
                print(f"  {s['name']}" + (f": {s['reason'][:200]}" if s["reason"] else ""))
    false = [(s["name"], r) for s in scored for r in s["false_reports"]]
    if false:
        print(f"\nfalse reports ({len(false)}):")
        for name, r in false:
            print(f"  {name}: {r['kind']} ranks={r['ranks']} resource={r['resource']} step={r['step']} "
                  f"{json.dumps(r.get('evidence', {}))}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "coverage": coverage, "trials": scored, "ranks": args.ranks, "steps": cells_mod.STEPS,
                   "interval": cells_mod.INTERVAL, "hang_threshold_s": cells_mod.HANG_THRESHOLD_S,
                   "seconds": round(time.time() - started, 1), "load_average": list(os.getloadavg())}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
