"""Plain PyTorch adapter: single process, DDP, FSDP2 (1-D mesh), HSDP (2-D mesh) and tensor
parallelism (a device mesh with a `tp` or `tensor_parallel` dimension, alone or with data parallel).

Capture reads `model.state_dict()` (DDP: the wrapped module; FSDP2/HSDP: DTensors, whose
local shards GEMINI stores) and `optimizer.state_dict()`. Restore copies the recovered
tensors in place into the live model and rebuilds optimizer DTensors on the live
parameters' mesh, so a fresh process never needs the original sharding call again. Under DDP a
capture also records the gradient-bucket layout DDP settled on, and restore gives the resumed DDP
exactly that layout, so its gradient sums are those of the uninterrupted run (_torch_compat).

`torch.compile` wrappers (`OptimizedModule`, in either order with DDP) are looked through:
state is keyed as in the user's own module (no `_orig_mod.`), and the forward hook runs outside
any compiled region. With `scaler=` (a `torch.amp.GradScaler`) the scaler's state is captured
after its `update()`, and a `scaler.step()` that skipped `optimizer.step()` still counts as a step.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency._torch_compat import restore_bucket_layout, root_mesh, settled_bucket_layout
from lm_resiliency.adapter import FrameworkAdapter, StepCallbacks, Topology
from lm_resiliency.scout.peers import MODEL_PARALLEL_DIMS
from lm_resiliency.wrappers import find_ddp, unwrap_model

logger = logging.getLogger(__name__)

SUPPORTED_OPTIONS = frozenset({"scheduler", "parallelism_info", "group", "nccl_group", "scaler"})


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed tensor support
        return None
    return DTensor


def _is_dtensor(value: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(value, cls)


def check_optimizer_owns_model(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must own every trainable parameter of `model` and nothing else."""
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    owned = [p for group in optimizer.param_groups for p in group["params"]]
    owned_ids = {id(p) for p in owned}
    missing = sorted(names[i] for i in trainable - owned_ids)
    foreign = [p for p in owned if id(p) not in names]
    if missing:
        raise ValueError(f"the optimizer does not own these trainable parameters of the model: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}. Pass the optimizer that trains this model.")
    if foreign:
        shapes = [tuple(p.shape) for p in foreign[:8]]
        raise ValueError(f"the optimizer owns {len(foreign)} parameter(s) that are not in the model "
                         f"(shapes {shapes}). Pass the model these parameters belong to, or one "
                         "optimizer per model.")


def load_model_in_place(module: nn.Module, saved: Dict[str, torch.Tensor]) -> None:
    """Copy recovered tensors into the live model (DTensors: into their local shards), after
    checking that keys, shapes and dtypes match exactly."""
    live = module.state_dict()
    if set(saved) != set(live):
        missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
        raise ValueError(f"recovered model state does not match the model: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    with torch.no_grad():
        for name, target in live.items():
            local = target.to_local() if _is_dtensor(target) else target
            value = saved[name]
            if tuple(value.shape) != tuple(local.shape) or value.dtype != local.dtype:
                raise ValueError(f"recovered {name} has shape {tuple(value.shape)} {value.dtype}, the live "
                                 f"model has {tuple(local.shape)} {local.dtype} on this rank")
            local.copy_(value)


def rewrap_optimizer_state(optimizer: torch.optim.Optimizer, saved: Dict[str, Any]) -> Dict[str, Any]:
    """Optimizer state of DTensor parameters was stored as local shards: rebuild DTensors on the
    live parameter's mesh and placements so the optimizer sees what it saved."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(_is_dtensor(p) for p in params):
        return saved
    DTensor = _dtensor_type()
    state = {}
    for index, per_param in saved["state"].items():
        param = params[int(index)]
        rebuilt = {}
        for key, value in per_param.items():
            if _is_dtensor(param) and isinstance(value, torch.Tensor) and value.dim() > 0 and \
                    tuple(value.shape) == tuple(param.to_local().shape):
                value = DTensor.from_local(value.to(param.to_local().device), param.device_mesh,
                                           param.placements, run_check=False, shape=param.shape,
                                           stride=param.stride())
            rebuilt[key] = value
        state[index] = rebuilt
    return {"state": state, "param_groups": saved["param_groups"]}


def check_detection_groups(group: Any, nccl_group: Any) -> None:
    """`group`/`nccl_group`: this rank's SCOUT peers as a Gloo group (SCOUT's exchanges and
    replay comparisons run on it) and the device group over the same ranks. ValueError unless
    both are process groups over the same ranks, including this one, and `group` is Gloo."""
    for name, value in (("group", group), ("nccl_group", nccl_group)):
        if value is dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group returns off its ranks
            raise ValueError(f"{name}= does not contain this rank ({dist.get_rank()}): pass the group of this "
                             "rank's own SCOUT peers")
        if not isinstance(value, dist.ProcessGroup):
            raise TypeError(f"{name}= must be a torch.distributed process group, got {type(value).__name__}")
    if not dist.is_initialized():
        raise ValueError("group=/nccl_group= need torch.distributed initialized; create them with "
                         "dist.new_group on every rank first")
    ranks, device_ranks = dist.get_process_group_ranks(group), dist.get_process_group_ranks(nccl_group)
    if dist.get_rank() not in ranks:
        raise ValueError(f"group= (ranks {ranks}) does not contain this rank ({dist.get_rank()}): pass the "
                         "group of this rank's own SCOUT peers")
    if sorted(device_ranks) != sorted(ranks):
        raise ValueError(f"group= (ranks {ranks}) and nccl_group= (ranks {device_ranks}) must hold the same ranks")
    if dist.get_backend(group) != dist.Backend.GLOO:
        raise ValueError(f"group= must be a Gloo group (SCOUT's exchanges use CPU tensors), got "
                         f"backend {dist.get_backend(group)!r}: create it with dist.new_group(ranks, backend='gloo')")


class PyTorchAdapter(FrameworkAdapter):
    framework = "pytorch"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 scheduler: Any = None, parallelism_info: Any = None,
                 group: Optional[dist.ProcessGroup] = None, nccl_group: Optional[dist.ProcessGroup] = None,
                 scaler: Optional[torch.amp.GradScaler] = None, skip_replication_if_hsdp: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"PyTorch adapter: expected a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("PyTorch adapter: pass the model's torch.optim.Optimizer as the second argument, "
                            f"got {type(optimizer).__name__}")
        if (group is None) != (nccl_group is None):
            raise ValueError("pass both group= and nccl_group= (SCOUT detection groups) or neither")
        if group is not None:
            check_detection_groups(group, nccl_group)
        if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
            raise TypeError("scheduler= must have state_dict()/load_state_dict() (an LR scheduler)")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler= must be a torch.amp.GradScaler (or a subclass such as ShardedGradScaler), "
                            f"got {type(scaler).__name__}")
        self.model = model
        self.module = unwrap_model(model)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self._optimizer_steps = 0  # optimizer.step() calls seen; tells a skipped scaler.step() apart
        self._scaler_step: Optional[Callable[..., Any]] = None
        self.parallelism_info = parallelism_info
        self.group, self.nccl_group = group, nccl_group
        self._skip_replication_if_hsdp = skip_replication_if_hsdp
        self._handles: List[Any] = []
        check_optimizer_owns_model(self.module, optimizer)
        # DDP may sit inside or outside torch.compile. Its bucket layout is left to DDP, recorded
        # with each capture and restored on resume (docs/frameworks.md, "DDP and bitwise resume").
        self.ddp = find_ddp(model)

    # --------------------------------------------------------------- topology

    def _mesh(self):
        # The root mesh: a TP-only or FSDP-only submesh describes just part of the layout.
        for param in self.module.parameters():
            if _is_dtensor(param):
                return root_mesh(param.device_mesh)
        return None

    def topology(self) -> Topology:
        mesh = self._mesh()
        info = self.parallelism_info
        if info is not None:
            replicate, shard = int(info.dp_replicate), int(info.dp_shard)
            kind = "hsdp" if replicate > 1 and shard > 1 else ("fsdp2" if shard > 1 else "ddp")
            descriptor = {"kind": kind, "dp_replicate": replicate, "dp_shard": shard}
        elif mesh is not None and MODEL_PARALLEL_DIMS & set(mesh.mesh_dim_names or ()):
            sizes = dict(zip(mesh.mesh_dim_names, (int(d) for d in mesh.shape)))
            tp = math.prod(size for name, size in sizes.items() if name in MODEL_PARALLEL_DIMS)
            replicate, shard = mesh.size() // tp, 1
            kind = "tp" if replicate == 1 else "dp_tp"
            descriptor = {"kind": kind, "mesh_shape": list(sizes.values()), "mesh_dim_names": list(sizes),
                          "coordinate": list(mesh.get_coordinate() or []), "tp": tp}
        elif mesh is not None:
            shape = list(mesh.shape)
            names = list(mesh.mesh_dim_names or [])
            if mesh.ndim == 1:
                kind, replicate, shard = "fsdp2", 1, shape[0]
            elif mesh.ndim == 2:
                kind, replicate, shard = "hsdp", shape[0], shape[1]
            else:
                raise ValueError(f"PyTorch adapter: a {mesh.ndim}-D device mesh {names or shape} is not a "
                                 "standard FSDP2/HSDP layout; pass parallelism_info=<object with "
                                 "dp_replicate and dp_shard>")
            descriptor = {"kind": kind, "mesh_shape": shape, "mesh_dim_names": names,
                          "coordinate": list(mesh.get_coordinate() or [])}
        else:
            distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            ddp = find_ddp(self.model) is not None
            kind = "ddp" if ddp else (
                "replicated" if distributed else "single")
            replicate, shard = (dist.get_world_size() if distributed else 1), 1
            descriptor = {"kind": kind}
        natural_replicas = kind == "hsdp" and replicate > 1 and self._skip_replication_if_hsdp
        descriptor.update({"dp_replicate": replicate, "dp_shard": shard})
        return Topology(kind=kind, replicate=not natural_replicas, descriptor=descriptor, scout_group=self.group)

    # ------------------------------------------------------------------ state

    def framework_state(self) -> Dict[str, Any]:
        # Parameters and optimizer state change only in optimizer.step(), after GEMINI's
        # maybe_wait(). Buffers (BatchNorm statistics, DDP-broadcast buffers) change inside the
        # forward that runs while the capture copies, so they are snapshotted now.
        buffers = {id(b) for b in self.module.buffers()}
        model = {name: value.detach().clone() if id(value) in buffers else value.detach()
                 for name, value in self.module.state_dict(keep_vars=True).items()}
        state = {"model": model, "optimizer": self.optimizer.state_dict()}
        layout = settled_bucket_layout(self.ddp, self.module) if self.ddp is not None else None
        if layout is not None:
            state["ddp_buckets"] = layout
        return state

    def deferred_state(self) -> Dict[str, Any]:
        # The scaler settles in scaler.update(), after scaler.step(): read before the next forward.
        state = {"scheduler": self.scheduler.state_dict()} if self.scheduler is not None else {}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_framework_state(self, state: Dict[str, Any]) -> None:
        layout = state.get("ddp_buckets")
        if layout is not None and self.ddp is None:
            raise ValueError("the recovered checkpoint holds a DDP gradient-bucket layout, but the model is not "
                             "wrapped in DistributedDataParallel; resume with the same wrapping")
        if layout is not None:  # first: it refuses a layout that names other parameters, changing nothing
            restore_bucket_layout(self.ddp, layout, self.module)
        load_model_in_place(self.module, state["model"])
        self.optimizer.load_state_dict(rewrap_optimizer_state(self.optimizer, state["optimizer"]))

    def load_deferred_state(self, state: Dict[str, Any]) -> None:
        if self.scheduler is not None:
            if "scheduler" not in state:
                raise ValueError("the recovered checkpoint has no scheduler state, but scheduler= was given")
            self.scheduler.load_state_dict(state["scheduler"])
        self._load_scaler(state.get("scaler"))

    def _load_scaler(self, saved: Optional[Dict[str, Any]]) -> None:
        # An AMP run resumed without its scaler (or the reverse) would silently restart the loss scale.
        if saved is not None and self.scaler is None:
            raise ValueError("the recovered checkpoint has GradScaler state but no scaler= was given; pass the "
                             "loop's GradScaler as enable_resiliency(..., scaler=scaler)")
        if saved is None and self.scaler is not None:
            raise ValueError("scaler= was given, but the recovered checkpoint has no GradScaler state (it was "
                             "captured without scaler=)")
        if self.scaler is None:
            return
        if bool(saved) != self.scaler.is_enabled():
            was, now = ("enabled", "disabled") if saved else ("disabled", "enabled")
            raise ValueError(f"the recovered GradScaler state is from an {was} scaler, but scaler= is {now}; "
                             "resume with the same AMP setting")
        self.scaler.load_state_dict(saved)

    # ------------------------------------------------------------------ hooks

    def install(self, callbacks: StepCallbacks) -> None:
        def after_step(opt: Any, args: Any, kwargs: Any) -> None:
            self._optimizer_steps += 1
            callbacks.after_optimizer_step()

        # torch.compile must never trace the session's work: under `module.compile()` this hook runs
        # inside the compiled region. (torch._dynamo is loaded already: torch.optim imports it.)
        before_forward = torch.compiler.disable(lambda module, args: callbacks.before_forward())
        # prepend: the capture reads state_dict(), which FSDP2 answers by resharding; it must run
        # before FSDP's own pre-forward hook unshards the root's parameters for this forward.
        self._handles = [
            self.optimizer.register_step_pre_hook(lambda opt, args, kwargs: callbacks.before_optimizer_step()),
            self.optimizer.register_step_post_hook(after_step),
            self.model.register_forward_pre_hook(before_forward, prepend=True),
        ]
        if self.scaler is not None:
            self._wrap_scaler_step(self.scaler, callbacks.skipped_optimizer_step)

    def _wrap_scaler_step(self, scaler: Any, skipped: Optional[Callable[[], None]]) -> None:
        """GradScaler.step() skips optimizer.step() on inf/NaN gradients, so no optimizer hook fires;
        the wrapper reports that boundary, keeping step_count equal to the loop's own counter."""
        if skipped is None:
            raise TypeError("scaler= needs a session that handles skipped optimizer steps")
        original = scaler.step

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = self._optimizer_steps
            result = original(optimizer, *args, **kwargs)
            if optimizer is self.optimizer and self._optimizer_steps == before:
                skipped()
            return result

        scaler.step = self._scaler_step = step

    def replay_targets(self) -> tuple:
        return self.model, self.optimizer

    def overwrite_targets(self) -> tuple:
        return self.model, self.optimizer

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._scaler_step is not None and self.scaler is not None \
                and self.scaler.__dict__.get("step") is self._scaler_step:
            del self.scaler.step  # the class's own step() again
        self._scaler_step = None

    def describe(self) -> str:
        return f"pytorch/{self.topology().kind}"
