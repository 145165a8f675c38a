"""Native PyTorch worker adapters: DDP (NativePyTorchDDPAdapter) and, in
NativePyTorchAdapter, also FSDP2/HSDP and single-process jobs.

Construction hooks record every DistributedDataParallel and every optimizer (torch.optim's
classes, and subclasses defined later, which are instrumented when the class is created). A
process-wide forward pre-hook finds the boundary: the first forward of a DDP model, of the
outermost FSDP2/HSDP-sharded root, or (single process) of the root module. There every rank checks
it owns exactly one such model and one optimizer that owns all its trainable parameters and no
other; the ranks agree, and only then the PyTorch integration attaches. An optimizer step before
any recognized boundary fails closed.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from lm_resiliency.torchrun.imports import after_construction, when_imported
from lm_resiliency.torchrun.workers.base import PREFIX, BuiltInWorkerAdapter, agree
from lm_resiliency.torchrun.worker import TorchrunWorkerAdapterError

_DDP_MODULE = "torch.nn.parallel.distributed"
_OPTIM_MODULE = "torch.optim.optimizer"
_MODULE_MODULE = "torch.nn.modules.module"
_DDP = "DistributedDataParallel"


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class NativePyTorchDDPAdapter(BuiltInWorkerAdapter):
    """Attaches at the first forward of the one DistributedDataParallel model, with its one optimizer."""

    framework = "pytorch"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.models: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._handles: list = []

    def install(self, context: Any) -> None:
        super().install(context)
        when_imported(_DDP_MODULE, lambda module: after_construction(module.DistributedDataParallel, self._note_model))
        when_imported(_OPTIM_MODULE, self._patch_optimizer)
        when_imported(_MODULE_MODULE, self._hook_forwards)

    def deactivate(self, reason: str) -> None:
        super().deactivate(reason)
        self._remove_hooks()

    # -------------------------------------------------------- construction hooks

    def _note_model(self, ddp: Any) -> None:
        if self.active and not self.started:
            self.models.add(ddp)

    def _note_optimizer(self, optimizer: Any) -> None:
        if self.active and not self.started:
            self.optimizers.add(optimizer)

    def _patch_optimizer(self, module: Any) -> None:
        after_construction(module.Optimizer, self._note_optimizer)
        self._handles.append(module.register_optimizer_step_pre_hook(self._before_any_step))

    def _hook_forwards(self, module: Any) -> None:
        import torch

        # Never traced: under torch.compile the first forward may run inside a compiled region.
        self._handles.append(module.register_module_forward_pre_hook(torch.compiler.disable(self._forward)))

    def _remove_hooks(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    # ------------------------------------------------------------------ boundary

    def _before_any_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.active and not self.started and optimizer in self.optimizers:
            raise TorchrunWorkerAdapterError(
                f"{PREFIX}{type(optimizer).__name__}.step() ran before the {self.boundary_names()} forward this "
                "adapter attaches at; refusing to train without resiliency. Wrap the model as documented "
                "(docs/torchrun.md, Built-in worker adapters) or set adapter = \"package.module:factory\"")

    def boundary_names(self) -> str:
        return _DDP

    def boundary(self, module: Any) -> Optional[str]:
        """The kind of boundary a forward of `module` is, or None (not one)."""
        return _DDP if module in self.models else None

    def _forward(self, module: Any, args: Any) -> None:
        if not self.active or self.started:
            return
        kind = self.boundary(module)
        if kind is None:
            return
        self.started = True
        self._remove_hooks()
        problem = self.local_problem(module, kind)
        agree(problem, f"every rank must own exactly one {kind} model and its one optimizer")
        optimizer = next(iter(self.optimizers))
        self._start(module, optimizer)

    def local_problem(self, module: Any, kind: str) -> str:
        from lm_resiliency.adapters.pytorch import check_optimizer_owns_model
        from lm_resiliency.wrappers import unwrap_model

        if kind == _DDP and len(self.models) != 1:
            return f"{len(self.models)} DistributedDataParallel models exist; the worker adapter needs exactly one"
        if kind != _DDP and len(self.models):
            return f"a {kind} forward ran while {len(self.models)} DistributedDataParallel model(s) exist"
        optimizers = list(self.optimizers)
        if len(optimizers) != 1:
            return f"{len(optimizers)} optimizers exist; the worker adapter needs exactly one for the {kind} model"
        try:
            check_optimizer_owns_model(unwrap_model(module), optimizers[0])
        except ValueError as exc:
            return str(exc)
        return ""

    def _start(self, model: Any, optimizer: Any) -> None:
        from lm_resiliency.adapters.pytorch import PyTorchAdapter

        options = self.attach_options()
        adapter = PyTorchAdapter(model, optimizer, skip_replication_if_hsdp=options.config.skip_replication_if_hsdp)
        self.attach(adapter, options)
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.stepped())


class NativePyTorchAdapter(NativePyTorchDDPAdapter):
    """DDP as NativePyTorchDDPAdapter; also FSDP2/HSDP (the outermost sharded root, whichever
    order the modules were sharded in) and, in a single-process job, the root module whose
    forward runs first."""

    def boundary_names(self) -> str:
        return "DistributedDataParallel, FSDP2/HSDP root" + ("" if _distributed() else " or root module")

    def boundary(self, module: Any) -> Optional[str]:
        kind = super().boundary(module)
        if kind is not None:
            return kind
        if not _distributed():
            return "root module"
        from torch.distributed.fsdp import FSDPModule

        if isinstance(module, FSDPModule):
            return "FSDP2"
        if any(isinstance(inner, FSDPModule) for inner in module.modules()):
            return "unsharded root"  # refused by local_problem: sharded layers under an unsharded root
        return None  # an unrelated module (e.g. a loss or input transform): not a boundary

    def local_problem(self, module: Any, kind: str) -> str:
        if kind == "unsharded root":
            return (f"{type(module).__name__} holds FSDP2-sharded submodules but is not sharded itself; call "
                    "fully_shard() on the root module too, so one sharded root owns the whole model")
        return super().local_problem(module, kind)
