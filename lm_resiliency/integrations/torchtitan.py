"""TorchTitan entry points: `enable_resiliency(trainer)` and an opt-in from the job config.

Programmatic (the API guide's form), after `config.build()` and before `trainer.train()`:

    resiliency = enable_resiliency(trainer, interval=10)
    trainer.train()

From the command line, with no trainer edit: TorchTitan 0.3 builds its checkpoint manager from
`config.checkpoint` (a `Configurable.Config`), and `--module` may name any importable module whose
functions return a `Trainer.Config`. This module is such a module: any config function of
TorchTitan's own registries, looked up by name, comes back with its checkpoint section replaced by
`ResilientCheckpointManager.Config` (same fields, plus the `resiliency_*` ones):

    torchrun ... -m torchtitan.train --module lm_resiliency.integrations.torchtitan \
        --config llama3_debugmodel --checkpoint.resiliency-interval 10

Own config functions use `with_resiliency(config, interval=10)`. The manager attaches
lm-resiliency at the start of `train()` (its first `checkpointer.load()`), when the trainer is
complete, and closes it in `trainer.close()`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Optional

from lm_resiliency.api import enable_resiliency as _enable_resiliency
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.session import ResiliencySession

try:
    from torchtitan.components.checkpoint import CheckpointManager
except ImportError:  # TorchTitan not installed: only enable_resiliency (which then fails closed) exists
    CheckpointManager = None


def enable_resiliency(trainer: Any, **kwargs: Any) -> ResiliencySession:
    """Attach lm-resiliency to an initialized TorchTitan `Trainer` (it owns its optimizers, so pass
    only the trainer and the common arguments: `interval`, `checkpoint`, `replay`, ...)."""
    return _enable_resiliency(trainer, framework="torchtitan", **kwargs)


if CheckpointManager is not None:

    class ResilientCheckpointManager(CheckpointManager):
        """TorchTitan's `CheckpointManager` (durable DCP checkpoints, unchanged) that also attaches
        lm-resiliency to the trainer when `train()` starts. Select it with `with_resiliency(config)`
        or `--module lm_resiliency.integrations.torchtitan`."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            resiliency_enable: bool = True
            """Attach lm-resiliency (GEMINI in-memory checkpoints, SCOUT) when train() starts."""
            resiliency_interval: int = 10
            """GEMINI capture and SCOUT check interval in optimizer steps."""
            resiliency_detection: bool = True
            """SCOUT failure detection and localization."""
            resiliency_folder: str = "gemini"
            """GEMINI's node-local disk folder, relative to the trainer dump folder."""
            resiliency_run_id: str = ""
            """Run identity across restarts; empty: GEMINI's own (LM_RESILIENCY_RUN_ID, the launcher's)."""
            resiliency_shm_dir: str = ""
            """Host-slot directory; empty: GEMINI's default."""

        def __init__(self, config: "ResilientCheckpointManager.Config", **kwargs: Any) -> None:
            super().__init__(config, **kwargs)
            self.resiliency_config = config
            self.trainer = kwargs["states"]["train_state"]  # TorchTitan passes the Trainer itself
            self.base_folder = kwargs.get("base_folder", "")
            self.resiliency: Optional[ResiliencySession] = None

        def load(self, step: int = -1) -> bool:
            config = self.resiliency_config
            if self.resiliency is None and config.resiliency_enable:
                gemini = InMemoryCkptConfig(
                    disk_folder=os.path.join(self.base_folder, config.resiliency_folder),
                    run_id=config.resiliency_run_id or None, shared_memory_dir=config.resiliency_shm_dir or None)
                # Recovery runs first; the hooks now wrap this manager's load (see callbacks.torchtitan).
                # The shared interval: GEMINI captures and SCOUT checks (a capture needs a check at its step).
                self.resiliency = enable_resiliency(self.trainer, interval=config.resiliency_interval,
                                                    checkpoint=gemini, enable_detection=config.resiliency_detection)
                return self.load(step)
            return super().load(step)


def with_resiliency(config: Any, interval: int = 10, detection: bool = True) -> Any:
    """`config` (a TorchTitan `Trainer.Config`) with its checkpoint manager replaced by
    `ResilientCheckpointManager` (the durable checkpoint settings are kept)."""
    if CheckpointManager is None:
        raise ImportError("with_resiliency needs TorchTitan (pip install 'lm-resiliency[torchtitan]')")
    current = config.checkpoint
    if not isinstance(current, CheckpointManager.Config):
        raise TypeError(f"with_resiliency: config.checkpoint is a {type(current).__qualname__}, not TorchTitan's "
                        "CheckpointManager.Config; select ResilientCheckpointManager.Config in your config function")
    values = {f.name: getattr(current, f.name) for f in dataclasses.fields(current) if f.init}
    values.update(resiliency_interval=interval, resiliency_detection=detection)
    config.checkpoint = ResilientCheckpointManager.Config(**values)
    return config


def __getattr__(name: str) -> Any:
    """`--config NAME` with `--module lm_resiliency.integrations.torchtitan`: TorchTitan's config
    function NAME (from its models' and experiments' registries), with resiliency selected."""
    if name.startswith("_") or CheckpointManager is None:
        raise AttributeError(name)
    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models

    for package, names in (("torchtitan.models", _supported_models), ("torchtitan.experiments",
                                                                      _supported_experiments)):
        for model in sorted(names):
            try:
                registry = importlib.import_module(f"{package}.{model}.config_registry")
            except ImportError:
                continue
            function = getattr(registry, name, None)
            if callable(function):
                return lambda: with_resiliency(function())
    raise AttributeError(f"{__name__} has no attribute {name!r} (no TorchTitan config function of that name)")


__all__ = ["enable_resiliency", "with_resiliency"] + (
    ["ResilientCheckpointManager"] if CheckpointManager is not None else [])
