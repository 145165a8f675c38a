"""The MoE part of benchmarks/scout_bench.py: expert replay and AllToAll replay cost on the
expert-parallel MoE of benchmarks/_moe_model.py, by the dense part's method (configurations side
by side in the same rank processes, interleaved rounds, the same timers and summaries).

Configurations, each with its own model copy and Adam (same initial weights): the unchanged loop
(baseline); `enable_resiliency(..., interval=10, enable_checkpoint=False,
replay=ReplayHarnessConfig(workload=<expert workload>, all_to_all_policy=None))` (dense replay of
the embedding, a rotating block and the head, plus expert replay of one catalog recipe per check);
the same with `BalancedAndPermutationPolicy(--moe-a2a-bytes)` (AllToAll replay of the check
step's captured dispatch; the default budget is the policy's, 4 MiB per rank); unless `--no-interval-1`, that one at interval 1.
"""

from __future__ import annotations

from typing import Any, Dict, List

from benchmarks.scout_bench import MAIN_INTERVAL, Config, calibrate, config_entries, enable_sessions, install_timers
from benchmarks.scout_bench import log as _log
from benchmarks.scout_bench import run_rounds


def log(msg: str) -> None:
    _log(f"[moe] {msg}")


def catalog(tokens_per_rank: int, experts_per_rank: int) -> List[int]:
    """The replayed recipes (n_exec rows per local expert): the mean rows a local expert receives
    in training (the EP group's tokens spread over its experts) and half of it, so a K=2 cycle."""
    mean = max(1, tokens_per_rank // experts_per_rank)
    return sorted({max(1, mean // 2), mean})


def moe_rank_main(rank: int, world: int, opts: dict) -> dict:
    import torch
    from torch import nn

    from benchmarks._moe_model import MoESizes, average_expert_gradients, build
    from lm_resiliency import (
        BalancedAndPermutationPolicy,
        GroupedExpertMaterializer,
        ReplayHarnessConfig,
        ReplayWorkload,
        enable_resiliency,
    )

    say = log if rank == 0 else (lambda m: None)
    install_timers()
    vocab, seq, ep = opts["vocab"], opts["seq"], opts["moe_ep"]
    sizes = MoESizes(width=opts["moe_dim"], hidden=4 * opts["moe_dim"], experts_per_rank=opts["moe_experts"],
                     vocab=vocab, outputs=vocab, blocks=opts["moe_blocks"])
    configs = [Config("baseline", None),
               Config(f"expert replay interval {MAIN_INTERVAL}", MAIN_INTERVAL, all_to_all=False),
               Config(f"expert + AllToAll interval {MAIN_INTERVAL}", MAIN_INTERVAL, all_to_all=True)]
    if opts["interval_1"]:
        configs.append(Config("expert + AllToAll interval 1", 1, all_to_all=True))
    for cfg in configs:
        cfg.ddp, cfg.model, cfg.optimizer, mesh, edp = build(rank, world, ep, sizes=sizes, lr=1e-4)
        cfg.options.update(mesh=mesh, edp=edp)
    params = sum(p.numel() for p in configs[0].model.parameters())

    gen = torch.Generator().manual_seed(100 + rank)
    batches: Dict[int, tuple] = {}

    def batch(n: int) -> tuple:
        if n not in batches:
            batches[n] = (torch.randint(0, vocab, (n * seq,), generator=gen),
                          torch.randint(0, vocab, (n * seq,), generator=gen))
        return batches[n]

    def step(cfg: Config, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = nn.functional.cross_entropy(cfg.ddp(x), y)
        loss.backward()
        average_expert_gradients(cfg.model, cfg.options["edp"])
        cfg.optimizer.step()
        cfg.optimizer.zero_grad(set_to_none=True)

    batch_size, calibration = calibrate(lambda n: step(configs[0], *batch(n)), opts, world, say)
    batches.clear()
    x, y = batch(batch_size)
    recipes = catalog(batch_size * seq, sizes.experts_per_rank)
    say(f"expert replay catalog: n_exec {recipes} rows per local expert ({sizes.experts_per_rank} local experts)")

    def enable(cfg: Config, **callbacks: Any) -> Any:
        workload = ReplayWorkload.from_moe_catalog(recipes, replay_modules=[cfg.model.moe.experts],
                                                   materializer=GroupedExpertMaterializer(),
                                                   device_mesh=cfg.options["mesh"])
        budget = opts["moe_a2a_bytes"]
        policy = None if not cfg.options["all_to_all"] else (
            BalancedAndPermutationPolicy(budget) if budget else BalancedAndPermutationPolicy())
        return enable_resiliency(cfg.ddp, cfg.optimizer, interval=cfg.interval, enable_checkpoint=False,
                                 replay=ReplayHarnessConfig(workload=workload, all_to_all_policy=policy), **callbacks)

    enable_sessions(configs, enable, say)
    run_rounds(configs, lambda cfg: step(cfg, x, y), opts, world, say)

    def describe(cfg: Config) -> Dict[str, Any]:
        scout = cfg.session.scout
        dense, expert = scout.detector, scout.workload_detector
        return {"catalog": {"embedding": dense.catalog.embedding[0], "hidden": [p for p, _ in dense.catalog.hidden],
                            "output": dense.catalog.output[0]} if dense is not None else None,
                "group_ranks": list(dense.group_ranks) if dense is not None else None,
                "expert_group_ranks": list(expert.group_ranks) if expert is not None else None,
                "workload": expert.workload.describe() if expert is not None else None,
                "all_to_all": cfg.options["all_to_all"]}

    return {"batch": batch_size, "calibration": calibration, "params": params, "recipes": recipes,
            "configs": config_entries(configs, describe)}
