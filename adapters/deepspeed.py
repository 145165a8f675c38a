"""DeepSpeed adapter: where a DeepSpeed engine keeps model, optimizer and engine state.

Capture reads each rank's own state, the same per-rank state DeepSpeed itself writes to its
`zero_pp_rank_*` checkpoint files:

  ZeRO 0-2  the module's state (full bit16/fp32 parameters and buffers, identical on every rank)
  ZeRO 3    each parameter's local partition (`param.ds_tensor`) and the module's buffers
  ZeRO 1-3  the ZeRO optimizer's `state_dict()`: the fp32 master partition and the wrapped
            torch optimizer's state over it, loss scaler, overflow and clipping flags
  ZeRO 0    the torch optimizer's `state_dict()`
  always    the engine counters (`global_steps`, `global_samples`, `skipped_steps`,
            `micro_steps`) and the engine's LR scheduler

Restore goes through DeepSpeed's own rigid (same DP degree) optimizer `load_state_dict` with
fp32 master weights (`load_from_fp32_weights=True`, no precision loss), wrapped in the ZeRO-3
checkpoint prologue/epilogue exactly as `engine.load_checkpoint()` does; the module state is
copied in place. Values DeepSpeed keeps as Python objects (the loss scaler, the stage enum) are
stored as plain fields and put back onto the live objects; derived universal-checkpoint
metadata (`param_slice_mappings`) is not captured.

MoE engines (`deepspeed.moe.layer.MoE`, ZeRO 0-2; DeepSpeed refuses them under ZeRO-3): each
rank captures its own experts with the rest of its state. The topology carries the expert layout
from `deepspeed.utils.groups`: the expert-parallel size of each expert group name, the
expert-data-parallel groups gathered from every rank (`expert_peer_groups`, where SCOUT's expert
replay finds its peers) and the paths of the expert modules, which dense replay leaves to the
expert replay (experts differ across expert-parallel ranks, so data-parallel peers cannot
compare them).

The engine is hooked by `lm_resiliency.callbacks.deepspeed` (which builds this adapter); this
module only imports DeepSpeed lazily, inside the functions that need it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from lm_resiliency.adapter import HookFactoryAdapter, StepCallbacks, Topology, gather_partition
from lm_resiliency.attach import AttachOptions
from lm_resiliency.settings import read_settings

logger = logging.getLogger(__name__)

# enable_resiliency(engine, ...) takes no DeepSpeed-specific options in this release.
SUPPORTED_OPTIONS: frozenset = frozenset()

CONFIG_SECTION = "lm_resiliency"

# Keys of a ZeRO optimizer state_dict (deepspeed.checkpoint.constants), spelled here so that this
# module does not import DeepSpeed at import time.
_LOSS_SCALER = "loss_scaler"
_ZERO_STAGE = "zero_stage"
_BASE_OPTIMIZER_STATE = "base_optimizer_state"
_BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
_SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
_FP32_FLAT_GROUPS = "fp32_flat_groups"
_OPTIMIZER_STATE_DICT = "optimizer_state_dict"
_GROUP_PADDINGS = "group_paddings"
_PARTITION_COUNT = "partition_count"
# Derived metadata for universal checkpoints (fragment objects); rebuilt by DeepSpeed, not needed
# for a rigid same-topology restore.
_NOT_CAPTURED = ("param_slice_mappings", "universal_checkpoint_info")
_SCALAR_TYPES = (type(None), bool, int, float, str, torch.dtype)


class _NoOptimizerCheck:
    """What SCOUT sees as the optimizer: nothing to replay. Under ZeRO each rank's optimizer holds a
    different partition, so a shadow step of it cannot be compared across data-parallel peers."""

    param_groups: list = []
    state: dict = {}


def is_deepspeed_engine(obj: Any) -> bool:
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:  # no DeepSpeed installed: nothing can be its engine
        return False
    return isinstance(obj, DeepSpeedEngine)


def _has_real_optimizer(engine: Any) -> bool:
    from deepspeed.runtime.utils import DummyOptim

    optimizer = engine.optimizer
    if optimizer is None or isinstance(optimizer, DummyOptim):
        return False
    try:
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    except ImportError:  # pragma: no cover - layout of other DeepSpeed releases
        DeepSpeedZeRoOffload = ()
    if DeepSpeedZeRoOffload and isinstance(optimizer, DeepSpeedZeRoOffload):
        return False
    return not isinstance(getattr(optimizer, "optimizer", None), DummyOptim)


def _nvme(offload_config: Any) -> bool:
    device = getattr(offload_config, "device", None)
    return str(getattr(device, "value", device)) == "nvme"


def _precision(engine: Any) -> str:
    if engine.bfloat16_enabled():
        return "bf16"
    return "fp16" if engine.fp16_enabled() else "fp32"


def engine_config(engine: Any) -> Dict[str, Any]:
    """The engine's parsed DeepSpeed config as a dict (a path or base64 config is parsed by DeepSpeed)."""
    parsed = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if isinstance(parsed, dict):
        return parsed
    return engine.config if isinstance(getattr(engine, "config", None), dict) else {}


# ---------------------------------------------------------------- config section


def read_config_section(engine: Any) -> Dict[str, Any]:
    """Validated values of the optional `"lm_resiliency"` section of the engine's DeepSpeed config.

    DeepSpeed keeps unknown top-level keys and ignores them, so the section travels in the same
    JSON file. Its keys and checks are a policy file's (`lm_resiliency.settings.read_settings`):
    unknown keys and bad values raise ConfigError naming the key.
    """
    section = engine_config(engine).get(CONFIG_SECTION)
    if section is None:
        return {}
    where = f'DeepSpeed config "{CONFIG_SECTION}"'
    return read_settings(section, where, f"{where}.")


def apply_config_section(engine: Any, arguments: Dict[str, Any]) -> Dict[str, Any]:
    """Fill `enable_resiliency` arguments that were left at their defaults from the config section.

    Explicit arguments win: `interval`, `checkpoint`, `replay` and `recovery_mode` are taken from
    the section only when None; `enable_checkpoint` / `enable_detection` default to True, so the
    section can only switch them off."""
    section = read_config_section(engine)
    merged = dict(arguments)
    for key, value in section.items():
        if key in ("enable_checkpoint", "enable_detection"):
            merged[key] = bool(arguments[key]) and value
        elif arguments.get(key) is None:
            merged[key] = value
        else:
            logger.info("lm-resiliency: enable_resiliency(%s=...) overrides the DeepSpeed config section", key)
    return merged


def with_config_section(engine: Any, options: AttachOptions) -> AttachOptions:
    """`options` with the engine config section applied (`apply_config_section`), checked again."""
    return options.replace(**apply_config_section(engine, options.section_arguments()))


# ---------------------------------------------------------------- state conversion


def _scaler_fields(scaler: Any) -> Dict[str, Any]:
    """The loss scaler's plain attributes (cur_scale, cur_iter, last_overflow_iter, hysteresis...)."""
    fields = {}
    for name, value in vars(scaler).items():
        if isinstance(value, _SCALAR_TYPES):
            fields[name] = value
        elif isinstance(value, torch.Tensor):
            fields[name] = value.detach().clone()
        else:
            raise TypeError(f"DeepSpeed loss scaler attribute {name!r} has type {type(value).__name__}, which "
                            "GEMINI cannot capture")
    return fields


def _set_scaler_fields(scaler: Any, fields: Dict[str, Any]) -> None:
    live = set(vars(scaler))
    if set(fields) != live:
        raise ValueError(f"recovered loss scaler fields {sorted(fields)} do not match the engine's "
                         f"{type(scaler).__name__} {sorted(live)}")
    for name, value in fields.items():
        current = getattr(scaler, name)
        if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
            current.copy_(value)
        else:
            setattr(scaler, name, value)


def _shape_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return [_shape_of(v) for v in value]
    return value


def _expert_layout(engine: Any, timeout_s: float) -> Dict[str, Any]:
    """An MoE engine's expert layout for the topology descriptor (see the module doc). One expert
    group name (every MoE layer at the same ep_size) fills `ep` and `expert_peer_groups`; with
    several, expert replay cannot use one set of peers, so only the per-name groups are given."""
    from deepspeed.moe.experts import Experts
    from deepspeed.utils import groups

    modules = [path for path, m in engine.module.named_modules() if isinstance(m, Experts)]
    if not modules:  # AutoEP layers keep their experts elsewhere: dense replay could not leave them out
        raise TypeError("DeepSpeed adapter: the engine's MoE layers are not deepspeed.moe.layer.MoE (AutoEP "
                        "replacement layers?); only deepspeed.moe.layer.MoE expert parallelism is supported in "
                        "this release")
    edp = getattr(engine, "expert_data_parallel_group", None) or {}
    names = sorted(edp)
    if not names:
        raise RuntimeError("DeepSpeed adapter: the engine has MoE layers but no expert-data-parallel groups "
                           "(deepspeed.utils.groups); attach after deepspeed.initialize() returns")
    source = "DeepSpeed adapter (deepspeed.utils.groups expert-data-parallel groups)"
    by_name = {name: {"ep": int(groups._get_expert_parallel_world_size(name)),
                      "expert_dp_groups": gather_partition(dist.get_process_group_ranks(edp[name]), timeout_s,
                                                           source)} for name in names}
    layout: Dict[str, Any] = {
        "expert_groups": by_name,
        "expert_modules": modules,
    }
    if len(names) == 1:
        layout["ep"] = by_name[names[0]]["ep"]
        layout["expert_peer_groups"] = by_name[names[0]]["expert_dp_groups"]
    else:
        logger.warning("lm-resiliency: the DeepSpeed MoE layers use %d expert group sizes (%s); SCOUT's expert "
                       "replay needs one set of expert peers, so it is off unless ReplayWorkload(device_mesh=...) "
                       "names the layout", len(names), ", ".join(names))
    return layout


class DeepSpeedAdapter(HookFactoryAdapter):
    """Adapter for one `deepspeed.initialize()` engine (data parallel, ZeRO stage 0-3).

    `hooks` registers the lifecycle hooks on the engine: a callable `(adapter, callbacks) -> object
    with remove()`, supplied by `lm_resiliency.callbacks.deepspeed` (build adapters with its
    `build_adapter`). For an MoE engine construction is collective: every rank gathers the
    expert-data-parallel groups, waiting at most `timeout_s`."""

    framework = "deepspeed"

    def __init__(self, engine: Any, *, hooks: Callable[["DeepSpeedAdapter", StepCallbacks], Any],
                 timeout_s: float = 300.0) -> None:
        if not is_deepspeed_engine(engine):
            raise TypeError("DeepSpeed adapter: expected the engine returned by deepspeed.initialize(), got "
                            f"{type(engine).__module__}.{type(engine).__qualname__}")
        from deepspeed.runtime.pipe.engine import PipelineEngine

        if isinstance(engine, PipelineEngine):
            raise TypeError("DeepSpeed adapter: pipeline-parallel engines (PipelineEngine) are not supported in "
                            "this release; use a data-parallel / ZeRO engine")
        if not _has_real_optimizer(engine):
            raise TypeError(
                "DeepSpeed adapter: this engine has no optimizer (deepspeed.initialize() was called without "
                "optimizer= and without an \"optimizer\" section in the config), so there is no training state "
                "to protect. Build the engine with an optimizer, e.g. config {\"optimizer\": {\"type\": \"AdamW\", "
                "...}} or deepspeed.initialize(..., optimizer=torch.optim.AdamW(...)).")
        unsupported = []
        if int(getattr(engine, "mp_world_size", 1)) != 1:
            unsupported.append(f"model parallelism (mp_world_size={engine.mp_world_size})")
        if int(getattr(engine, "sequence_parallel_size", 1) or 1) != 1:
            unsupported.append(f"sequence parallelism (sequence_parallel_size={engine.sequence_parallel_size})")
        if engine.zero_nvme_offload_optimizer() or _nvme(engine.zero_offload_param()):
            unsupported.append("ZeRO-Infinity NVMe offload (state in swap files)")
        if unsupported:
            raise TypeError(f"DeepSpeed adapter: {', '.join(unsupported)} is not supported in this release; "
                            "data parallel with ZeRO stage 0-3 (optionally with CPU offload) is")
        self.engine = engine
        self.stage = int(engine.zero_optimization_stage())
        self.optimizer = engine.optimizer
        if self.stage == 0 and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"DeepSpeed adapter: ZeRO stage 0 with {type(self.optimizer).__name__} "
                            f"({_precision(engine)}) is not supported; use ZeRO stage 1-3 for fp16/bf16 training, "
                            "or fp32 with a torch optimizer")
        if self.stage > 0 and not callable(getattr(self.optimizer, "load_state_dict", None)):
            raise TypeError(f"DeepSpeed adapter: the ZeRO-{self.stage} optimizer {type(self.optimizer).__name__} "
                            "has no load_state_dict()")
        # Collective (every rank gathers the expert-data-parallel groups), like the rest of attach.
        self._experts = _expert_layout(engine, timeout_s) if getattr(engine, "has_moe_layers", False) else {}
        HookFactoryAdapter.__init__(self, hooks)
        self.recovered_step: Optional[int] = None  # set when GEMINI state was loaded into the engine

    # --------------------------------------------------------------- topology

    def topology(self) -> Topology:
        engine = self.engine
        dp = int(getattr(engine, "dp_world_size", dist.get_world_size() if dist.is_initialized() else 1))
        descriptor = {
            "kind": "deepspeed", "zero_stage": self.stage, "dp_world_size": dp,
            "mp_world_size": int(getattr(engine, "mp_world_size", 1)), "precision": _precision(engine),
            "dp_replicate": dp if self.stage == 0 else 1, "dp_shard": dp if self.stage > 0 else 1,
            **self._experts,
        }
        # ZeRO partitions optimizer state (and for stage 3 parameters): every rank's shard is unique,
        # so GEMINI keeps a peer replica.
        return Topology(kind=f"deepspeed-zero{self.stage}", replicate=True, descriptor=descriptor)

    def describe(self) -> str:
        return f"deepspeed/zero{self.stage}"

    # ------------------------------------------------------------------ state

    def framework_state(self) -> Dict[str, Any]:
        engine = self.engine
        state: Dict[str, Any] = {
            "engine": {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
                       "skipped_steps": int(engine.skipped_steps), "micro_steps": int(engine.micro_steps)},
            "module": self._module_state(),
            "optimizer": self._optimizer_state(),
        }
        scheduler = engine.lr_scheduler
        state["lr_scheduler"] = scheduler.state_dict() if scheduler is not None else None
        return state

    def _module_state(self) -> Dict[str, Dict[str, torch.Tensor]]:
        module = self.engine.module
        buffers = {name: b.detach().clone() for name, b in module.named_buffers() if b is not None}
        if self.stage == 3:
            params = {name: p.ds_tensor.detach() for name, p in module.named_parameters()}
            return {"params": params, "buffers": buffers}
        # Parameters change only in engine.step(), after GEMINI's maybe_wait(); buffers can change
        # in the forward that runs while the copy is in flight, so they are snapshotted now.
        params = {name: p.detach() for name, p in module.named_parameters()}
        return {"params": params, "buffers": buffers}

    def _optimizer_state(self) -> Dict[str, Any]:
        if self.stage == 0:
            return self.optimizer.state_dict()
        saved = self.optimizer.state_dict()
        out: Dict[str, Any] = {}
        for key, value in saved.items():
            if key in _NOT_CAPTURED:
                continue
            if key == _LOSS_SCALER:
                value = _scaler_fields(value)
            elif key == _ZERO_STAGE:
                value = int(value)
            out[key] = value
        if isinstance(out.get(_BASE_OPTIMIZER_STATE), list):
            # elastic_checkpoint=True: DeepSpeed merges every rank's file on load. GEMINI restores the
            # same DP layout, so the rigid form (this rank's torch optimizer state) is exact.
            out[_BASE_OPTIMIZER_STATE] = self.optimizer.optimizer.state_dict()
            out.pop(_BASE_OPTIMIZER_STATE_STEP, None)
        return out

    def load_framework_state(self, state: Dict[str, Any]) -> None:
        missing = sorted({"engine", "module", "optimizer", "lr_scheduler"} - set(state))
        if missing:
            raise ValueError(f"recovered DeepSpeed state lacks {missing}; refusing to load it")
        engine = self.engine
        scheduler = engine.lr_scheduler
        saved_scheduler = state["lr_scheduler"]
        # Everything is checked before anything is changed.
        self._check_module(state["module"])
        self._check_optimizer(state["optimizer"])
        if (scheduler is None) != (saved_scheduler is None):
            raise ValueError("recovered DeepSpeed state " + ("has no LR scheduler state, but the engine has an LR "
                             "scheduler" if saved_scheduler is None else "has LR scheduler state, but the engine "
                             "has no LR scheduler"))
        prologue = getattr(self.optimizer, "checkpoint_event_prologue", None)
        epilogue = getattr(self.optimizer, "checkpoint_event_epilogue", None)
        if prologue is not None:
            prologue()  # ZeRO-3: every parameter partitioned before its partition is replaced
        self._load_module(state["module"])
        self._load_optimizer(state["optimizer"])
        if epilogue is not None:
            epilogue()  # ZeRO-3: persistent parameters gathered again from the restored partitions
        if scheduler is not None:
            scheduler.load_state_dict(saved_scheduler)
        counters = state["engine"]
        engine.global_steps = counters["global_steps"]
        engine.global_samples = counters["global_samples"]
        engine.skipped_steps = counters["skipped_steps"]
        engine.micro_steps = counters["micro_steps"]
        self.recovered_step = counters["global_steps"]

    # module -------------------------------------------------------------

    def _live_module(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        module = self.engine.module
        params = {name: (p.ds_tensor if self.stage == 3 else p) for name, p in module.named_parameters()}
        buffers = {name: b for name, b in module.named_buffers() if b is not None}
        return params, buffers

    def _check_module(self, saved: Dict[str, Any]) -> None:
        params, buffers = self._live_module()
        for kind, live in (("params", params), ("buffers", buffers)):
            got = saved.get(kind)
            if not isinstance(got, dict) or set(got) != set(live):
                names = set(got) if isinstance(got, dict) else set()
                raise ValueError(f"recovered module {kind} do not match the engine's module: missing "
                                 f"{sorted(set(live) - names)[:8]}, unexpected {sorted(names - set(live))[:8]}")
            for name, target in live.items():
                value = got[name]
                if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
                    part = " partition" if self.stage == 3 and kind == "params" else ""
                    raise ValueError(f"recovered {name}{part} has shape {tuple(value.shape)} {value.dtype}, the "
                                     f"live engine has {tuple(target.shape)} {target.dtype} on this rank")

    def _load_module(self, saved: Dict[str, Any]) -> None:
        params, buffers = self._live_module()
        with torch.no_grad():
            for name, target in params.items():
                target.data.copy_(saved["params"][name])
            for name, target in buffers.items():
                target.copy_(saved["buffers"][name])

    # optimizer ----------------------------------------------------------

    def _check_optimizer(self, saved: Dict[str, Any]) -> None:
        if not isinstance(saved, dict):
            raise ValueError(f"recovered optimizer state is a {type(saved).__name__}, expected a dict")
        if self.stage == 0:
            self._check_torch_optimizer(saved)
            return
        live = self._optimizer_state()
        for key in (_ZERO_STAGE, _PARTITION_COUNT, _GROUP_PADDINGS, _SINGLE_PARTITION_OF_FP32_GROUPS,
                    _FP32_FLAT_GROUPS):
            if (key in live) != (key in saved) or _shape_of(live.get(key)) != _shape_of(saved.get(key)):
                raise ValueError(f"recovered ZeRO optimizer state does not match the engine: {key!r} is "
                                 f"{_shape_of(saved.get(key))}, the live optimizer has {_shape_of(live.get(key))}")
        if set(saved) != set(live):
            raise ValueError(f"recovered ZeRO optimizer state has keys {sorted(saved)}, the live optimizer "
                             f"{sorted(live)}")
        fields, scaler = saved.get(_LOSS_SCALER), self.optimizer.loss_scaler
        if not isinstance(fields, dict) or set(fields) != set(vars(scaler)):
            raise ValueError(f"recovered loss scaler fields {sorted(fields) if isinstance(fields, dict) else fields} "
                             f"do not match the engine's {type(scaler).__name__} {sorted(vars(scaler))}")

    def _load_optimizer(self, saved: Dict[str, Any]) -> None:
        if self.stage == 0:
            self.optimizer.load_state_dict(saved)
            return
        from deepspeed.runtime.zero.config import ZeroStageEnum

        state = dict(saved)
        scaler = self.optimizer.loss_scaler
        _set_scaler_fields(scaler, saved[_LOSS_SCALER])
        state[_LOSS_SCALER] = scaler
        state[_ZERO_STAGE] = ZeroStageEnum(saved[_ZERO_STAGE])
        group = self.optimizer.dp_process_group
        state_list: List[Optional[Dict[str, Any]]] = [None] * dist.get_world_size(group=group)
        state_list[dist.get_rank(group=group)] = state  # rigid load: DeepSpeed reads this rank's entry only
        self.optimizer.load_state_dict(state_list, load_optimizer_states=True, load_from_fp32_weights=True)

    def _check_torch_optimizer(self, saved: Dict[str, Any]) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        groups = saved.get("param_groups")
        if not isinstance(groups, list) or sum(len(g["params"]) for g in groups) != len(params):
            raise ValueError("recovered optimizer state does not match the engine's optimizer parameter groups")
        for index, per_param in saved.get("state", {}).items():
            param = params[index]
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                    raise ValueError(f"recovered optimizer state {key!r} of parameter {index} has shape "
                                     f"{tuple(value.shape)}, the parameter has {tuple(param.shape)}")

    # ------------------------------------------------------------------ hooks

    def replay_targets(self) -> tuple:
        # Layer replay compares the module on every data-parallel peer: its parameters are replicated
        # under ZeRO 0-2. Optimizer state is partitioned under ZeRO 1-3, so only ZeRO-0 offers the
        # optimizer to SCOUT's shadow-step check.
        optimizer = self.optimizer if self.stage == 0 else _NoOptimizerCheck()
        return self.engine.module, optimizer
