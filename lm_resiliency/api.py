"""`enable_resiliency`: one call that attaches GEMINI (and SCOUT) to an existing training stack."""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict, Optional

from lm_resiliency.adapter import FrameworkAdapter
from lm_resiliency.attach import AttachOptions, attach
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.recovery import RecoveryMode
from lm_resiliency.trust import DurableCheckpointConfig
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.reports import ReplayResult, SCOUTFaultReport
from lm_resiliency.session import ResiliencySession


class FrameworkName(str, enum.Enum):
    PYTORCH = "pytorch"
    TORCHTITAN = "torchtitan"
    MEGATRON = "megatron"
    DEEPSPEED = "deepspeed"


def infer_framework(obj: Any) -> FrameworkName:
    """Which framework `obj` belongs to; raises TypeError naming what was expected."""
    import torch

    module = type(obj).__module__ or ""
    if module.startswith("deepspeed"):
        return FrameworkName.DEEPSPEED
    if module.startswith("torchtitan"):
        return FrameworkName.TORCHTITAN
    if isinstance(obj, (list, tuple)):
        if obj and all(isinstance(m, torch.nn.Module) for m in obj):
            return FrameworkName.MEGATRON
        raise TypeError("enable_resiliency: a list/tuple first argument must hold Megatron model chunks "
                        "(torch.nn.Module objects)")
    if isinstance(obj, torch.nn.Module):
        return FrameworkName.PYTORCH
    raise TypeError(
        f"enable_resiliency: cannot infer the framework from {type(obj).__module__}.{type(obj).__qualname__}; "
        "expected a torch.nn.Module (PyTorch), a TorchTitan Trainer, Megatron model chunks (list) or a "
        "DeepSpeed engine. Pass framework='pytorch'|'torchtitan'|'megatron'|'deepspeed' for custom wrappers.")


def enable_resiliency(
    model_or_trainer_or_engine: Any,
    optimizer: Any = None,
    *,
    interval: Optional[int] = None,
    checkpoint: Optional[InMemoryCkptConfig] = None,
    replay: Optional[ReplayHarnessConfig] = None,
    enable_checkpoint: bool = True,
    enable_detection: bool = True,
    extra_state_fn: Optional[Callable[[], Dict[str, Any]]] = None,
    load_extra_state_fn: Optional[Callable[[Dict[str, Any]], None]] = None,
    load_fallback: Optional[Callable[[], Any]] = None,
    recovery_mode: "RecoveryMode | str | None" = None,
    orchestration: Any = None,
    framework: "FrameworkName | str | None" = None,
    fault_callback: Optional[Callable[[ReplayResult], None]] = None,
    oob_fault_callback: Optional[Callable[[SCOUTFaultReport], None]] = None,
    durable_checkpoint: Optional[DurableCheckpointConfig] = None,
    **framework_options: Any,
) -> ResiliencySession:
    """Attach lm-resiliency to a training stack; call once on every rank, after the framework
    objects exist and before the training loop. The newest recoverable state is loaded before
    this returns; `session.step_count` is the resume point."""
    selected = FrameworkName(framework) if framework is not None else infer_framework(model_or_trainer_or_engine)
    options = AttachOptions(
        interval=interval, checkpoint=checkpoint, replay=replay, enable_checkpoint=enable_checkpoint,
        enable_detection=enable_detection, extra_state_fn=extra_state_fn, load_extra_state_fn=load_extra_state_fn,
        load_fallback=load_fallback, recovery_mode=recovery_mode, orchestration=orchestration,
        fault_callback=fault_callback, oob_fault_callback=oob_fault_callback, durable_checkpoint=durable_checkpoint)
    return attach_framework(selected, model_or_trainer_or_engine, optimizer, options, framework_options)


def attach_framework(framework: FrameworkName, obj: Any, optimizer: Any, options: AttachOptions,
                     framework_options: Dict[str, Any]) -> ResiliencySession:
    """`enable_resiliency` once its arguments are one `AttachOptions`: dispatch to the framework's
    surface, or build its adapter and attach."""
    if framework is FrameworkName.DEEPSPEED:
        from lm_resiliency.callbacks.deepspeed import attach_engine

        return attach_engine(obj, options, optimizer, framework_options)
    if framework is FrameworkName.MEGATRON:
        from lm_resiliency.callbacks.megatron import attach_model

        return attach_model(obj, options, optimizer, framework_options)
    if framework is FrameworkName.TORCHTITAN:
        from lm_resiliency.callbacks.torchtitan import attach_trainer

        return attach_trainer(obj, options, optimizer, framework_options)
    adapter = _build_adapter(framework, obj, optimizer, options, framework_options)
    return attach(adapter, options)


def _build_adapter(framework: FrameworkName, obj: Any, optimizer: Any, attach_options: AttachOptions,
                   options: Dict[str, Any]) -> FrameworkAdapter:
    """The adapter for `framework` (the PyTorch one; each new framework adds its branch here)."""
    from lm_resiliency.adapters.pytorch import SUPPORTED_OPTIONS, PyTorchAdapter

    unsupported = sorted(set(options) - SUPPORTED_OPTIONS)
    if unsupported:
        raise TypeError(f"enable_resiliency: the pytorch adapter does not accept {unsupported}; "
                        f"supported options: {sorted(SUPPORTED_OPTIONS)}")
    if optimizer is None:
        raise TypeError("enable_resiliency: the pytorch adapter needs the optimizer as the second argument")
    skip = attach_options.config.skip_replication_if_hsdp
    return PyTorchAdapter(obj, optimizer, skip_replication_if_hsdp=skip, **options)
