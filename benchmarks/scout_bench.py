"""SCOUT replay overhead on DDP training: cost per check and amortized overhead at interval 10.

    python -m benchmarks.scout_bench [--ranks 4] [--rounds 4] [--steps 50] [--out benchmarks/results/scout.json]

`--ranks` real processes joined by gloo (TCPStore, as under torchrun) train a small language
model (an `nn.Embedding`, `--blocks` residual MLP blocks in an `nn.ModuleList`, a vocabulary
head) with DDP and Adam, one thread each. A check replays the embedding, one block and the
head; with the default 24 blocks that is 11.5% of the model's per-token multiply-adds, close to
a Llama-3-8B's 10% (one of 32 blocks and its head), so the replayed share of a step is that of a
real decoder. `--blocks 4` makes the replayed modules half the model, a worst case. Configurations live side by side in the same
processes, each with its own model and optimizer (same initial weights): the unchanged loop
(baseline), the loop under `enable_resiliency(..., interval=10, enable_checkpoint=False)`
(SCOUT only, every check class every 10 steps) and, unless `--no-interval-1`, the same at
interval 1. After a warm-up, the configurations run in interleaved rounds of `--steps` steps,
rotating the order each round, so background load on a shared machine hits all of them alike.

Measured in the benchmark processes by wrapping class attributes (library files are not
modified): training-thread time inside the session's `_before_forward` (arms the capture
hook), `_before_optimizer_step` (replay, vote, straggler timing, collective probe) and
`_after_optimizer_step` (progress beacon), the capture hook's input clone during the forward,
and a breakdown of each check (replay per check class, optimizer check, signatures, the
replay's JSON all-gathers and broadcasts, the collective probe, which runs every
`ReplayHarnessConfig.probe_interval` steps). A distributed number is the slowest rank's. See
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from benchmarks._ranks import format_table, gather, pct, run_ranks
from benchmarks._ranks import log as _log

TARGET_PCT = 2.0            # amortized SCOUT overhead at interval 10, % of the baseline p50 step
MAIN_INTERVAL = 10

# Per-step accumulators, filled by the wrappers below (one configuration trains at a time in a
# rank process, so one accumulator per name suffices).
_HOOKS = ("_before_forward", "_before_optimizer_step", "_after_optimizer_step")
_PARTS = ("capture", "run", "probe", "signatures", "replay_embedding", "replay_hidden", "replay_output",
          "optimizer_check", "json_gather", "broadcast")
_ACC: Dict[str, float] = {name: 0.0 for name in _HOOKS + _PARTS}
FIELDS = ("step",) + _HOOKS + _PARTS
_IN_PROBE = [False]  # the probe's own JSON gather belongs to the probe, not to the replay


def replayed_share(vocab: int, dim: int, blocks: int) -> float:
    """The per-token multiply-adds of the modules a check replays (the embedding is a lookup, one
    dim -> 4 dim -> dim block, the dim -> vocab head) over the whole model's."""
    block, head = 8 * dim * dim, dim * vocab
    return (block + head) / (blocks * block + head)


def log(msg: str) -> None:
    _log("scout-bench", msg)


def _timed(original: Callable, key: Callable[..., Optional[str]]) -> Callable:
    def wrapper(*args, **kwargs):
        name = key(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if name is not None:
                _ACC[name] += time.perf_counter() - t0

    wrapper._scout_bench = True  # type: ignore[attr-defined]
    return wrapper


def _wrap(owner: Any, name: str, key: Callable[..., Optional[str]]) -> None:
    original = getattr(owner, name)
    if not getattr(original, "_scout_bench", False):
        setattr(owner, name, _timed(original, key))


def install_timers() -> None:
    """Wrap session hooks and SCOUT internals (class attributes and module globals are looked up
    at call time, so objects built before or after this see the wrappers)."""
    import torch.distributed as dist

    from lm_resiliency import wire
    from lm_resiliency.scout import probes, replay
    from lm_resiliency.session import ResiliencySession

    for name in _HOOKS:
        _wrap(ResiliencySession, name, lambda *a, _n=name, **k: _n)
    _wrap(replay._Capture, "__call__", lambda *a, **k: "capture")
    _wrap(replay.ReplayDetector, "run", lambda *a, **k: "run")
    _wrap(replay.ReplayDetector, "_optimizer_check", lambda *a, **k: "optimizer_check")
    _wrap(replay.ReplayDetector, "_replay_one", lambda self, check, *a, **k: f"replay_{check}")
    measure = probes.CollectiveProbe.measure
    if not getattr(measure, "_scout_bench", False):
        def probe_measure(*args, **kwargs):
            _IN_PROBE[0] = True
            try:
                return measure(*args, **kwargs)
            finally:
                _IN_PROBE[0] = False

        probes.CollectiveProbe.measure = probe_measure
        _wrap(probes.CollectiveProbe, "measure", lambda *a, **k: "probe")
    _wrap(wire, "all_gather_json", lambda *a, **k: None if _IN_PROBE[0] else "json_gather")
    _wrap(dist, "broadcast", lambda *a, **k: "broadcast")
    # replay.py calls these through its own module globals; signature.py's internal calls are not
    # wrapped, so nothing is counted twice.
    _wrap(replay, "structure_signature", lambda *a, **k: "signatures")
    _wrap(replay, "tensor_signature", lambda *a, **k: "signatures")


def take() -> Dict[str, float]:
    out = dict(_ACC)
    for name in _ACC:
        _ACC[name] = 0.0
    return out


def mean(values: List[float]) -> Optional[float]:
    return statistics.mean(values) if values else None


# ----------------------------------------------------------------------------- rank side


class Config:
    def __init__(self, name: str, interval: Optional[int]) -> None:
        self.name = name
        self.interval = interval
        self.model = None
        self.ddp = None
        self.optimizer = None
        self.session = None
        self.rounds: List[dict] = []
        self.faults: List[dict] = []
        self.oob: List[dict] = []


def rank_main(rank: int, world: int, opts: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lm_resiliency import enable_resiliency
    from lm_resiliency.scout.reports import replay_fault_reports

    say = log if rank == 0 else (lambda m: None)
    install_timers()
    vocab, dim, blocks, seq = opts["vocab"], opts["dim"], opts["blocks"], opts["seq"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(dim, 4 * dim)
            self.fc2 = nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.fc2(nn.functional.gelu(self.fc1(x)))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.head = nn.Linear(dim, vocab)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    def build(cfg: Config) -> None:
        torch.manual_seed(0)
        cfg.model = TinyLM()
        cfg.ddp = DDP(cfg.model)
        cfg.optimizer = torch.optim.Adam(cfg.model.parameters(), lr=1e-4)

    gen = torch.Generator().manual_seed(100 + rank)
    batches: Dict[int, tuple] = {}

    def batch(n: int) -> tuple:
        if n not in batches:
            batches[n] = (torch.randint(0, vocab, (n, seq), generator=gen),
                          torch.randint(0, vocab, (n, seq), generator=gen))
        return batches[n]

    def step(cfg: Config, x, y) -> None:
        logits = cfg.ddp(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        cfg.optimizer.step()
        cfg.optimizer.zero_grad(set_to_none=True)

    configs = [Config("baseline", None), Config(f"SCOUT interval {MAIN_INTERVAL}", MAIN_INTERVAL)]
    if opts["interval_1"]:
        configs.append(Config("SCOUT interval 1", 1))
    for cfg in configs:
        build(cfg)
    params = sum(p.numel() for p in configs[0].model.parameters())

    # --- batch size: grow it until the baseline step reaches --step-ms (fastest of 3 probes,
    # slowest rank each, so every rank decides from the same numbers).
    base = configs[0]
    target = opts["step_ms"] / 1000.0
    calibration: Dict[str, Any] = {}
    if opts["batch"] > 0:
        batch_size = opts["batch"]
    else:
        def probe(n: int) -> float:
            bx, by = batch(n)
            step(base, bx, by)
            times = []
            for _ in range(3):
                dist.barrier()
                t0 = time.perf_counter()
                step(base, bx, by)
                times.append(max(r[0] for r in gather([time.perf_counter() - t0], world)))
            return min(times)

        batch_size, probes = 2, {}
        for _ in range(8):
            probes[batch_size] = probe(batch_size)
            t = probes[batch_size]
            if t >= 0.9 * target or batch_size >= opts["max_batch"]:
                break
            grow = min(4.0, max(1.25, target / t))
            batch_size = min(opts["max_batch"], max(batch_size + 1, int(round(batch_size * grow))))
        calibration = {"probe_step_s": {str(k): v for k, v in probes.items()}, "target_s": target}
        say("calibration: " + ", ".join(f"batch {k}: {v * 1e3:.0f} ms" for k, v in probes.items())
            + f" -> batch {batch_size} x {seq} tokens (target {opts['step_ms']:.0f} ms; the smallest batch is 2)")
    batches.clear()
    x, y = batch(batch_size)

    # --- sessions (collective: every rank enables them in the same order)
    for cfg in configs:
        if cfg.interval is None:
            continue

        def on_fault(result, _cfg=cfg) -> None:
            _cfg.faults.append({"step": result.step, "reports": [r.to_json() for r in replay_fault_reports(result)]})

        def on_oob(report, _cfg=cfg) -> None:
            _cfg.oob.append(report.to_json())

        t0 = time.perf_counter()
        cfg.session = enable_resiliency(cfg.ddp, cfg.optimizer, interval=cfg.interval, enable_checkpoint=False,
                                        fault_callback=on_fault, oob_fault_callback=on_oob)
        cfg.enable_s = time.perf_counter() - t0
        say(f"{cfg.name}: enable_resiliency took {cfg.enable_s:.2f} s")

    # --- warm-up: two checks for a SCOUT configuration (first gloo use of the replay and probe
    # groups), 5 steps for the baseline; step counts stay multiples of the interval.
    for cfg in configs:
        n = 5 if cfg.interval is None else 2 * MAIN_INTERVAL
        t0 = time.perf_counter()
        for _ in range(n):
            step(cfg, x, y)
        take()
        say(f"warm-up {cfg.name}: {n} steps in {time.perf_counter() - t0:.1f} s")

    steps = opts["steps"]
    for rnd in range(opts["rounds"]):
        order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
        for cfg in order:
            local: Dict[str, List[float]] = {f: [] for f in FIELDS}
            checks: List[bool] = []
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                session = cfg.session
                checks.append(bool(session is not None and session.scout.check_due(session.step_count + 1)))
                s0 = time.perf_counter()
                step(cfg, x, y)
                local["step"].append(time.perf_counter() - s0)
                parts = take()
                for name in FIELDS[1:]:
                    local[name].append(parts[name])
            wall = time.perf_counter() - t0
            g = gather([wall] + [v for f in FIELDS for v in local[f]], world)
            rec: Dict[str, Any] = {"round": rnd, "wall_s": max(r[0] for r in g), "checks": checks,
                                   "per_rank_wall_s": [r[0] for r in g]}
            for j, f in enumerate(FIELDS):
                off = 1 + j * steps
                rec[f] = [max(r[off + i] for r in g) for i in range(steps)]        # slowest rank
                rec[f + "_rank_mean"] = [statistics.mean(r[off + i] for r in g) for i in range(steps)]
            cfg.rounds.append(rec)
            say(f"round {rnd + 1}/{opts['rounds']} {cfg.name}: {steps / rec['wall_s']:.2f} steps/s, "
                f"p50 {statistics.median(rec['step']) * 1e3:.0f} ms, "
                f"scout {sum(map(sum, (rec[h] for h in _HOOKS + ('capture',)))) * 1e3:.0f} ms")

    out: Dict[str, Any] = {"batch": batch_size, "calibration": calibration, "params": params, "configs": []}
    for cfg in configs:
        entry: Dict[str, Any] = {"name": cfg.name, "interval": cfg.interval, "rounds": cfg.rounds}
        if cfg.session is not None:
            detector = cfg.session.scout.detector
            entry.update(enable_s=cfg.enable_s, faults=cfg.faults, oob_reports=cfg.oob,
                         step_count=cfg.session.step_count,
                         catalog={"embedding": detector.catalog.embedding[0],
                                  "hidden": [p for p, _ in detector.catalog.hidden],
                                  "output": detector.catalog.output[0]},
                         probe=cfg.session.scout._probe is not None,
                         probe_interval=cfg.session.scout.config.probe_interval,
                         group_ranks=list(detector.group_ranks))
            cfg.session.close()
        out["configs"].append(entry)
    dist.barrier()
    return out


# ----------------------------------------------------------------------------- report


def summarize(entry: dict) -> dict:
    rounds = entry["rounds"]
    flat = {f: [v for r in rounds for v in r[f]] for f in FIELDS}
    # Mean over ranks: additive within a rank, so the breakdown of a check sums up (the slowest
    # rank of each part need not be the same rank).
    avg = {f: [v for r in rounds for v in r[f + "_rank_mean"]] for f in FIELDS}
    checks = [c for r in rounds for c in r["checks"]]
    steps = len(flat["step"])
    wall = sum(r["wall_s"] for r in rounds)
    scout = [sum(flat[h][i] for h in _HOOKS) + flat["capture"][i] for i in range(steps)]
    on = [i for i in range(steps) if checks[i]]
    off = [i for i in range(steps) if not checks[i]]
    probed = [i for i in on if flat["probe"][i] > 0]
    unprobed = [i for i in on if flat["probe"][i] == 0]

    def at(field: str, idx: List[int]) -> List[float]:
        return [flat[field][i] for i in idx]

    s: Dict[str, Any] = {
        "name": entry["name"], "interval": entry["interval"], "steps": steps, "checks": len(on), "wall_s": wall,
        "steps_per_s": steps / wall,
        "per_round_steps_per_s": [len(r["step"]) / r["wall_s"] for r in rounds],
        "step_p50_s": pct(flat["step"], 50), "step_p95_s": pct(flat["step"], 95),
        "step_mean_s": statistics.mean(flat["step"]),
        "check_step_mean_s": mean(at("step", on)), "other_step_mean_s": mean(at("step", off)),
        "scout_mean_per_step_s": statistics.mean(scout),
        "probes": len(probed), "probe_interval": entry.get("probe_interval"),
    }
    if entry["interval"] is not None and on:
        bos = at("_before_optimizer_step", on)
        s["per_check"] = {
            "before_optimizer_step_mean_s": statistics.mean(bos),
            "before_optimizer_step_p50_s": pct(bos, 50),
            "before_optimizer_step_p95_s": pct(bos, 95),
            "before_forward_arm_mean_s": statistics.mean(at("_before_forward", on)),
            "capture_clone_mean_s": statistics.mean(at("capture", on)),
            "rank_mean": {p: statistics.mean([avg[p][i] for i in on])
                          for p in ("_before_optimizer_step",) + _PARTS if p != "capture"},
            # Checks without the probe (most of them) and the probe's own cost where it ran.
            "without_probe_mean_s": mean(at("_before_optimizer_step", unprobed)),
            "without_probe_rank_mean": {p: mean([avg[p][i] for i in unprobed])
                                        for p in ("_before_optimizer_step",) + _PARTS if p != "capture"},
            "probe_mean_s": mean(at("probe", probed)),
            "probe_rank_mean_s": mean([avg["probe"][i] for i in probed]),
        }
        s["per_step_without_check"] = {h: mean(at(h, off)) for h in _HOOKS}
    return s


def build_rows(summaries: List[dict]) -> List[dict]:
    base = summaries[0]
    p50 = base["step_p50_s"]
    rows = []
    for s in summaries:
        is_base = s["interval"] is None
        loss = (1.0 - s["steps_per_s"] / base["steps_per_s"]) * 100.0
        per_round = [(1.0 - c / b) * 100.0 for c, b in zip(s["per_round_steps_per_s"], base["per_round_steps_per_s"])]
        s["throughput_loss_pct"] = None if is_base else loss
        s["median_round_throughput_loss_pct"] = None if is_base else statistics.median(per_round)
        amortized = s["scout_mean_per_step_s"] / p50 * 100.0
        s["amortized_overhead_pct"] = None if is_base else amortized
        main = s["interval"] == MAIN_INTERVAL
        s["result"] = ("PASS" if amortized < TARGET_PCT else "MISS") if main else "-"
        pc = s.get("per_check")
        rows.append({
            "config": s["name"],
            "p50 step": f"{s['step_p50_s'] * 1e3:.1f} ms",
            "p95 step": f"{s['step_p95_s'] * 1e3:.1f} ms",
            "checks/probes": "-" if is_base else f"{s['checks']}/{s['probes']}",
            "per check p50/p95 (% of step)": "-" if not pc else
            f"{pc['before_optimizer_step_p50_s'] * 1e3:.1f}/{pc['before_optimizer_step_p95_s'] * 1e3:.1f} ms "
            f"({pc['before_optimizer_step_p50_s'] / p50 * 100:.0f}%)",
            "probe": "-" if not pc or pc["probe_mean_s"] is None else f"{pc['probe_mean_s'] * 1e3:.1f} ms",
            "arm+capture": "-" if not pc else
            f"{pc['before_forward_arm_mean_s'] * 1e3:.2f}+{pc['capture_clone_mean_s'] * 1e3:.2f} ms",
            "amortized": "-" if is_base else f"{amortized:.2f}%",
            "throughput loss": "-" if is_base else f"{loss:+.2f}%",
            "target": f"< {TARGET_PCT:g}%" if main else "-",
            "result": s["result"],
        })
    return rows


def breakdown(s: dict) -> str:
    """Where one check's time goes (mean over ranks, checks without the probe), and the probe."""
    pc = s["per_check"]
    b = pc["without_probe_rank_mean"]
    lines = [f"{s['name']}: one check (mean over ranks, {s['checks'] - s['probes']} checks without the probe): "
             f"{pc['without_probe_mean_s'] * 1e3:.1f} ms slowest rank"]
    if b["_before_optimizer_step"] is not None:
        replays = b["replay_embedding"] + b["replay_hidden"] + b["replay_output"] + b["optimizer_check"]
        parts = [("replay (forward, backward) + shadow optimizer step", replays - b["signatures"]),
                 ("signatures", b["signatures"]), ("JSON all-gathers (plan, signatures)", b["json_gather"]),
                 ("input broadcasts", b["broadcast"]),
                 ("rest (encode/decode, vote, straggler statistics)", b["_before_optimizer_step"] - replays
                  - b["json_gather"] - b["broadcast"])]
        lines.append(f"  {b['_before_optimizer_step'] * 1e3:.1f} ms = " + " + ".join(
            f"{name} {value * 1e3:.1f}" for name, value in parts))
        lines.append(f"  replay+signatures per class: embedding {b['replay_embedding'] * 1e3:.1f}, hidden "
                     f"{b['replay_hidden'] * 1e3:.1f}, output {b['replay_output'] * 1e3:.1f}, optimizer "
                     f"{b['optimizer_check'] * 1e3:.1f} ms")
    if pc["probe_mean_s"] is not None:
        lines.append(f"  collective probe: {pc['probe_rank_mean_s'] * 1e3:.1f} ms mean over ranks at the {s['probes']} "
                     f"checks where it ran (every {s['probe_interval']} steps)")
    off = s["per_step_without_check"]
    lines.append(f"  steps without a check: _before_forward {off['_before_forward'] * 1e6:.0f} us, "
                 f"_before_optimizer_step {off['_before_optimizer_step'] * 1e6:.0f} us, _after_optimizer_step "
                 f"{off['_after_optimizer_step'] * 1e6:.0f} us; mean step {s['check_step_mean_s'] * 1e3:.1f} ms with a "
                 f"check vs {s['other_step_mean_s'] * 1e3:.1f} ms without")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="gloo processes on this machine (>= 3 for rank localization)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary (embedding rows, head outputs)")
    p.add_argument("--dim", type=int, default=256, help="model width (MLP blocks are dim -> 4*dim -> dim)")
    p.add_argument("--blocks", type=int, default=24,
                   help="residual MLP blocks (the hidden check rotates over them); 4 is the worst case")
    p.add_argument("--seq", type=int, default=64, help="tokens per sample")
    p.add_argument("--batch", type=int, default=0, help="per-rank batch size (0: calibrate to --step-ms)")
    p.add_argument("--step-ms", type=float, default=600.0, help="baseline step time the batch is sized for")
    p.add_argument("--max-batch", type=int, default=64, help="largest batch the calibration may pick")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=50,
                   help=f"training steps per configuration per round (a multiple of {MAIN_INTERVAL})")
    p.add_argument("--no-interval-1", dest="interval_1", action="store_false",
                   help="skip the SCOUT interval 1 configuration")
    p.add_argument("--out", default="benchmarks/results/scout.json", help="JSON results path")
    p.add_argument("--timeout", type=float, default=1800.0, help="limit for the whole run and every wait (s)")
    args = p.parse_args(argv)
    if args.ranks < 2:
        p.error("--ranks must be >= 2")
    if min(args.vocab, args.dim, args.blocks, args.seq, args.rounds, args.steps) < 1 or args.batch < 0:
        p.error("sizes, --rounds and --steps must be positive, --batch >= 0")
    if args.blocks < 2:
        p.error("--blocks must be >= 2 (SCOUT's hidden check needs a ModuleList of at least two blocks)")
    if args.steps % MAIN_INTERVAL:
        p.error(f"--steps must be a multiple of {MAIN_INTERVAL} so every round holds the same number of checks")

    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="scout-bench-")
    opts = {k: getattr(args, k) for k in ("vocab", "dim", "blocks", "seq", "batch", "step_ms", "max_batch", "rounds",
                                          "steps", "interval_1", "timeout")}
    load_start = list(os.getloadavg())
    log(f"{args.ranks} ranks, TinyLM vocab {args.vocab} dim {args.dim} x {args.blocks} blocks, {args.rounds} rounds "
        f"x {args.steps} steps per configuration (load average {load_start[0]:.2f})")
    try:
        results = run_ranks(rank_main, args.ranks, opts, work, name="SCOUT benchmark", tcp=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_end = list(os.getloadavg())
    r0 = results[0]
    summaries = [summarize(e) for e in r0["configs"]]
    rows = build_rows(summaries)
    import torch

    base = summaries[0]
    spread = base["per_round_steps_per_s"]
    noise = (max(spread) - min(spread)) / statistics.mean(spread) * 100.0
    false_alarms = {e["name"]: len(e.get("faults", [])) for e in r0["configs"][1:]}
    oob = {e["name"]: len(e.get("oob_reports", [])) for e in r0["configs"][1:]}
    share = replayed_share(args.vocab, args.dim, args.blocks)
    result = {
        "benchmark": "scout",
        "config": {"ranks": args.ranks, "model": {"vocab": args.vocab, "dim": args.dim, "blocks": args.blocks,
                                                  "seq": args.seq, "params": r0["params"],
                                                  "replayed_share_of_macs": share},
                   "batch": r0["batch"], "step_ms_target": args.step_ms, "rounds": args.rounds,
                   "steps_per_round": args.steps, "optimizer": "Adam", "wrapper": "DDP",
                   "enable_checkpoint": False, "replay_defaults": "ReplayHarnessConfig() with interval=N"},
        "environment": {"loadavg_start": load_start, "loadavg_end": load_end, "torch": torch.__version__,
                        "python": platform.python_version(), "platform": platform.platform(),
                        "cpus": os.cpu_count(), "device": "cpu", "backend": "gloo", "store": "TCPStore",
                        "threads_per_rank": 1},
        "target": {"amortized_overhead_pct_at_interval_10": TARGET_PCT},
        "calibration": r0["calibration"],
        "rows": rows,
        "summaries": summaries,
        "baseline_round_spread_pct": noise,
        "unhealthy_replay_results": false_alarms,
        "oob_reports": oob,
        "per_config": r0["configs"],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

    main_cfg = next((s for s in summaries if s["interval"] == MAIN_INTERVAL), None)
    catalog = r0["configs"][1].get("catalog", {})
    print(f"SCOUT overhead: {args.ranks} ranks (gloo, TCPStore, 1 thread each) on {os.cpu_count()} CPUs, DDP TinyLM "
          f"({r0['params'] / 1e6:.1f} M params: embedding {args.vocab}x{args.dim}, {args.blocks} MLP blocks, head) + "
          f"Adam, batch {r0['batch']} x {args.seq} tokens/rank, torch {torch.__version__}; a check replays the "
          f"embedding, one block and the head: {share * 100:.1f}% of the model's per-token multiply-adds")
    print(f"{args.rounds} interleaved rounds x {args.steps} steps per config (order rotated), enable_checkpoint=False, "
          f"replay peers {r0['configs'][1].get('group_ranks')}, collective probe "
          f"{'on' if r0['configs'][1].get('probe') else 'off (needs > 2 ranks)'}; catalog: embedding "
          f"{catalog.get('embedding')!r}, hidden {catalog.get('hidden')}, output {catalog.get('output')!r}; "
          f"load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end")
    print(f"baseline step: p50 {base['step_p50_s'] * 1e3:.1f} ms, p95 {base['step_p95_s'] * 1e3:.1f} ms (slowest "
          f"rank per step); baseline round-to-round throughput spread {noise:.1f}%")
    print(format_table(rows))
    if main_cfg and main_cfg.get("per_check"):
        print(breakdown(main_cfg))
    print(f"unhealthy replay results (false alarms on healthy hardware): {false_alarms}; OOB reports: {oob}")
    print("per check = slowest rank's time inside the session's _before_optimizer_step at a step with a check "
          "(probe included where it ran); probe = the collective probe where it ran (every probe_interval steps); "
          "arm+capture = _before_forward at that step + the capture hook's input clone in the forward; "
          "amortized = mean SCOUT training-thread time per step (all hooks + capture) / baseline p50 step, "
          f"target < {TARGET_PCT:g}% at interval {MAIN_INTERVAL}; throughput loss = 1 - steps/s / baseline steps/s "
          "(includes the OOB monitor thread; compare with the baseline spread).")
    print(f"CPU caveat: {os.cpu_count()} cores run {args.ranks} single-threaded ranks; replay, signature hashing "
          "and the gloo probe compete with training for the same cores.")
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
