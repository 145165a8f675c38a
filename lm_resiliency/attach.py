"""The one recipe every surface uses: options -> adapter -> session -> recover (-> close on failure).

A framework surface (`enable_resiliency`, `ResiliencyCallback`, `ResiliencyPlugin`, the DeepSpeed
hooks, `integrations.<framework>`) turns its keyword arguments into one `AttachOptions`, builds its
framework's adapter, and calls `attach(adapter, options)`. Adding a framework is one adapter, one
surface module and this call (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

from lm_resiliency._values import MAX_STEP_INTERVAL, is_step_interval
from lm_resiliency.adapter import FrameworkAdapter
from lm_resiliency.config import ConfigError, InMemoryCkptConfig
from lm_resiliency.settings import SETTINGS_KEYS
from lm_resiliency.recovery import RecoveryMode
from lm_resiliency.trust import DurableCheckpointConfig
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.reports import ReplayResult, SCOUTFaultReport
from lm_resiliency.session import ResiliencySession

def resolve_configs(interval: Optional[int], checkpoint: Optional[InMemoryCkptConfig],
                    replay: Optional[ReplayHarnessConfig],
                    where: str) -> Tuple[InMemoryCkptConfig, ReplayHarnessConfig]:
    """(InMemoryCkptConfig, ReplayHarnessConfig) from a surface's `interval`, `checkpoint` and
    `replay` arguments: `interval`, when given, is the shared GEMINI capture and SCOUT check
    cadence. `where` names the surface in errors, e.g. "ResiliencyPlugin"."""
    if interval is not None and not is_step_interval(interval):
        raise ConfigError(f"{where}(interval=...): must be a positive int number of optimizer steps, "
                          f"at most {MAX_STEP_INTERVAL}, got {interval!r}")
    config = checkpoint if checkpoint is not None else InMemoryCkptConfig()
    if not isinstance(config, InMemoryCkptConfig):
        raise TypeError(f"{where}(checkpoint=...): expected an InMemoryCkptConfig, got {type(config).__name__}")
    replay_config = replay if replay is not None else ReplayHarnessConfig()
    if not isinstance(replay_config, ReplayHarnessConfig):
        raise TypeError(f"{where}(replay=...): expected a ReplayHarnessConfig, got {type(replay_config).__name__}")
    if interval is not None:
        config = dataclasses.replace(config, interval=interval)
        if replay_config.check_interval > 0:   # 0 is periodic replay switched off: it stays off
            replay_config = dataclasses.replace(replay_config, check_interval=interval)
    return config, replay_config


@dataclasses.dataclass(frozen=True)
class AttachOptions:
    """The arguments every surface shares (docs/api.md), checked when built.

    `interval`, `checkpoint` and `replay` keep what the caller gave (None: unset, so a DeepSpeed
    config section may still fill them); `config` and `replay_config` are the resolved values the
    session runs with. `caller` names the surface in errors."""

    interval: Optional[int] = None
    checkpoint: Optional[InMemoryCkptConfig] = None
    replay: Optional[ReplayHarnessConfig] = None
    enable_checkpoint: bool = True
    enable_detection: bool = True
    extra_state_fn: Optional[Callable[[], Dict[str, Any]]] = None
    load_extra_state_fn: Optional[Callable[[Dict[str, Any]], None]] = None
    load_fallback: Optional[Callable[[], Any]] = None
    recovery_mode: "RecoveryMode | str | None" = None
    orchestration: Any = None
    fault_callback: Optional[Callable[[ReplayResult], None]] = None
    oob_fault_callback: Optional[Callable[[SCOUTFaultReport], None]] = None
    durable_checkpoint: Optional[DurableCheckpointConfig] = None
    caller: str = "enable_resiliency"
    config: InMemoryCkptConfig = dataclasses.field(init=False, repr=False, compare=False)
    replay_config: ReplayHarnessConfig = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.recovery_mode is not None:
            object.__setattr__(self, "recovery_mode", RecoveryMode(self.recovery_mode))
        config, replay_config = resolve_configs(self.interval, self.checkpoint, self.replay, self.caller)
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "replay_config", replay_config)

    @classmethod
    def split(cls, arguments: Dict[str, Any],
              caller: str = "enable_resiliency") -> Tuple["AttachOptions", Dict[str, Any]]:
        """(the options among `arguments`, the rest: framework-specific arguments)."""
        names = {field.name for field in dataclasses.fields(cls) if field.init and field.name != "caller"}
        given = {name: value for name, value in arguments.items() if name in names}
        rest = {name: value for name, value in arguments.items() if name not in names}
        return cls(caller=caller, **given), rest

    def replace(self, **changes: Any) -> "AttachOptions":
        """A copy with `changes` applied, checked again."""
        return dataclasses.replace(self, **changes)

    def section_arguments(self) -> Dict[str, Any]:
        """The arguments a DeepSpeed config section may fill, as given (None: unset)."""
        return {name: getattr(self, name) for name in SETTINGS_KEYS}

    def session_arguments(self) -> Dict[str, Any]:
        mode = self.recovery_mode
        return dict(
            checkpoint=self.config, replay=self.replay_config, enable_checkpoint=self.enable_checkpoint,
            enable_detection=self.enable_detection, extra_state_fn=self.extra_state_fn,
            load_extra_state_fn=self.load_extra_state_fn, load_fallback=self.load_fallback,
            recovery_mode=RecoveryMode(mode) if mode is not None else None, orchestration=self.orchestration,
            fault_callback=self.fault_callback, oob_fault_callback=self.oob_fault_callback,
            durable_checkpoint=self.durable_checkpoint)


def _recover(session: ResiliencySession) -> None:
    session.recover()


def attach(adapter: FrameworkAdapter, options: AttachOptions, *,
           recover: Callable[[ResiliencySession], None] = _recover) -> ResiliencySession:
    """Collective (every rank): build the session for `adapter` and run `recover(session)` (by
    default `session.recover()`: the newest recoverable state is loaded before this returns).
    A failure anywhere removes what was installed (adapter hooks, session threads and groups)
    and raises."""
    try:
        session = ResiliencySession(adapter, **options.session_arguments())
    except BaseException:
        adapter.remove()  # idempotent; also undoes what the adapter's constructor installed
        raise
    try:
        recover(session)
    except BaseException:
        session.close()
        raise
    return session


__all__ = ["AttachOptions", "attach", "resolve_configs"]
