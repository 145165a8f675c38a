"""Megatron Core adapter: where the objects `setup_model_and_optimizer()` returns keep their state.

Captured per rank, read without Megatron's collective checkpoint paths:

  model_chunks  every chunk's parameters and persistent buffers (one chunk per virtual pipeline
                stage; a chunk wrapped in Megatron's `DistributedDataParallel` keeps its parameters
                in the contiguous param buffer, and the in-place restore writes through to it)
  optimizers    for each `MegatronOptimizer` (the members of a `ChainedOptimizer`, or the one
                optimizer): the inner torch optimizer's state (`exp_avg`, `exp_avg_sq`, `step` and
                the param groups, which the scheduler also writes), the fp32 main parameters it
                steps (under the distributed optimizer: this rank's shard; under the float16
                optimizer: the fp32 copies; under the fp32 optimizer: the model parameters), and
                the grad scaler's state
  scheduler     the `OptimizerParamScheduler` state, read before the next forward because the
                training loop steps it after `optimizer.step()` (a deferred state)

Topology comes from `megatron.core.parallel_state`: the TP, PP, virtual-PP, CP, DP (with and
without CP), EP and expert-TP/expert-DP sizes and this rank's coordinates. SCOUT's dense peers
are the data-parallel group without CP (ranks at equal TP, PP and CP coordinates); the
expert-data-parallel groups (equal EP and expert-TP coordinates) travel with them for expert
replay. The hook on `optimizer.step()` lives in `lm_resiliency.callbacks.megatron`, which builds
this adapter.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency.adapter import HookFactoryAdapter, StepCallbacks, Topology, gather_partition
from lm_resiliency.wrappers import persistent_buffers

logger = logging.getLogger(__name__)

SUPPORTED_OPTIONS: frozenset = frozenset({"opt_param_scheduler", "iteration"})


def _megatron_optimizer_class() -> Any:
    try:
        from megatron.core.optimizer import MegatronOptimizer
    except ImportError:  # no Megatron Core installed: nothing can be its optimizer
        return None
    return MegatronOptimizer


def is_megatron_optimizer(obj: Any) -> bool:
    cls = _megatron_optimizer_class()
    return cls is not None and isinstance(obj, cls)


def leaf_optimizers(optimizer: Any) -> List[Any]:
    """The `MegatronOptimizer`s that own state: a `ChainedOptimizer`'s members, else the one."""
    chained = getattr(optimizer, "chained_optimizers", None)
    return list(chained) if chained is not None else [optimizer]



def _main_params(leaf: Any) -> List[torch.Tensor]:
    inner = leaf.optimizer
    return [] if inner is None else [p for group in inner.param_groups for p in group["params"]]


class _NoOptimizerCheck:
    """What SCOUT sees as the optimizer when the inner optimizer steps copies of the model
    parameters (distributed optimizer shards, fp32 main copies): its state is not keyed by the
    replayed parameters, and under the distributed optimizer it differs across data-parallel peers,
    so there is nothing a peer vote could compare."""

    param_groups: list = []
    state: dict = {}


class MegatronAdapter(HookFactoryAdapter):
    """Adapter for Megatron Core's model chunks, `MegatronOptimizer` and `OptimizerParamScheduler`
    (see module doc). Collective to construct: every rank gathers the data-parallel groups.

    `hooks` registers the step hook: a callable `(adapter, callbacks) -> object with remove()`,
    supplied by `lm_resiliency.callbacks.megatron`."""

    framework = "megatron"

    def __init__(self, model_chunks: Any, optimizer: Any, *, opt_param_scheduler: Any = None,
                 hooks: Callable[["MegatronAdapter", StepCallbacks], Any], timeout_s: float = 300.0) -> None:
        if not isinstance(model_chunks, (list, tuple)) or not model_chunks or \
                not all(isinstance(m, nn.Module) for m in model_chunks):
            raise TypeError("Megatron adapter: the first argument must be the list of model chunks "
                            "setup_model_and_optimizer() returns (torch.nn.Module objects), got "
                            f"{type(model_chunks).__name__}")
        if not is_megatron_optimizer(optimizer):
            raise TypeError("Megatron adapter: the second argument must be the MegatronOptimizer "
                            "setup_model_and_optimizer() returns (get_megatron_optimizer()), got "
                            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
        if opt_param_scheduler is not None and not all(
                callable(getattr(opt_param_scheduler, name, None)) for name in ("state_dict", "load_state_dict")):
            raise TypeError("opt_param_scheduler= must be Megatron's OptimizerParamScheduler (state_dict() and "
                            f"load_state_dict()), got {type(opt_param_scheduler).__name__}")
        from megatron.core import parallel_state

        if not parallel_state.is_initialized():
            raise RuntimeError("Megatron adapter: megatron.core.parallel_state is not initialized; call "
                               "enable_resiliency after initialize_model_parallel() and setup_model_and_optimizer()")
        self.model_chunks: List[nn.Module] = list(model_chunks)
        self.optimizer = optimizer
        self.leaves = leaf_optimizers(optimizer)
        self.scheduler = opt_param_scheduler
        self._descriptor = self._read_topology(parallel_state, timeout_s)
        model_params = {id(p) for module in self.model_chunks for p in module.parameters()}
        # Main params that are the model parameters themselves (the fp32 optimizer) are captured
        # once, with the model.
        self._aliased = [[id(p) in model_params for p in _main_params(leaf)] for leaf in self.leaves]
        HookFactoryAdapter.__init__(self, hooks)

    # --------------------------------------------------------------- topology

    def _read_topology(self, ps: Any, timeout_s: float) -> Dict[str, Any]:
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        dp_group = ps.get_data_parallel_group(with_context_parallel=False)
        expert_dp_group = ps.get_expert_data_parallel_group()
        descriptor: Dict[str, Any] = {
            "kind": "megatron",
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": int(vpp) if vpp is not None else 1,
            "model_chunks": len(self.model_chunks),
            "cp": ps.get_context_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(with_context_parallel=False),
            "dp_cp": ps.get_data_parallel_world_size(with_context_parallel=True),
            "ep": ps.get_expert_model_parallel_world_size(),
            "expert_tp": ps.get_expert_tensor_parallel_world_size(),
            "expert_dp": ps.get_expert_data_parallel_world_size(),
            "coordinate": {
                "tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                "cp": ps.get_context_parallel_rank(), "dp": ps.get_data_parallel_rank(with_context_parallel=False),
                "ep": ps.get_expert_model_parallel_rank(), "expert_tp": ps.get_expert_tensor_parallel_rank(),
                "expert_dp": ps.get_expert_data_parallel_rank(),
            },
            "distributed_optimizer": any(type(leaf).__name__ == "DistributedOptimizer" for leaf in self.leaves),
        }
        # Dense replay peers hold the same parameters at equal TP/PP/CP coordinates: Megatron's
        # data-parallel group without context parallelism, gathered so every rank knows all of them.
        source = "Megatron adapter (megatron.core.parallel_state)"
        descriptor["peer_groups"] = gather_partition(dist.get_process_group_ranks(dp_group), timeout_s, source)
        descriptor["expert_peer_groups"] = gather_partition(dist.get_process_group_ranks(expert_dp_group), timeout_s,
                                                            source)
        return descriptor

    def topology(self) -> Topology:
        # Every rank's TP slice and distributed-optimizer shard is unique: GEMINI keeps a peer copy.
        return Topology(kind="megatron", replicate=True, descriptor=dict(self._descriptor))

    def describe(self) -> str:
        d = self._descriptor
        return f"megatron/tp{d['tp']}-pp{d['pp']}-vpp{d['vpp']}-cp{d['cp']}-dp{d['dp']}-ep{d['ep']}"

    # ------------------------------------------------------------------ state

    def framework_state(self) -> Dict[str, Any]:
        chunks = []
        for module in self.model_chunks:
            # Parameters change only in optimizer.step(), after GEMINI's maybe_wait(); buffers may
            # change in the forward that runs while the copy is in flight, so they are cloned.
            chunks.append({"params": {name: p.detach() for name, p in module.named_parameters()},
                           "buffers": {name: b.detach().clone() for name, b in persistent_buffers(module).items()}})
        optimizers = []
        for leaf, aliased in zip(self.leaves, self._aliased):
            inner = leaf.optimizer
            scaler = getattr(leaf, "grad_scaler", None)
            optimizers.append({
                "inner": torch.optim.Optimizer.state_dict(inner) if inner is not None else None,
                "main_params": [None if alias else p.detach() for p, alias in zip(_main_params(leaf), aliased)],
                "grad_scaler": _scaler_state(scaler.state_dict()) if scaler is not None else None,
            })
        return {"model_chunks": chunks, "optimizers": optimizers}

    def deferred_state(self) -> Dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict()} if self.scheduler is not None else {}

    def load_framework_state(self, state: Dict[str, Any]) -> None:
        missing = sorted({"model_chunks", "optimizers"} - set(state))
        if missing:
            raise ValueError(f"recovered Megatron state lacks {missing}; refusing to load it")
        counts = (len(state["model_chunks"]), len(state["optimizers"]))
        if counts != (len(self.model_chunks), len(self.leaves)):
            raise ValueError(f"recovered Megatron state has (model chunks, optimizers) = {counts}, this job has "
                             f"{(len(self.model_chunks), len(self.leaves))} (was the virtual pipeline or the MoE "
                             "layout changed? GEMINI restores the same layout only)")
        for module, saved in zip(self.model_chunks, state["model_chunks"]):
            _check_chunk(module, saved)  # everything checked before anything changes
        for leaf, aliased, saved in zip(self.leaves, self._aliased, state["optimizers"]):
            main = saved.get("main_params")
            _check_tensors("main parameters", dict(enumerate(None if alias else p for p, alias in
                                                             zip(_main_params(leaf), aliased))),
                           dict(enumerate(main)) if isinstance(main, list) else None)
            if (saved.get("grad_scaler") is None) != (getattr(leaf, "grad_scaler", None) is None):
                raise ValueError("recovered Megatron optimizer state and this optimizer disagree on a grad scaler "
                                 "(fp16 loss scaling); resume with the same precision settings")
        with torch.no_grad():
            for module, saved in zip(self.model_chunks, state["model_chunks"]):
                for name, p in module.named_parameters():
                    p.copy_(saved["params"][name])
                for name, b in persistent_buffers(module).items():
                    b.copy_(saved["buffers"][name])
            for leaf, saved in zip(self.leaves, state["optimizers"]):
                for target, value in zip(_main_params(leaf), saved["main_params"]):
                    if value is not None:
                        target.copy_(value)
        for leaf, saved in zip(self.leaves, state["optimizers"]):
            if saved["inner"] is not None:
                torch.optim.Optimizer.load_state_dict(leaf.optimizer, saved["inner"])
            if saved["grad_scaler"] is not None:
                leaf.grad_scaler.load_state_dict(saved["grad_scaler"])

    def load_deferred_state(self, state: Dict[str, Any]) -> None:
        if self.scheduler is None:
            if "scheduler" in state:
                raise ValueError("the recovered checkpoint has OptimizerParamScheduler state but no "
                                 "opt_param_scheduler= was given; pass the scheduler setup_model_and_optimizer() "
                                 "returned")
            return
        if "scheduler" not in state:
            raise ValueError("opt_param_scheduler= was given, but the recovered checkpoint has no scheduler state")
        self.scheduler.load_state_dict(state["scheduler"])

    # ------------------------------------------------------------------ hooks

    def replay_targets(self) -> tuple:
        # SCOUT's optimizer check shadows a step of the replayed parameters' own optimizer state:
        # only the fp32 optimizer (no distributed optimizer) steps the model parameters themselves.
        first = self.leaves[0]
        if first.optimizer is not None and self._aliased[0] and all(self._aliased[0]):
            return self.model_chunks[0], first.optimizer
        return self.model_chunks[0], _NoOptimizerCheck()


def _scaler_state(state: Dict[str, Any]) -> Dict[str, Any]:
    # The scale tensor is updated in place by the next step: the capture keeps its own copy.
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _check_tensors(what: str, live: Dict[Any, Optional[torch.Tensor]], saved: Any) -> None:
    """The same names, each with the same shape and dtype; a None (a main parameter that is a
    model parameter, captured once with the model) must be None on both sides."""
    if not isinstance(saved, dict) or set(saved) != set(live):
        got = set(saved) if isinstance(saved, dict) else set()
        raise ValueError(f"recovered Megatron {what} do not match this job's: missing "
                         f"{sorted(set(live) - got, key=str)[:8]}, unexpected {sorted(got - set(live), key=str)[:8]}")
    for name, target in live.items():
        value = saved[name]
        if target is None or value is None:
            if (target is None) != (value is None):
                raise ValueError(f"recovered Megatron {what} {name!r}: captured and live optimizer disagree on "
                                 "whether it is a model parameter (was the optimizer type or precision changed?)")
            continue
        if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
            raise ValueError(f"recovered Megatron {what} {name!r} has shape {tuple(value.shape)} {value.dtype}, this "
                             f"rank's has {tuple(target.shape)} {target.dtype} (was the parallel layout or precision "
                             "changed? GEMINI restores the same layout only)")


def _check_chunk(module: nn.Module, saved: Any) -> None:
    live = {"parameters": dict(module.named_parameters()), "buffers": persistent_buffers(module)}
    for kind, key in (("parameters", "params"), ("buffers", "buffers")):
        _check_tensors(f"model chunk {kind}", live[kind], saved.get(key) if isinstance(saved, dict) else None)
