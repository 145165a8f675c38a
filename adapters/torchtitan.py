"""TorchTitan adapter: where an initialized `torchtitan.trainer.Trainer` keeps its training state.

Captured per rank, the same state TorchTitan's own `CheckpointManager` saves, read without its
collective paths:

  model        every model part's parameters as local shards (FSDP2/TP DTensors: `to_local()`)
               and persistent buffers, read from the parameters themselves, not from
               `model.state_dict()` (collective under TorchTitan, and it gathers full tensors)
  optimizer    each inner torch optimizer of the `OptimizersContainer`, through
               `torch.optim.Optimizer.state_dict` (the container's own `state_dict()` runs a
               zero-lr step, which would fire step hooks and is collective)
  lr_scheduler each `LambdaLR` of the `LRSchedulersContainer`
  dataloader   the `StatefulDataLoader` state of this rank (TorchTitan pickles it into bytes for
               DCP; GEMINI stores the plain dict and never unpickles)
  trainer      `step` and `ntokens_seen` (TorchTitan's "train_state")

The dataloader and counters are read at the step boundary itself (`snapshot_boundary`, called by
the hooks in `checkpointer.save`), because the next batch is fetched before the next forward; the
data position is deep-copied there, since a dataset's `state_dict()` may return its live buffers.
Topology comes from the trainer's `ParallelDims`. The hooks live in
`lm_resiliency.callbacks.torchtitan`, which builds this adapter.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from lm_resiliency.adapter import HookFactoryAdapter, StepCallbacks, Topology
from lm_resiliency.wrappers import persistent_buffers
from lm_resiliency.adapters.pytorch import rewrap_optimizer_state

logger = logging.getLogger(__name__)

SUPPORTED_OPTIONS: frozenset = frozenset()
# ParallelDims degrees; the last four split the model, so SCOUT peers must share their coordinates.
_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


def peer_layout(parallel_dims: Any) -> Dict[str, Any]:
    """SCOUT's view of a `ParallelDims` layout, for `scout.peers.peer_groups_from_topology`.

    TorchTitan unflattens one flat `world` mesh (ranks 0..n-1) row-major into
    (pp, dp_replicate, dp_shard, cp, tp) for the dense parameters, so SCOUT cannot read the layout
    from the parameters' root mesh: the degrees name it. Dense replay peers vary along
    dp_replicate and dp_shard (FSDP shard peers replay the unsharded module) and share the TP
    coordinate. Layouts whose replay would not compare like with like are named with the reason."""
    degrees = {name: int(getattr(parallel_dims, name)) for name in _DEGREES}
    if degrees["ep"] > 1:
        return {"unsupported": f"expert parallelism (ep={degrees['ep']}): a replayed MoE layer exchanges tokens "
                               "with ranks outside the data-parallel peer group"}
    if degrees["cp"] > 1:
        return {"unsupported": f"context parallelism (cp={degrees['cp']}): peers at one context-parallel "
                               "coordinate hold different sequence chunks and attention is split across ranks"}
    if degrees["pp"] > 1:
        return {"unsupported": f"pipeline parallelism (pp={degrees['pp']})"}
    names = ("dp_replicate", "dp_shard", "tp")
    return {"shape": [degrees[name] for name in names], "names": list(names)}


def is_torchtitan_trainer(obj: Any) -> bool:
    try:
        from torchtitan.trainer import Trainer
    except ImportError:  # no TorchTitan installed: nothing can be its trainer
        return False
    return isinstance(obj, Trainer)


def _local(value: torch.Tensor) -> torch.Tensor:
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value



def _stateful_loader_class() -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader


class TorchTitanAdapter(HookFactoryAdapter):
    """Adapter for one initialized TorchTitan `Trainer` (see module doc).

    `hooks` registers the lifecycle hooks: a callable `(adapter, callbacks) -> object with
    remove()`, supplied by `lm_resiliency.callbacks.torchtitan`."""

    framework = "torchtitan"

    def __init__(self, trainer: Any, *, hooks: Callable[["TorchTitanAdapter", StepCallbacks], Any]) -> None:
        if not is_torchtitan_trainer(trainer):
            raise TypeError("TorchTitan adapter: expected an initialized torchtitan Trainer (config.build()), got "
                            f"{type(trainer).__module__}.{type(trainer).__qualname__}")
        missing = [name for name in ("model_parts", "optimizers", "lr_schedulers", "dataloader", "checkpointer",
                                     "parallel_dims") if getattr(trainer, name, None) is None]
        if missing:
            raise TypeError(f"TorchTitan adapter: the trainer has no {missing}; pass it after Trainer.__init__ "
                            "finished (enable_resiliency(trainer) right before trainer.train())")
        dims = trainer.parallel_dims
        if int(dims.pp) > 1:
            raise TypeError(f"TorchTitan adapter: pipeline parallelism (pp={dims.pp}) is not supported in this "
                            "release; data parallel, FSDP2, HSDP and tensor parallel are")
        self.trainer = trainer
        self.model_parts: List[nn.Module] = list(trainer.model_parts)
        self.optimizers = list(trainer.optimizers.optimizers)
        self.schedulers = list(trainer.lr_schedulers.schedulers)
        if len(self.optimizers) != len(self.model_parts):
            raise TypeError(f"TorchTitan adapter: {len(self.optimizers)} optimizers for {len(self.model_parts)} "
                            "model parts; expected one optimizer per part (OptimizersContainer)")
        if not isinstance(trainer.dataloader, _stateful_loader_class()):
            raise TypeError(f"TorchTitan adapter: the dataloader {type(trainer.dataloader).__name__} is not a "
                            "torchdata StatefulDataLoader, so its position cannot be captured")
        HookFactoryAdapter.__init__(self, hooks)
        self._boundary: Optional[Dict[str, Any]] = None
        self.recovered_step: Optional[int] = None  # set when GEMINI state was loaded into the trainer

    # --------------------------------------------------------------- topology

    def degrees(self) -> Dict[str, int]:
        dims = self.trainer.parallel_dims
        return {name: int(getattr(dims, name)) for name in _DEGREES}

    def topology(self) -> Topology:
        degrees = self.degrees()
        replicate, shard = degrees["dp_replicate"], degrees["dp_shard"]
        model_parallel = degrees["tp"] * degrees["cp"] * degrees["ep"]
        if model_parallel > 1:
            kind = "dp_tp" if replicate * shard > 1 else "tp"
        else:
            kind = "hsdp" if replicate > 1 and shard > 1 else ("fsdp2" if shard > 1 else "ddp")
        descriptor: Dict[str, Any] = {"kind": kind, **degrees, "world_size": int(self.trainer.parallel_dims.world_size),
                                      "peer_layout": peer_layout(self.trainer.parallel_dims)}
        # Every rank's shard (or TP slice) is unique except across dp_replicate; GEMINI keeps a peer
        # copy in every layout (an HSDP replica could die with its peer).
        return Topology(kind=f"torchtitan-{kind}", replicate=True, descriptor=descriptor)

    def describe(self) -> str:
        return f"torchtitan/{self.topology().descriptor['kind']}"

    # ------------------------------------------------------------------ state

    def snapshot_boundary(self) -> None:
        """Called at the step boundary (after optimizer and LR scheduler stepped, before the next
        batch is fetched): the counters and the data position that belong to this step."""
        trainer = self.trainer
        # A deep copy: the capture completes in the next forward, after the next batch was fetched,
        # and TorchTitan's text dataset hands out its live token buffers, which that fetch extends
        # in place (DCP is immune only because it pickles the state at once).
        self._boundary = {
            "trainer": {"step": int(trainer.step), "ntokens_seen": int(trainer.ntokens_seen)},
            "dataloader": copy.deepcopy(_stateful_loader_class().state_dict(trainer.dataloader)),
        }

    def framework_state(self) -> Dict[str, Any]:
        if self._boundary is None:
            raise RuntimeError("TorchTitan adapter: capture requested before any step boundary was recorded "
                               "(checkpointer.save() hook did not run)")
        parts = []
        for module in self.model_parts:
            # Parameters change only in optimizers.step(), after GEMINI's maybe_wait(); buffers may
            # change in the forward that runs while the copy is in flight, so they are cloned.
            params = {name: _local(p).detach() for name, p in module.named_parameters()}
            buffers = {name: _local(b).detach().clone() for name, b in persistent_buffers(module).items()}
            parts.append({"params": params, "buffers": buffers})
        return {
            "model_parts": parts,
            "optimizers": [torch.optim.Optimizer.state_dict(opt) for opt in self.optimizers],
            "lr_schedulers": [scheduler.state_dict() for scheduler in self.schedulers],
            **self._boundary,
        }

    def load_framework_state(self, state: Dict[str, Any]) -> None:
        missing = sorted({"model_parts", "optimizers", "lr_schedulers", "dataloader", "trainer"} - set(state))
        if missing:
            raise ValueError(f"recovered TorchTitan state lacks {missing}; refusing to load it")
        counts = (len(state["model_parts"]), len(state["optimizers"]), len(state["lr_schedulers"]))
        if counts != (len(self.model_parts), len(self.optimizers), len(self.schedulers)):
            raise ValueError(f"recovered TorchTitan state has (model parts, optimizers, schedulers) = {counts}, the "
                             f"trainer has {(len(self.model_parts), len(self.optimizers), len(self.schedulers))}")
        for module, saved in zip(self.model_parts, state["model_parts"]):
            self._check_part(module, saved)  # everything checked before anything changes
        with torch.no_grad():
            for module, saved in zip(self.model_parts, state["model_parts"]):
                for name, p in module.named_parameters():
                    _local(p).copy_(saved["params"][name])
                for name, b in persistent_buffers(module).items():
                    _local(b).copy_(saved["buffers"][name])
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            optimizer.load_state_dict(rewrap_optimizer_state(optimizer, saved))
        for scheduler, saved in zip(self.schedulers, state["lr_schedulers"]):
            scheduler.load_state_dict(saved)
        _stateful_loader_class().load_state_dict(self.trainer.dataloader, state["dataloader"])
        self.trainer.step = int(state["trainer"]["step"])
        self.trainer.ntokens_seen = int(state["trainer"]["ntokens_seen"])
        self.recovered_step = self.trainer.step

    @staticmethod
    def _check_part(module: nn.Module, saved: Dict[str, Any]) -> None:
        live = {"params": {n: _local(p) for n, p in module.named_parameters()},
                "buffers": {n: _local(b) for n, b in persistent_buffers(module).items()}}
        for kind, tensors in live.items():
            got = saved.get(kind) if isinstance(saved, dict) else None
            recovered = got if isinstance(got, dict) else {}
            names = set(recovered)
            if names != set(tensors):
                raise ValueError(f"recovered model {kind} do not match the trainer's model: missing "
                                 f"{sorted(set(tensors) - names)[:8]}, unexpected {sorted(names - set(tensors))[:8]}")
            for name, target in tensors.items():
                value = recovered[name]
                if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
                    raise ValueError(f"recovered {name} has shape {tuple(value.shape)} {value.dtype}, the live "
                                     f"model has {tuple(target.shape)} {target.dtype} on this rank (was the "
                                     "parallel layout changed? GEMINI restores the same layout only)")

    # ------------------------------------------------------------------ hooks

    def replay_targets(self) -> tuple:
        return self.model_parts[0], self.optimizers[0]
