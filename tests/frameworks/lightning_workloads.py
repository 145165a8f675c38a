"""Lightning training runs for the ResiliencyCallback tests (module level: child ranks import them).

Each rank function builds an ordinary Lightning program — LightningModule, DataLoader, Trainer —
and adds `ResiliencyCallback`; the test harness provides the torch.distributed environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT) that Lightning's
TorchElastic environment detection picks up, so Lightning does not spawn processes itself.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.callbacks.lightning import ResiliencyCallback


class Recipe(L.LightningModule):
    """The training recipe every test model shares: MSE on a seeded dataset, AdamW with a
    per-step StepLR, and a record of the data position each step consumed."""

    def __init__(self, samples: int = 64) -> None:
        super().__init__()
        self.samples = samples
        self.seen: List[tuple] = []   # (global_step before the step, batch checksum): the data position

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((int(self.trainer.global_step), float(x.double().sum())))
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1234)
        data = TensorDataset(torch.randn(self.samples, 16, generator=g), torch.randn(self.samples, 4, generator=g))
        return DataLoader(data, batch_size=4, shuffle=True)  # Lightning adds a seeded DistributedSampler


class Net(Recipe):
    """Two bias-free layers, head registered first."""

    def __init__(self, samples: int = 64) -> None:
        super().__init__(samples)
        self.head = nn.Linear(32, 4, bias=False)
        self.body = nn.Linear(16, 32, bias=False)
        self.drop = nn.Dropout(0.1)  # RNG restore matters

    def forward(self, x):
        return self.head(self.drop(torch.tanh(self.body(x))))


class ForwardNet(Recipe):
    """The ordinary layout: layers then a head, registered in forward order. Under
    `DDPStrategy(bucket_cap_mb=0.002)` its gradients span three DDP buckets."""

    def __init__(self, samples: int = 64) -> None:
        super().__init__(samples)
        self.layers = nn.ModuleList([nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32)])
        self.head = nn.Linear(32, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return self.head(x)


class ManualNet(Net):
    """Net with manual optimization: the training step calls the optimizer and scheduler itself."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        x, y = batch
        self.seen.append((int(self.trainer.global_step), float(x.double().sum())))
        loss = nn.functional.mse_loss(self(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        scheduler.step()
        return loss


class KillAt(Callback):
    """SIGKILLs this rank right after optimizer step `step` (no cleanup of any kind runs)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _config(folder: str, run_id: str) -> InMemoryCkptConfig:
    return InMemoryCkptConfig(disk_folder=os.path.join(folder, "gemini"), run_id=run_id, replication_jump=1,
                              disk_flush_interval=0, timeout_s=60,
                              shared_memory_dir=os.path.join(folder, "shm"))


def final_state(trainer: Any, model: Net) -> Dict[str, Any]:
    optimizer = trainer.optimizers[0]
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for i, s in optimizer.state_dict()["state"].items()},
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": int(trainer.global_step),
        "epoch": int(trainer.current_epoch),
        "torch_rng": torch.get_rng_state(),
    }


def fit_ddp(rank: int, world: int, folder: str, max_steps: int, *, accumulate: int = 1,
            kill_at: Optional[int] = None, resilient: bool = True, interval: int = 2,
            run_id: str = "lightning-ddp", strategy: Any = "ddp", manual: bool = False,
            forward: bool = False) -> Dict[str, Any]:
    """One `trainer.fit` on this rank. Returns the recovered step, the data seen and the final state.
    `forward`: ForwardNet over several DDP buckets. LMR_TEST_DDP_PIN=0 switches off the DDP bucket
    pin (adapters/_torch_compat.py), to show what it prevents."""
    L.seed_everything(0, verbose=False)
    if os.environ.get("LMR_TEST_DDP_PIN") == "0":
        from lm_resiliency import _torch_compat

        _torch_compat._ENABLED = False
    if forward:
        from lightning.pytorch.strategies import DDPStrategy

        model: Recipe = ForwardNet()
        strategy = DDPStrategy(bucket_cap_mb=0.002)
    else:
        model = ManualNet() if manual else Net()
    callbacks: List[Callback] = []
    callback = None
    if resilient:
        callback = ResiliencyCallback(interval=interval, checkpoint=_config(folder, run_id))
        callbacks.append(callback)
    if kill_at is not None:
        callbacks.append(KillAt(kill_at))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=max_steps,
                        accumulate_grad_batches=accumulate, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=folder)
    trainer.fit(model)
    return {"recovered": callback.recovered_step if callback is not None else None,
            "seen": list(model.seen), "state": final_state(trainer, model)}


def kill_then_resume_and_baseline(rank: int, world: int, folder: str, max_steps: int, accumulate: int,
                                  phase: str, manual: bool = False, forward: bool = False) -> Any:
    """phase 'kill': train with the callback and die at step 7. phase 'resume': resume the same run
    to completion, then (same processes) run an uninterrupted baseline: without lm-resiliency, or,
    for `forward` (3+ ranks, where DDP's bucket layout shows in the last bits), with it, since
    attaching fixes the layout from the first step (docs/frameworks.md, "DDP and bitwise resume")."""
    kw = dict(accumulate=accumulate, manual=manual, forward=forward)
    if phase == "kill":
        return fit_ddp(rank, world, folder, max_steps, kill_at=7, **kw)
    resumed = fit_ddp(rank, world, folder, max_steps, **kw)
    baseline = fit_ddp(rank, world, os.path.join(folder, "baseline"), max_steps, resilient=forward,
                       run_id="lightning-ddp-baseline", **kw)
    return resumed, baseline


# ------------------------------------------------------------------ ModelParallelStrategy (dp x tp)


class TPNet(Recipe):
    """A two-layer MLP block, tensor-parallel (column then row) over the 'tensor_parallel' mesh
    dimension and FSDP2-sharded over 'data_parallel' in `configure_model`, the way Lightning's
    ModelParallelStrategy expects."""

    def __init__(self, samples: int = 64) -> None:
        super().__init__(samples)
        self.w1 = nn.Linear(16, 32, bias=False)
        self.w2 = nn.Linear(32, 4, bias=False)

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if any(type(p).__name__ == "DTensor" for p in self.parameters()):
            return
        parallelize_module(self, self.device_mesh["tensor_parallel"],
                           {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(self, mesh=self.device_mesh["data_parallel"])

    def forward(self, x):
        return self.w2(torch.tanh(self.w1(x)))


def _local(value: Any) -> Any:
    return value.to_local().detach().clone() if hasattr(value, "to_local") else (
        value.detach().clone() if torch.is_tensor(value) else value)


class RecordReplay(Callback):
    """SCOUT's replay results as they happen: (step, healthy, fault reports), and this rank's peers."""

    def __init__(self, resiliency: ResiliencyCallback) -> None:
        self.resiliency = resiliency
        self.results: List[tuple] = []
        self.peers: Optional[tuple] = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lm_resiliency.scout.reports import replay_fault_reports

        session = self.resiliency.session
        detector = session.scout.detector if session.scout is not None else None
        self.peers = None if detector is None else detector.group_ranks
        result = session.last_replay_result
        if result is not None and (not self.results or self.results[-1][0] != result.step):
            self.results.append((result.step, result.healthy, replay_fault_reports(result)))


def fit_model_parallel(rank: int, world: int, folder: str, max_steps: int, phase: str) -> Any:
    """dp=2 x tp=2 on 4 ranks. phase 'kill' dies after step 7; 'resume' resumes, then runs an
    uninterrupted baseline in the same processes."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    def one(run_folder: str, resilient: bool, kill_at: Optional[int]) -> Dict[str, Any]:
        L.seed_everything(0, verbose=False)
        model = TPNet()
        callbacks: List[Callback] = []
        callback = replay = None
        if resilient:
            callback = ResiliencyCallback(interval=2, checkpoint=_config(run_folder, "lightning-mp"))
            replay = RecordReplay(callback)
            callbacks += [callback, replay]
        if kill_at is not None:
            callbacks.append(KillAt(kill_at))
        trainer = L.Trainer(accelerator="cpu", devices=world,
                            strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=world // 2),
                            max_steps=max_steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            default_root_dir=run_folder)
        trainer.fit(model)
        optimizer = trainer.optimizers[0]
        state = {"model": {k: _local(v) for k, v in model.state_dict().items()},
                 "optimizer": {i: {k: _local(v) for k, v in s.items()}
                               for i, s in optimizer.state_dict()["state"].items()},
                 "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                 "global_step": int(trainer.global_step)}
        topology = dict(callback.topology.descriptor) if callback is not None else None
        return {"recovered": callback.recovered_step if callback else None, "seen": list(model.seen),
                "state": state, "topology": topology, "replay": replay.results if replay else None,
                "peers": replay.peers if replay else None}

    if phase == "kill":
        return one(folder, True, 7)
    return one(folder, True, None), one(os.path.join(folder, "baseline"), False, None)


# ------------------------------------------------------------------ observers used by the tests


class MemoryLogger(Logger):
    """A real Lightning logger that keeps what it is given (on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: List[tuple] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append((step, dict(metrics)))


class RecordCaptures(Callback):
    """Records the step of every GEMINI capture the ResiliencyCallback's session starts."""

    def __init__(self, resiliency: ResiliencyCallback) -> None:
        self.resiliency = resiliency
        self.captures: List[int] = []
        self.session_steps: List[tuple] = []

    def on_train_start(self, trainer, pl_module):
        manager = self.resiliency.session.manager
        original = manager.save

        def save(state, step, **kw):
            self.captures.append(step)
            return original(state, step, **kw)

        manager.save = save

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.session_steps.append((int(trainer.global_step), self.resiliency.session.step_count))


class CorruptAt(Callback):
    """Silent data corruption on one rank: perturbs a weight right before step `step`'s forward."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step - 1 and trainer.global_rank == self.rank:
            with torch.no_grad():
                pl_module.body.weight[0, 0] += 1.0


def fit_observed(rank: int, world: int, folder: str, max_steps: int, accumulate: int,
                 corrupt: Optional[tuple] = None) -> Dict[str, Any]:
    """A DDP fit with the callback, an in-memory logger and capture recording (no kill)."""
    L.seed_everything(0, verbose=False)
    model = Net()
    resiliency = ResiliencyCallback(interval=2, checkpoint=_config(folder, "lightning-observed"))
    recorder = RecordCaptures(resiliency)
    callbacks: List[Callback] = [resiliency, recorder]
    if corrupt is not None:
        callbacks.append(CorruptAt(*corrupt))
    memory = MemoryLogger()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=max_steps,
                        accumulate_grad_batches=accumulate, callbacks=callbacks, logger=memory,
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=folder)
    trainer.fit(model)
    return {"captures": recorder.captures, "session_steps": recorder.session_steps,
            "batches": len(model.seen), "metrics": memory.metrics, "global_step": int(trainer.global_step)}


# ------------------------------------------------------------------ single process, validation + callbacks


class ValidatedNet(Net):
    """Net with validation (run right after the captured step 6) and in-order data."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1234)
        data = TensorDataset(torch.randn(self.samples, 16, generator=g), torch.randn(self.samples, 4, generator=g))
        return DataLoader(data, batch_size=4)

    def val_dataloader(self):
        return self.train_dataloader()


def fit_single_with_validation(rank: int, world: int, folder: str, phase: str) -> Any:
    """One process: validation every 3 steps, ModelCheckpoint and EarlyStopping (whose states
    GEMINI carries), killed after step 7 ('kill'), then resumed and compared ('resume')."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    def one(run_folder: str, resilient: bool, kill_at: Optional[int]) -> Dict[str, Any]:
        L.seed_everything(0, verbose=False)
        model = ValidatedNet(samples=40)  # 10 batches per epoch
        resiliency = ResiliencyCallback(interval=2, checkpoint=_config(run_folder, "lightning-single"))
        checkpoint = ModelCheckpoint(dirpath=os.path.join(run_folder, "ckpt"), monitor="val_loss", save_top_k=2)
        stopping = EarlyStopping("val_loss", patience=100)
        callbacks: List[Callback] = ([resiliency] if resilient else []) + [checkpoint, stopping]
        if kill_at is not None:
            callbacks.append(KillAt(kill_at))
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=14, val_check_interval=3, callbacks=callbacks,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, default_root_dir=run_folder)
        trainer.fit(model)
        state = final_state(trainer, model)
        state["best_score"] = checkpoint.best_model_score
        state["stopping_best"] = stopping.best_score
        state["best_k"] = sorted(os.path.basename(p) for p in checkpoint.best_k_models)
        return {"recovered": resiliency.recovered_step if resilient else None, "seen": list(model.seen),
                "state": state}

    if phase == "kill":
        return one(folder, True, 7)
    return one(folder, True, None), one(os.path.join(folder, "baseline"), False, None)


# ------------------------------------------------------------------ BoringModel, zero-code opt-in


def fit_boring(rank: int, world: int, folder: str, phase: str) -> Any:
    """Lightning's own BoringModel (its RandomDataset draws from the global generator inside
    train_dataloader()), enabled by LM_RESILIENCY=<policy file> alone. phase 'kill': rank 1 is SIGKILLed
    after step 7 (mid-epoch). 'resume': the relaunch, then an uninterrupted run (another run id)
    in the same processes. Returns final parameters and global step."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    # A policy file, as a user would write one, with GEMINI's default timeout_s (300 s): the
    # survivors of the SIGKILLed rank must still exit within the test's 110 s.
    policy = os.path.join(folder, f"policy-rank{rank}.toml")
    with open(policy, "w") as f:
        f.write("schema_version = 1\n")

    def one(run_id: str, kill_at: Optional[int]) -> Dict[str, Any]:
        os.environ.update(LM_RESILIENCY=policy, LM_RESILIENCY_INTERVAL="2", LM_RESILIENCY_RUN_ID=run_id,
                          LM_RESILIENCY_DIR=os.path.join(folder, run_id, "gemini"),
                          LM_RESILIENCY_SHM_DIR=os.path.join(folder, run_id, "shm"), LM_RESILIENCY_DETECTION="0")
        L.seed_everything(0, verbose=False)
        model = BoringModel()
        callbacks: List[Callback] = [KillAt(kill_at)] if kill_at is not None and rank == 1 else []
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp",
                            max_steps=10, callbacks=callbacks,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=folder)
        trainer.fit(model)
        added = [cb for cb in trainer.callbacks if isinstance(cb, ResiliencyCallback)]
        return {"recovered": added[0].recovered_step if added else None,
                "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "global_step": int(trainer.global_step)}

    if phase == "kill":
        return one("boring", 7)
    # The baseline is an uninterrupted resilient run of another run id (a plain DDP run sums its
    # first step in DDP's initial bucket layout, which lm-resiliency pins away at attach).
    return one("boring", None), one("boring-baseline", None)
