"""SCOUT replay overhead on DDP and MoE training: cost per check and amortized overhead at interval 10.

    python -m benchmarks.scout_bench [--part all|dense|moe] [--ranks 4] [--rounds 4] [--steps 50]
                                     [--out benchmarks/results/scout.json]

The dense part is described here; `--part moe` runs the MoE part (benchmarks/_moe_bench.py) by
the same method.

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
from typing import Any, Callable, Dict, List, Optional, Tuple

from benchmarks._ranks import calibrate_batch, format_table, gather, pct, run_ranks
from benchmarks._ranks import log as _log

TARGET_PCT = 2.0            # amortized SCOUT overhead at interval 10, % of the baseline p50 step
MAIN_INTERVAL = 10

# Per-step accumulators, filled by the wrappers below (one configuration trains at a time in a
# rank process, so one accumulator per name suffices).
_HOOKS = ("_before_forward", "_before_optimizer_step", "_after_optimizer_step")
_PARTS = ("capture", "run", "probe", "signatures", "replay_embedding", "replay_hidden", "replay_output",
          "replay_expert", "optimizer_check", "json_gather", "broadcast", "all_to_all", "all_to_all_record")
_ACC: Dict[str, float] = {name: 0.0 for name in _HOOKS + _PARTS}
_IN_FORWARD = ("capture", "all_to_all_record")  # SCOUT time outside the hooks, in the training forward
FIELDS = ("step",) + _HOOKS + _PARTS
_REPLAYED = ("embedding", "hidden", "output", "expert")   # replay_<check class> parts
_OWNED = [False]  # JSON gathers of the probe and of the AllToAll replay belong to them, not to the replay


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


def _own_gathers(owner: Any, name: str, part: str) -> None:
    """Time `owner.name` as `part`, with the JSON all-gathers it makes counted in it only."""
    original = getattr(owner, name)
    if getattr(original, "_scout_bench", False):
        return

    def owning(*args, **kwargs):
        _OWNED[0] = True
        try:
            return original(*args, **kwargs)
        finally:
            _OWNED[0] = False

    setattr(owner, name, owning)
    _wrap(owner, name, lambda *a, **k: part)


def install_timers() -> None:
    """Wrap session hooks and SCOUT internals (class attributes and module globals are looked up
    at call time, so objects built before or after this see the wrappers)."""
    import torch.distributed as dist

    from lm_resiliency import wire
    from lm_resiliency.scout import alltoall, probes, replay
    from lm_resiliency.session import ResiliencySession

    for name in _HOOKS:
        _wrap(ResiliencySession, name, lambda *a, _n=name, **k: _n)
    _wrap(replay._Capture, "__call__", lambda *a, **k: "capture")
    _wrap(replay.ReplayDetector, "run", lambda *a, **k: "run")
    _wrap(replay.ReplayDetector, "_optimizer_check", lambda *a, **k: "optimizer_check")
    _wrap(replay.ReplayDetector, "_replay_one", lambda self, check, *a, **k: f"replay_{check}")
    _own_gathers(probes.CollectiveProbe, "measure", "probe")
    _own_gathers(alltoall.AllToAllReplayer, "run", "all_to_all")
    _wrap(wire, "all_gather_json", lambda *a, **k: None if _OWNED[0] else "json_gather")
    _wrap(dist, "broadcast", lambda *a, **k: "broadcast")
    # replay.py calls these through its own module globals; signature.py's internal calls are not
    # wrapped, so nothing is counted twice.
    _wrap(replay, "structure_signature", lambda *a, **k: "signatures")
    _wrap(replay, "tensor_signature", lambda *a, **k: "signatures")
    # The AllToAll recorder reads each call's layout in the check step's forward (it is installed
    # and removed inside the hooks, which count that).
    _wrap(alltoall, "_single_call", lambda *a, **k: "all_to_all_record")
    _wrap(alltoall, "_list_call", lambda *a, **k: "all_to_all_record")


def take() -> Dict[str, float]:
    out = dict(_ACC)
    for name in _ACC:
        _ACC[name] = 0.0
    return out


def mean(values: List[float]) -> Optional[float]:
    return statistics.mean(values) if values else None


# ----------------------------------------------------------------------------- rank side


class Config:
    def __init__(self, name: str, interval: Optional[int], **options: Any) -> None:
        self.name = name
        self.interval = interval
        self.options = options      # what a rank_main needs to build this configuration's session
        self.model: Any = None
        self.ddp: Any = None
        self.optimizer: Any = None
        self.session: Any = None
        self.enable_s = 0.0
        self.rounds: List[dict] = []
        self.faults: List[dict] = []
        self.oob: List[dict] = []


def calibrate(probe_step: Callable[[int], None], opts: dict, world: int, say: Callable[[str], None]
              ) -> Tuple[int, Dict[str, Any]]:
    """(per-rank batch, calibration record): `opts["batch"]`, or the batch grown from 2 until the
    baseline step `probe_step(batch)` reaches 90% of `opts["step_ms"]` (`calibrate_batch`)."""
    if opts["batch"] > 0:
        return opts["batch"], {}
    target = opts["step_ms"] / 1000.0
    batch_size, probes = calibrate_batch(probe_step, world, target, opts["max_batch"], start=2, fraction=0.9)
    say("calibration: " + ", ".join(f"batch {k}: {v * 1e3:.0f} ms" for k, v in probes.items())
        + f" -> batch {batch_size} x {opts['seq']} tokens (target {opts['step_ms']:.0f} ms; the smallest batch is 2)")
    return batch_size, {"probe_step_s": {str(k): v for k, v in probes.items()}, "target_s": target}


def enable_sessions(configs: List[Config], enable: Callable[..., Any], say: Callable[[str], None]) -> None:
    """`cfg.session = enable(cfg, fault_callback=..., oob_fault_callback=...)` for every SCOUT
    configuration (collective: every rank enables them in the same order)."""
    from lm_resiliency.scout.reports import replay_fault_reports

    for cfg in configs:
        if cfg.interval is None:
            continue

        def on_fault(result, _cfg=cfg) -> None:
            _cfg.faults.append({"step": result.step, "reports": [r.to_json() for r in replay_fault_reports(result)]})

        def on_oob(report, _cfg=cfg) -> None:
            _cfg.oob.append(report.to_json())

        t0 = time.perf_counter()
        cfg.session = enable(cfg, fault_callback=on_fault, oob_fault_callback=on_oob)
        cfg.enable_s = time.perf_counter() - t0
        say(f"{cfg.name}: enable_resiliency took {cfg.enable_s:.2f} s")


def run_rounds(configs: List[Config], train: Callable[[Config], None], opts: dict, world: int,
               say: Callable[[str], None]) -> None:
    """Warm-up, then `opts["rounds"]` interleaved rounds of `opts["steps"]` `train(cfg)` steps per
    configuration, the order rotated each round; per-step times and timer parts land in cfg.rounds."""
    import torch.distributed as dist

    # Warm-up: two checks for a SCOUT configuration (first gloo use of the replay and probe
    # groups), 5 steps for the baseline; step counts stay multiples of the interval.
    for cfg in configs:
        n = 5 if cfg.interval is None else 2 * MAIN_INTERVAL
        t0 = time.perf_counter()
        for _ in range(n):
            train(cfg)
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
                train(cfg)
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
                f"scout {sum(map(sum, (rec[h] for h in _HOOKS + _IN_FORWARD))) * 1e3:.0f} ms")


def config_entries(configs: List[Config], describe: Callable[[Config], Dict[str, Any]]) -> List[dict]:
    """Every configuration's rounds and session facts (`describe(cfg)` adds its own); closes the sessions."""
    import torch.distributed as dist

    entries = []
    for cfg in configs:
        entry: Dict[str, Any] = {"name": cfg.name, "interval": cfg.interval, "rounds": cfg.rounds}
        if cfg.session is not None:
            entry.update(enable_s=cfg.enable_s, faults=cfg.faults, oob_reports=cfg.oob,
                         step_count=cfg.session.step_count, probe=cfg.session.scout._probe is not None,
                         probe_interval=cfg.session.scout.config.probe_interval, **describe(cfg))
            cfg.session.close()
        entries.append(entry)
    dist.barrier()
    return entries


def rank_main(rank: int, world: int, opts: dict) -> dict:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lm_resiliency import enable_resiliency

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

    batch_size, calibration = calibrate(lambda n: step(configs[0], *batch(n)), opts, world, say)
    batches.clear()
    x, y = batch(batch_size)
    enable_sessions(configs, lambda cfg, **callbacks: enable_resiliency(
        cfg.ddp, cfg.optimizer, interval=cfg.interval, enable_checkpoint=False, **callbacks), say)
    run_rounds(configs, lambda cfg: step(cfg, x, y), opts, world, say)

    def describe(cfg: Config) -> Dict[str, Any]:
        detector = cfg.session.scout.detector
        return {"catalog": {"embedding": detector.catalog.embedding[0],
                            "hidden": [p for p, _ in detector.catalog.hidden],
                            "output": detector.catalog.output[0]},
                "group_ranks": list(detector.group_ranks)}

    return {"batch": batch_size, "calibration": calibration, "params": params,
            "configs": config_entries(configs, describe)}


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
    scout = [sum(flat[h][i] for h in _HOOKS + _IN_FORWARD) for i in range(steps)]
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
            "all_to_all_record_mean_s": statistics.mean(at("all_to_all_record", on)),
            "rank_mean": {p: statistics.mean([avg[p][i] for i in on])
                          for p in ("_before_optimizer_step",) + _PARTS if p not in _IN_FORWARD},
            # Checks without the probe (most of them) and the probe's own cost where it ran.
            "without_probe_mean_s": mean(at("_before_optimizer_step", unprobed)),
            "without_probe_rank_mean": {p: mean([avg[p][i] for i in unprobed])
                                        for p in ("_before_optimizer_step",) + _PARTS if p not in _IN_FORWARD},
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
            f"{pc['before_forward_arm_mean_s'] * 1e3:.2f}+"
            f"{(pc['capture_clone_mean_s'] + pc['all_to_all_record_mean_s']) * 1e3:.2f} ms",
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
        replays = sum(b[f"replay_{c}"] for c in _REPLAYED) + b["optimizer_check"]
        parts = [("replay (forward, backward) + shadow optimizer step", replays - b["signatures"]),
                 ("signatures", b["signatures"]), ("JSON all-gathers (plan, signatures)", b["json_gather"]),
                 ("input broadcasts", b["broadcast"])]
        if b["all_to_all"]:
            parts.append(("AllToAll replay (matrices, routing check, its gathers)", b["all_to_all"]))
        parts.append(("rest (encode/decode, vote, straggler statistics)", b["_before_optimizer_step"] - replays
                      - b["json_gather"] - b["broadcast"] - b["all_to_all"]))
        lines.append(f"  {b['_before_optimizer_step'] * 1e3:.1f} ms = " + " + ".join(
            f"{name} {value * 1e3:.1f}" for name, value in parts))
        lines.append("  replay+signatures per class: " + ", ".join(
            f"{c} {b[f'replay_{c}'] * 1e3:.1f}" for c in _REPLAYED if c != "expert" or b["replay_expert"])
            + f", optimizer {b['optimizer_check'] * 1e3:.1f} ms")
    if pc["probe_mean_s"] is not None:
        lines.append(f"  collective probe: {pc['probe_rank_mean_s'] * 1e3:.1f} ms mean over ranks at the {s['probes']} "
                     f"checks where it ran (every {s['probe_interval']} steps)")
    off = s["per_step_without_check"]
    lines.append(f"  steps without a check: _before_forward {off['_before_forward'] * 1e6:.0f} us, "
                 f"_before_optimizer_step {off['_before_optimizer_step'] * 1e6:.0f} us, _after_optimizer_step "
                 f"{off['_after_optimizer_step'] * 1e6:.0f} us; mean step {s['check_step_mean_s'] * 1e3:.1f} ms with a "
                 f"check vs {s['other_step_mean_s'] * 1e3:.1f} ms without")
    return "\n".join(lines)


def measure(rank_fn: Callable[..., dict], args: argparse.Namespace, opts: dict, name: str) -> Dict[str, Any]:
    """Run `rank_fn` on the ranks and summarize its configurations (rank 0's view, slowest ranks)."""
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="scout-bench-")
    load_start = list(os.getloadavg())
    try:
        results = run_ranks(rank_fn, args.ranks, opts, work, name=name, tcp=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r0 = results[0]
    summaries = [summarize(e) for e in r0["configs"]]
    rows = build_rows(summaries)
    spread = summaries[0]["per_round_steps_per_s"]
    return {"r0": r0, "summaries": summaries, "rows": rows, "loadavg": [load_start, list(os.getloadavg())],
            "baseline_round_spread_pct": (max(spread) - min(spread)) / statistics.mean(spread) * 100.0,
            "unhealthy_replay_results": {e["name"]: len(e.get("faults", [])) for e in r0["configs"][1:]},
            "oob_reports": {e["name"]: len(e.get("oob_reports", [])) for e in r0["configs"][1:]}}


def print_figures(m: Dict[str, Any], intro: List[str]) -> None:
    base = m["summaries"][0]
    (start, _, _), (end, _, _) = m["loadavg"]
    for line in intro:
        print(line)
    print(f"load average {start:.2f} at start, {end:.2f} at end; baseline step: p50 {base['step_p50_s'] * 1e3:.1f} ms, "
          f"p95 {base['step_p95_s'] * 1e3:.1f} ms (slowest rank per step); baseline round-to-round throughput spread "
          f"{m['baseline_round_spread_pct']:.1f}%")
    print(format_table(m["rows"]))
    for s in m["summaries"]:
        if s["interval"] == MAIN_INTERVAL and s.get("per_check"):
            print(breakdown(s))
    print(f"unhealthy replay results (false alarms on healthy hardware): {m['unhealthy_replay_results']}; "
          f"OOB reports: {m['oob_reports']}")


def dense_part(args: argparse.Namespace) -> Dict[str, Any]:
    opts = {k: getattr(args, k) for k in ("vocab", "dim", "blocks", "seq", "batch", "step_ms", "max_batch", "rounds",
                                          "steps", "interval_1", "timeout")}
    log(f"{args.ranks} ranks, TinyLM vocab {args.vocab} dim {args.dim} x {args.blocks} blocks, {args.rounds} rounds "
        f"x {args.steps} steps per configuration (load average {os.getloadavg()[0]:.2f})")
    m = measure(rank_main, args, opts, "SCOUT benchmark")
    r0 = m["r0"]
    share = replayed_share(args.vocab, args.dim, args.blocks)
    catalog = r0["configs"][1].get("catalog", {})
    print_figures(m, [
        f"SCOUT overhead: {args.ranks} ranks (gloo, TCPStore, 1 thread each) on {os.cpu_count()} CPUs, DDP TinyLM "
        f"({r0['params'] / 1e6:.1f} M params: embedding {args.vocab}x{args.dim}, {args.blocks} MLP blocks, head) + "
        f"Adam, batch {r0['batch']} x {args.seq} tokens/rank; a check replays the embedding, one block and the head: "
        f"{share * 100:.1f}% of the model's per-token multiply-adds",
        f"{args.rounds} interleaved rounds x {args.steps} steps per config (order rotated), enable_checkpoint=False, "
        f"replay peers {r0['configs'][1].get('group_ranks')}, collective probe "
        f"{'on' if r0['configs'][1].get('probe') else 'off (needs > 2 ranks)'}; catalog: embedding "
        f"{catalog.get('embedding')!r}, hidden {catalog.get('hidden')}, output {catalog.get('output')!r}"])
    return {
        "config": {"ranks": args.ranks, "model": {"vocab": args.vocab, "dim": args.dim, "blocks": args.blocks,
                                                  "seq": args.seq, "params": r0["params"],
                                                  "replayed_share_of_macs": share},
                   "batch": r0["batch"], "step_ms_target": args.step_ms, "rounds": args.rounds,
                   "steps_per_round": args.steps, "optimizer": "Adam", "wrapper": "DDP",
                   "enable_checkpoint": False, "replay_defaults": "ReplayHarnessConfig() with interval=N"},
        "loadavg": m["loadavg"], "calibration": r0["calibration"], "rows": m["rows"], "summaries": m["summaries"],
        "baseline_round_spread_pct": m["baseline_round_spread_pct"],
        "unhealthy_replay_results": m["unhealthy_replay_results"], "oob_reports": m["oob_reports"],
        "per_config": r0["configs"],
    }


def moe_part(args: argparse.Namespace) -> Dict[str, Any]:
    from benchmarks._moe_bench import moe_rank_main

    opts = {k: getattr(args, k) for k in ("vocab", "seq", "batch", "step_ms", "max_batch", "rounds", "steps",
                                          "interval_1", "timeout", "moe_dim", "moe_blocks", "moe_experts", "moe_ep",
                                          "moe_a2a_bytes")}
    log(f"MoE: {args.ranks} ranks (EP {args.moe_ep} x expert-DP {args.ranks // args.moe_ep}), dim {args.moe_dim}, "
        f"{args.moe_experts} experts per rank, {args.moe_blocks} dense blocks, {args.rounds} rounds x {args.steps} "
        f"steps per configuration (load average {os.getloadavg()[0]:.2f})")
    m = measure(moe_rank_main, args, opts, "SCOUT MoE benchmark")
    r0 = m["r0"]
    first = r0["configs"][1]
    print_figures(m, [
        f"SCOUT MoE replay cost: {args.ranks} ranks (gloo, TCPStore, 1 thread each) on {os.cpu_count()} CPUs, "
        f"benchmarks/_moe_model.py TinyMoE ({r0['params'] / 1e6:.1f} M params on a rank: embedding "
        f"{args.vocab}x{args.moe_dim}, one top-1 MoE layer of {args.moe_experts} local experts ({args.moe_dim} -> "
        f"{4 * args.moe_dim} -> {args.moe_dim}) x EP {args.moe_ep} dispatched with all_to_all_single, "
        f"{args.moe_blocks} dense MLP blocks, head) under DDP + Adam, batch {r0['batch']} x {args.seq} tokens/rank",
        f"a check replays the dense embedding, one block and the head among ranks {first.get('group_ranks')}, and "
        f"the local experts at one recipe among expert peers {first.get('expert_group_ranks')} (catalog n_exec "
        f"{r0['recipes']}, one recipe per check); AllToAll replay: BalancedAndPermutationPolicy({args.moe_a2a_bytes or ''}) on "
        f"the captured groups; {args.rounds} interleaved rounds x {args.steps} steps per config, enable_checkpoint=False"])
    return {
        "config": {"ranks": args.ranks, "model": {"vocab": args.vocab, "dim": args.moe_dim, "hidden": 4 * args.moe_dim,
                                                  "experts_per_rank": args.moe_experts, "ep": args.moe_ep,
                                                  "dense_blocks": args.moe_blocks, "seq": args.seq,
                                                  "params_per_rank": r0["params"]},
                   "batch": r0["batch"], "recipes": r0["recipes"], "all_to_all_max_payload_bytes_per_rank":
                   args.moe_a2a_bytes, "step_ms_target": args.step_ms,
                   "rounds": args.rounds, "steps_per_round": args.steps, "optimizer": "Adam",
                   "wrapper": "DDP (experts ignored, averaged over expert-DP)", "enable_checkpoint": False},
        "loadavg": m["loadavg"], "calibration": r0["calibration"], "rows": m["rows"], "summaries": m["summaries"],
        "baseline_round_spread_pct": m["baseline_round_spread_pct"],
        "unhealthy_replay_results": m["unhealthy_replay_results"], "oob_reports": m["oob_reports"],
        "per_config": r0["configs"],
    }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--part", choices=("all", "dense", "moe"), default="all",
                   help="the dense DDP model, the MoE model (expert and AllToAll replay), or both")
    p.add_argument("--ranks", type=int, default=4, help="gloo processes on this machine (>= 3 for rank localization)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary (embedding rows, head outputs)")
    p.add_argument("--dim", type=int, default=256, help="model width (MLP blocks are dim -> 4*dim -> dim)")
    p.add_argument("--blocks", type=int, default=24,
                   help="residual MLP blocks (the hidden check rotates over them); 4 is the worst case")
    p.add_argument("--moe-dim", type=int, default=256, help="MoE model width (experts and blocks: dim -> 4*dim -> dim)")
    p.add_argument("--moe-blocks", type=int, default=23,
                   help="dense residual MLP blocks after the MoE layer (23: one MoE layer in a 24-layer model)")
    p.add_argument("--moe-experts", type=int, default=2, help="local experts per rank")
    p.add_argument("--moe-ep", type=int, default=2, help="expert-parallel degree (--ranks / it expert-DP replicas)")
    p.add_argument("--moe-a2a-bytes", type=int, default=None,
                   help="max_payload_bytes_per_rank of the AllToAll replay's BalancedAndPermutationPolicy "
                        "(default: the policy's, 4 MiB)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sample")
    p.add_argument("--batch", type=int, default=0, help="per-rank batch size (0: calibrate to --step-ms)")
    p.add_argument("--step-ms", type=float, default=600.0, help="baseline step time the batch is sized for")
    p.add_argument("--max-batch", type=int, default=64, help="largest batch the calibration may pick")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=50,
                   help=f"training steps per configuration per round (a multiple of {MAIN_INTERVAL})")
    p.add_argument("--no-interval-1", dest="interval_1", action="store_false",
                   help="skip the interval 1 configuration")
    p.add_argument("--out", default="benchmarks/results/scout.json", help="JSON results path")
    p.add_argument("--timeout", type=float, default=1800.0, help="limit for each part's run and every wait (s)")
    args = p.parse_args(argv)
    if args.ranks < 2:
        p.error("--ranks must be >= 2")
    if min(args.vocab, args.dim, args.blocks, args.seq, args.rounds, args.steps, args.moe_dim, args.moe_experts,
           args.moe_ep) < 1 or args.batch < 0 or args.moe_blocks < 0 or (args.moe_a2a_bytes is not None and args.moe_a2a_bytes < 1):
        p.error("sizes, --rounds, --steps and --moe-a2a-bytes must be positive, --batch and --moe-blocks >= 0")
    if args.blocks < 2:
        p.error("--blocks must be >= 2 (SCOUT's hidden check needs a ModuleList of at least two blocks)")
    if args.steps % MAIN_INTERVAL:
        p.error(f"--steps must be a multiple of {MAIN_INTERVAL} so every round holds the same number of checks")
    if args.part != "dense" and (args.ranks % args.moe_ep or args.ranks == args.moe_ep):
        p.error(f"--moe-ep {args.moe_ep} must divide --ranks {args.ranks} and leave 2+ expert-DP replicas")

    import torch

    result: Dict[str, Any] = {
        "benchmark": "scout",
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "platform": platform.platform(), "cpus": os.cpu_count(), "device": "cpu", "backend": "gloo",
                        "store": "TCPStore", "threads_per_rank": 1},
        "target": {"amortized_overhead_pct_at_interval_10": TARGET_PCT},
    }
    if args.part in ("all", "dense"):
        result.update(dense_part(args))
    if args.part in ("all", "moe"):
        result["moe"] = moe_part(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("per check = slowest rank's time inside the session's _before_optimizer_step at a step with a check "
          "(probe included where it ran); probe = the collective probe where it ran (every probe_interval steps); "
          "arm+capture = _before_forward at that step + the capture hook's input clone and the AllToAll layout "
          "reads in the forward; amortized = mean SCOUT training-thread time per step (all hooks + capture) / "
          f"baseline p50 step, target < {TARGET_PCT:g}% at interval {MAIN_INTERVAL}; throughput loss = 1 - steps/s "
          "/ baseline steps/s (includes the OOB monitor thread; compare with the baseline spread).")
    print(f"CPU caveat: {os.cpu_count()} cores run {args.ranks} single-threaded ranks; replay, signature hashing "
          f"and the gloo probe compete with training for the same cores. torch {torch.__version__}.")
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
