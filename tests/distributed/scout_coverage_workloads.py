"""Rank functions for the SCOUT coverage, live-output and internal-error tests (module level so
child ranks can import them).

`NormedLM` is built as users build it (forward registration order): an embedding, three residual
blocks in a ModuleList, a final LayerNorm (outside the embedding/hidden/output classes) and a head.
Every rank starts from the same seed under real DDP, so all ranks are bitwise-identical replicas.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import InMemoryCkptConfig, ReplayHarnessConfig, enable_resiliency
from lm_resiliency.scout.replay import ReplayDetector
from tests.distributed.scout_workloads import sign_flip


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class NormedLM(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Residual(width) for _ in range(3)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _one_shot(hook):
    """A forward hook that fires on the next call only: a transient fault in one live forward."""
    state = {}

    def fire(module, args, kwargs, output):
        state["handle"].remove()
        return hook(module, args, kwargs, output)
    return state, fire


def normed_detector(world):
    """NormedLM under DDP with Adam and a ReplayDetector checking every step on all ranks:
    (model, ddp, optimizer, detector)."""
    torch.manual_seed(0)
    model = NormedLM()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    detector = ReplayDetector(ddp, optimizer, ReplayHarnessConfig(check_interval=1), group=dist.group.WORLD,
                              group_ranks=list(range(world)))
    return model, ddp, optimizer, detector


def detector_run(rank, world, steps, fault_rank, fault_path=None, one_shot_step=None, state_fault_after=None,
                 fault_from=1):
    """Train NormedLM under DDP with a check at every step. Faults on `fault_rank` only (an int,
    or a tuple of ranks faulty alike): `fault_path`: a recurring sign flip in that module's
    forward from step `fault_from` on; `one_shot_step`: one sign flip
    in the head's live forward at that step; `state_fault_after`: after that step's optimizer
    step, Adam's exp_avg of `norm.bias` is nudged. Returns (coverage, {step: outcomes})."""
    model, ddp, optimizer, detector = normed_detector(world)
    faulty = fault_rank if isinstance(fault_rank, tuple) else (fault_rank,)
    results = {}
    for step in range(1, steps + 1):
        if fault_path is not None and rank in faulty and step == fault_from:
            model.get_submodule(fault_path).register_forward_hook(sign_flip, with_kwargs=True)
        if one_shot_step == step and rank == fault_rank:
            state, hook = _one_shot(sign_flip)
            state["handle"] = model.head.register_forward_hook(hook, with_kwargs=True)
        detector.arm(step)
        tokens = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(1000 * rank + step))
        ddp(tokens).pow(2).mean().backward()
        result = detector.run(step)
        results[step] = [(c.check, c.module_path, c.verdict, c.faulty) for c in result.checks]
        optimizer.step()
        optimizer.zero_grad()
        if state_fault_after == step and rank == fault_rank:
            with torch.no_grad():
                optimizer.state[model.norm.bias]["exp_avg"][0] += 1e-3
    coverage = detector.coverage()
    detector.close()
    return coverage, results


class ParentOnly(nn.Module):
    """A test-only module that works only inside its parent's forward (the parent sets
    `inside`): replaying it alone fails on every peer, an internal SCOUT failure, not SDC."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(()))
        self.inside = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.inside:
            raise RuntimeError("ParentOnly is only callable inside its parent's forward")
        return x * self.g


class ScalarModel(nn.Module):
    """`RegressionModel`'s shape (two 0-d parameters) around a `ParentOnly` child."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.5))
        self.b = nn.Parameter(torch.tensor(0.25))
        self.gate = ParentOnly()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gate.inside = True
        try:
            return self.gate(x * self.a + self.b)
        finally:
            self.gate.inside = False


def scalar_session(rank, world, folder, steps, kind, kill_after=None):
    """enable_resiliency on a model with 0-d parameters under DDP: accelerate's `RegressionModel`
    (kind "regression") or `ScalarModel` (kind "failing"). Returns what the session saw."""
    from accelerate.test_utils.training import RegressionModel

    torch.manual_seed(0)
    model = RegressionModel(a=1, b=1) if kind == "regression" else ScalarModel()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    session = enable_resiliency(
        ddp, optimizer, interval=2,
        checkpoint=InMemoryCkptConfig(disk_folder=folder, disk_flush_interval=2, run_id=f"scalar-{kind}",
                                      replication_jump=1, timeout_s=60),
        replay=ReplayHarnessConfig(hang_stall_threshold_s=120, monitor_poll_interval_s=0.5),
    )
    resumed = session.step_count
    verdicts = []
    for step in range(session.step_count, steps):
        x = torch.randn(8, generator=torch.Generator().manual_seed(100 * step + rank))
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if session.last_replay_result is not None and session.last_replay_result.step == step + 1:
            verdicts.append(sorted({c.verdict for c in session.last_replay_result.checks}))
        if kill_after is not None and step + 1 == kill_after:
            session.flush_for_restart()
            session.manager._drain()
            os.kill(os.getpid(), signal.SIGKILL)
    session.flush_for_restart()
    session.manager._drain()
    own_steps = sorted(k.step for k in session.manager.store.list_shards() if k.kind == "own")
    out = {"resumed": resumed, "own_steps": own_steps, "verified": session.ledger.verified_steps(),
           "errors": session.scout_check_errors, "verdicts": verdicts,
           "params": [p.detach().clone() for p in model.parameters()]}
    session.close()
    return out


def accelerate_regression(rank, world, folder):
    """Accelerate's own `RegressionModel` (0-d parameters, the root is the only module) through
    Accelerate's prepare and lm-resiliency's Accelerate entry point. Returns what SCOUT saw,
    with the WARNING-and-above lines lm-resiliency logged."""
    import io
    import logging

    from accelerate import Accelerator
    from accelerate.test_utils.training import RegressionDataset, RegressionModel

    from lm_resiliency.integrations.accelerate import enable_resiliency as enable_for_accelerate

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    logging.getLogger("lm_resiliency").addHandler(handler)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = RegressionModel(a=1, b=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(RegressionDataset(length=64, seed=rank), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    session = enable_for_accelerate(accelerator, interval=2, checkpoint=InMemoryCkptConfig(
        disk_folder=folder, run_id="accelerate-regression", replication_jump=1, timeout_s=60,
        shared_memory_dir=folder + ".shm"))
    verdicts = []
    for batch in loader:
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if session.step_count % 2 == 0:
            verdicts.append(sorted({c.verdict for c in session.last_replay_result.checks}))
        if session.step_count == 6:
            break
    out = {"errors": session.scout_check_errors, "verdicts": verdicts, "verified": session.ledger.verified_steps(),
           "log": stream.getvalue()}
    session.close()
    logging.getLogger("lm_resiliency").removeHandler(handler)
    return out
