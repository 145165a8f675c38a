"""Lightning adapter: where a `Trainer` keeps model, optimizer, schedulers, loop progress and data.

State captured at a GEMINI boundary (optimizer step k, `k % interval == 0`):

- ``framework``: the LightningModule's ``state_dict`` (DTensor parameters as local shards under
  ModelParallelStrategy), the optimizer's ``state_dict``, and the RNG streams right before the next
  batch's forward (restored at that same point after a restart).
- ``deferred``: Lightning's own checkpoint sections — fit-loop progress as it stood at the end of
  step k (``on_train_batch_end``: the layout Lightning's loop restart logic expects), LR
  schedulers, precision plugin, datamodule and callback ``state_dict``s (read before the next
  batch, after every callback finished step k), plus the data position within the epoch.

Restore goes through Lightning's own restore path: the recovered sections are handed to the
trainer's checkpoint connector as its loaded checkpoint, so Lightning restores loops (global
step, epoch, batch progress, stateful dataloaders), schedulers, callbacks and precision exactly
as it does for ``trainer.fit(ckpt_path=...)``. Model and optimizer tensors are copied in place by
this adapter (shard-aware, like the PyTorch adapter) because sharded strategies do not load them
from a checkpoint dictionary.
"""

from __future__ import annotations

import copy
import importlib
import logging
import warnings
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from lm_resiliency.adapter import FrameworkAdapter, StepCallbacks, Topology
from lm_resiliency.adapters import _lightning_compat as compat
from lm_resiliency._torch_compat import pin_bucket_layout
from lm_resiliency.adapters.pytorch import load_model_in_place, rewrap_optimizer_state
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.session import capture_rng, restore_rng

logger = logging.getLogger(__name__)

SUPPORTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy (ddp, ddp_spawn, ddp_fork, ddp_notebook)",
                        "ModelParallelStrategy (FSDP2 + tensor parallel)")


class LightningStrategyError(ResiliencyError, TypeError):
    """The Trainer's strategy (or optimizer setup) cannot be protected by lm-resiliency."""


def lightning_package(trainer: Any) -> str:
    """'lightning.pytorch' or 'pytorch_lightning': the package the trainer comes from."""
    module = type(trainer).__module__ or ""
    if module.startswith("pytorch_lightning"):
        return "pytorch_lightning"
    if module.startswith("lightning.pytorch"):
        return "lightning.pytorch"
    raise TypeError(f"expected a Lightning Trainer, got {type(trainer).__module__}.{type(trainer).__qualname__}")


def _strategies(package: str):
    return importlib.import_module(f"{package}.strategies")


def strategy_package(strategy: Any) -> str:
    module = type(strategy).__module__ or ""
    return "pytorch_lightning" if module.startswith("pytorch_lightning") else "lightning.pytorch"


def check_strategy(strategy: Any, package: Optional[str] = None) -> str:
    """'single', 'ddp' or 'model_parallel' for a Lightning strategy object; raises
    LightningStrategyError, naming what to use instead, for anything else."""
    strategies = _strategies(package or strategy_package(strategy))
    name = type(strategy).__name__
    for unsupported, advice in (
        ("DeepSpeedStrategy", "DeepSpeed partitions model and optimizer state inside its engine; use "
                              "lm_resiliency's DeepSpeed surface (lm_resiliency.callbacks.deepspeed) with a "
                              "DeepSpeed engine, or Lightning's DDPStrategy / ModelParallelStrategy"),
        ("FSDPStrategy", "FSDP1 keeps parameters as flattened shards that this adapter does not capture; use "
                         "ModelParallelStrategy (FSDP2, optionally with tensor parallelism) for sharded training"),
        ("XLAStrategy", "XLA devices are not supported"),
        ("SingleDeviceXLAStrategy", "XLA devices are not supported"),
    ):
        cls = getattr(strategies, unsupported, None)
        if cls is not None and isinstance(strategy, cls):
            raise LightningStrategyError(f"ResiliencyCallback does not support {name}: {advice}. "
                                         f"Supported strategies: {', '.join(SUPPORTED_STRATEGIES)}.")
    if isinstance(strategy, strategies.ModelParallelStrategy):
        return "model_parallel"
    if isinstance(strategy, strategies.DDPStrategy):
        return "ddp"
    if isinstance(strategy, strategies.SingleDeviceStrategy):
        return "single"
    raise LightningStrategyError(f"ResiliencyCallback does not support the strategy {type(strategy).__module__}."
                                 f"{name}; supported: {', '.join(SUPPORTED_STRATEGIES)}")


def strategy_kind(trainer: Any) -> str:
    """`check_strategy` for the trainer's strategy."""
    return check_strategy(trainer.strategy, lightning_package(trainer))


def _raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps the torch optimizer


class LightningAdapter(FrameworkAdapter):
    """Adapter over a Trainer whose strategy is set up (optimizers exist). Built by
    `lm_resiliency.callbacks.lightning.ResiliencyCallback` at `on_fit_start`."""

    framework = "lightning"
    # Lightning calls train_dataloader() (and val_dataloader()) after on_fit_start, where the
    # session recovers; `before_batch` restores the RNG streams captured before the next batch.
    defers_rng_restore = True

    def __init__(self, trainer: Any, *, skip_replication_if_hsdp: bool = True) -> None:
        self.trainer = trainer
        self.package = lightning_package(trainer)
        self.kind = strategy_kind(trainer)
        self.module = trainer.lightning_module
        if self.module is None:
            raise RuntimeError("Lightning adapter: the Trainer has no LightningModule attached (call from fit)")
        optimizers = [_raw_optimizer(o) for o in trainer.optimizers]
        if len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.Optimizer):
            raise LightningStrategyError(
                f"ResiliencyCallback needs exactly one torch optimizer from configure_optimizers(), found "
                f"{len(optimizers)} ({', '.join(type(o).__name__ for o in optimizers) or 'none'}); one GEMINI step "
                "must be one optimizer step")
        self.optimizer = optimizers[0]
        if self.kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # The strategy wrapped the module in setup(), before on_fit_start built this adapter.
            if isinstance(trainer.strategy.model, DistributedDataParallel):
                pin_bucket_layout(trainer.strategy.model)
        self._skip_replication_if_hsdp = skip_replication_if_hsdp
        self._callbacks: Optional[StepCallbacks] = None
        self._boundary: Optional[Dict[str, Any]] = None   # Lightning state at the end of the captured step
        self.restored: Optional[Dict[str, Any]] = None     # the Lightning checkpoint handed to Lightning
        self.restored_step: Optional[int] = None
        self._rng_before_batch: Optional[Dict[str, Any]] = None
        self._skip_batches = 0

    # --------------------------------------------------------------- topology

    def topology(self) -> Topology:
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        if self.kind == "model_parallel":
            mesh = self.trainer.strategy.device_mesh
            names = list(mesh.mesh_dim_names or [])
            shape = [int(s) for s in mesh.shape]
            sizes = dict(zip(names, shape))
            dp, tp = int(sizes.get("data_parallel", 1)), int(sizes.get("tensor_parallel", 1))
            # FSDP2 shards over the data-parallel dimension and TP over the other one: every rank
            # holds a unique piece of the state, so GEMINI keeps its peer replicas.
            kind = "fsdp2" if tp == 1 else ("tp" if dp == 1 else "fsdp2_tp")
            descriptor = {"kind": kind, "strategy": type(self.trainer.strategy).__name__,
                          "mesh_shape": shape, "mesh_dim_names": names,
                          "coordinate": list(mesh.get_coordinate() or []),
                          "dp_replicate": 1, "dp_shard": dp, "tp": tp}
            return Topology(kind=kind, replicate=True, descriptor=descriptor)
        descriptor = {"kind": self.kind, "strategy": type(self.trainer.strategy).__name__,
                      "dp_replicate": world if self.kind == "ddp" else 1, "dp_shard": 1}
        return Topology(kind=self.kind, replicate=True, descriptor=descriptor)

    # ------------------------------------------------------------------ state

    def mark_boundary(self) -> None:
        """At `on_train_batch_end` of a step that GEMINI will capture: snapshot the loop progress
        (it moves on before the next forward, when the capture reads the rest)."""
        fit_loop = self.trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        progress = epoch_loop.batch_progress
        # Batches of the current epoch already consumed; 0 when the epoch ends with this step.
        consumed = 0 if progress.is_last_batch else int(progress.current.processed)
        self._boundary = {
            "epoch": int(self.trainer.current_epoch),
            "global_step": int(self.trainer.global_step),
            "loops": {"fit_loop": copy.deepcopy(fit_loop.state_dict())},
            "batches_consumed": consumed,
        }

    def framework_state(self) -> Dict[str, Any]:
        buffers = {id(b) for b in self.module.buffers()}
        model = {name: value.detach().clone() if id(value) in buffers else value.detach()
                 for name, value in self.module.state_dict(keep_vars=True).items()}
        # Read right before the next batch's forward: restored at that same point after a restart.
        return {"model": model, "optimizer": self.optimizer.state_dict(), "rng_before_batch": capture_rng()}

    def deferred_state(self) -> Dict[str, Any]:
        if self._boundary is None:
            raise RuntimeError("Lightning adapter: a capture was started without a step boundary snapshot")
        trainer = self.trainer
        state = dict(self._boundary)
        state["lr_schedulers"] = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
        state["callbacks"] = compat.callbacks_state_dict(trainer, self.package)
        precision = trainer.precision_plugin
        state["precision"] = {type(precision).__qualname__: precision.state_dict()} if precision.state_dict() else {}
        datamodule = trainer.datamodule
        dm_state = datamodule.state_dict() if datamodule is not None else None
        state["datamodule"] = {type(datamodule).__qualname__: dm_state} if dm_state else {}
        return {"lightning": state}

    def load_framework_state(self, state: Dict[str, Any]) -> None:
        load_model_in_place(self.module, state["model"])
        self.optimizer.load_state_dict(rewrap_optimizer_state(self.optimizer, state["optimizer"]))
        self._rng_before_batch = state["rng_before_batch"]
        self._recovered_model = state["model"]
        self._recovered_optimizer = state["optimizer"]

    def load_deferred_state(self, state: Dict[str, Any]) -> None:
        """Hand the recovered state to Lightning's checkpoint connector as its loaded checkpoint."""
        saved = state["lightning"]
        if len(saved["lr_schedulers"]) != len(self.trainer.lr_scheduler_configs):
            raise ValueError(f"the recovered checkpoint has {len(saved['lr_schedulers'])} LR scheduler(s), the "
                             f"Trainer has {len(self.trainer.lr_scheduler_configs)}")
        checkpoint: Dict[str, Any] = {
            "epoch": saved["epoch"], "global_step": saved["global_step"],
            "pytorch-lightning_version": importlib.import_module(self.package).__version__,
            # Already copied in place by load_framework_state; kept so that strategies which load
            # from the dictionary (DDP, single device) and the on_load_checkpoint hooks see them.
            "state_dict": self._recovered_model,
            "optimizer_states": [self._recovered_optimizer],
            "loops": saved["loops"],
            "lr_schedulers": saved["lr_schedulers"],
            "callbacks": saved["callbacks"],
            **saved["precision"], **saved["datamodule"],
        }
        self.restored = checkpoint
        self.restored_step = saved["global_step"]
        self._skip_batches = int(saved["batches_consumed"])
        del self._recovered_model, self._recovered_optimizer

    # --------------------------------------------------------- Lightning side

    def hand_to_lightning(self) -> None:
        """Make the recovered checkpoint Lightning's loaded checkpoint. Lightning restores
        precision, loops, optimizer (where the strategy loads it) and schedulers right after
        `on_fit_start`; strategies that restore modules before setup (DDP, single device) already
        ran that step, so the model, datamodule and callbacks are restored here."""
        if self.restored is None:
            return
        trainer = self.trainer
        compat.set_loaded_checkpoint(trainer, self.restored)

        def superseded(checkpoint_path: Optional[str]) -> None:
            if checkpoint_path:
                logger.warning("lm-resiliency: GEMINI step %d supersedes ckpt_path=%s", self.restored_step,
                               checkpoint_path)

        if trainer.strategy.restore_checkpoint_after_setup:
            # Lightning calls resume_start(ckpt_path) after on_fit_start: a ckpt_path the user passed
            # would replace the newer GEMINI state. Skip that one load.
            compat.skip_next_resume_start(trainer, superseded)
        else:
            superseded(compat.take_ckpt_path(trainer))
            compat.restore_before_setup(trainer)
        logger.info("lm-resiliency: Lightning restores GEMINI step %d (%s)", self.restored_step, self.describe())

    def on_train_start(self) -> None:
        """After Lightning restored everything: position non-stateful dataloaders."""
        if self.restored is None:
            return
        trainer = self.trainer
        compat.forget_resume_start(trainer)  # if Lightning did not call it
        if trainer.global_step != self.restored_step:
            raise RuntimeError(f"lm-resiliency: Lightning resumed at global_step {trainer.global_step}, but the "
                               f"recovered GEMINI state is step {self.restored_step}; refusing to continue")
        self.restored = None
        skip, self._skip_batches = self._skip_batches, 0
        if skip:
            self._fast_forward(skip)

    def _fast_forward(self, skip: int) -> None:
        """Lightning repositions stateful dataloaders itself; plain ones restart their epoch, so the
        batches this epoch already trained on are drawn again and discarded."""
        fit_loop = self.trainer.fit_loop
        combined, fetcher = compat.training_fetch(self.trainer)
        if combined is None or fetcher is None:
            return
        loaders = list(combined.flattened)
        stateful = [callable(getattr(dl, "state_dict", None)) and callable(getattr(dl, "load_state_dict", None))
                    for dl in loaders]
        if all(stateful):
            return
        if any(stateful):
            raise RuntimeError("lm-resiliency: cannot resume mid-epoch with a mix of stateful and plain training "
                               "dataloaders; make all of them stateful (state_dict/load_state_dict)")
        if fetcher.length is None:
            raise RuntimeError("lm-resiliency: resuming mid-epoch needs a training dataloader with a length or a "
                               "stateful one (state_dict/load_state_dict); this one has neither")
        for loader in loaders:  # the epoch's shuffle order must be the one in effect before the crash
            compat.set_sampler_epoch(self.package, loader, fit_loop.epoch_progress.current.processed)
        for _ in range(skip):
            next(fetcher.iterator)
        # Lightning warns next that a plain dataloader cannot resume mid-epoch; it now has.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch",
                                category=UserWarning)
        logger.info("lm-resiliency: skipped %d batches already trained on in epoch %d", skip,
                    self.trainer.current_epoch)

    def before_batch(self) -> None:
        """First micro-batch after a resume: the RNG streams as they were right before this batch."""
        if self._rng_before_batch is not None:
            rng, self._rng_before_batch = self._rng_before_batch, None
            restore_rng(rng)

    # ------------------------------------------------------------------ hooks

    def install(self, callbacks: StepCallbacks) -> None:
        # Lightning has no optimizer post-step hook; the callback drives these from its hooks.
        self._callbacks = callbacks

    @property
    def step_callbacks(self) -> StepCallbacks:
        if self._callbacks is None:
            raise RuntimeError("Lightning adapter: not installed in a session")
        return self._callbacks

    def replay_targets(self) -> tuple:
        return self.module, self.optimizer

    def remove(self) -> None:
        self._callbacks = None

    def describe(self) -> str:
        return f"lightning/{self.kind}"


__all__ = ["LightningAdapter", "LightningStrategyError", "SUPPORTED_STRATEGIES", "check_strategy",
           "lightning_package", "strategy_kind"]
