"""Hugging Face Accelerate surface: `ResiliencyPlugin`, and the `LM_RESILIENCY` flag for
`accelerate launch` / `torchrun` users.

In code, after `prepare()`:

    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    resiliency = ResiliencyPlugin(interval=10).attach(accelerator)   # recovers before returning
    for epoch in range(num_epochs):                                   # the loop is unchanged
        for batch in train_dl:
            with accelerator.accumulate(model):
                ...

Without code: Accelerate has no third-party plugin seam (its config files and `Accelerator(...)`
reject unknown keys), so the flag is an environment variable honoured by a launcher bootstrap
that runs the unchanged script:

    LM_RESILIENCY=1 accelerate launch -m lm_resiliency.callbacks.accelerate train.py --lr 1e-3
    LM_RESILIENCY=1 torchrun --nproc-per-node 8 -m lm_resiliency.callbacks.accelerate train.py

The bootstrap wraps `Accelerator.prepare`; each prepared accelerator gets a `ResiliencyPlugin`
(settings from `LM_RESILIENCY_*` variables), attached and recovered at the first use of the
prepared objects (first dataloader iteration or model forward), so everything the script prepares
before its loop is covered. With `LM_RESILIENCY` unset (or 0/false/no/off) the bootstrap only runs
the script: nothing is patched and Accelerate is not even imported by it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import runpy
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional

from lm_resiliency.config import ConfigError, InMemoryCkptConfig
from lm_resiliency.recovery import RecoveryMode
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.session import ResiliencySession

logger = logging.getLogger(__name__)

FLAG = "LM_RESILIENCY"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_ATTR = "_lm_resiliency_plugin"


class ResiliencyPlugin:
    """GEMINI (and SCOUT) for a prepared `accelerate.Accelerator`.

    Arguments are `enable_resiliency`'s (see docs/api.md), plus `resume_dataloaders`: what the
    prepared dataloaders do after a recovery — "auto" (default; unchanged epoch loops resume
    exactly), "continue" (the next iteration continues the interrupted epoch) or "manual"
    (loaders untouched; use `resume_epoch`, `resume_batches`, `skip_first_batches`).
    """

    from_flag = False  # True for the plugin the LM_RESILIENCY flag attached

    def __init__(self, *, interval: Optional[int] = None, checkpoint: Optional[InMemoryCkptConfig] = None,
                 replay: Optional[ReplayHarnessConfig] = None, enable_checkpoint: bool = True,
                 enable_detection: bool = True,
                 extra_state_fn: Optional[Callable[[], Dict[str, Any]]] = None,
                 load_extra_state_fn: Optional[Callable[[Dict[str, Any]], None]] = None,
                 load_fallback: Optional[Callable[[], Any]] = None,
                 recovery_mode: "RecoveryMode | str | None" = None, orchestration: Any = None,
                 fault_callback: Optional[Callable[..., None]] = None,
                 oob_fault_callback: Optional[Callable[..., None]] = None,
                 durable_checkpoint: Any = None, resume_dataloaders: str = "auto") -> None:
        from lm_resiliency.adapters.accelerate import RESUME_MODES

        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            raise ValueError(f"ResiliencyPlugin(interval=...): must be a positive int, got {interval!r}")
        config = checkpoint if checkpoint is not None else InMemoryCkptConfig()
        if not isinstance(config, InMemoryCkptConfig):
            raise TypeError(f"ResiliencyPlugin(checkpoint=...): expected an InMemoryCkptConfig, "
                            f"got {type(config).__name__}")
        replay_config = replay if replay is not None else ReplayHarnessConfig()
        if not isinstance(replay_config, ReplayHarnessConfig):
            raise TypeError(f"ResiliencyPlugin(replay=...): expected a ReplayHarnessConfig, "
                            f"got {type(replay_config).__name__}")
        if interval is not None:  # the shared cadence, as in enable_resiliency
            config = dataclasses.replace(config, interval=interval)
            replay_config = dataclasses.replace(replay_config, check_interval=interval)
        if resume_dataloaders not in RESUME_MODES:
            raise ValueError(f"ResiliencyPlugin(resume_dataloaders=...): must be one of {RESUME_MODES}, "
                             f"got {resume_dataloaders!r}")
        self.checkpoint = config
        self.replay = replay_config
        self._given = dict(interval=interval, checkpoint=checkpoint, replay=replay)  # for the DeepSpeed path
        self.resume_dataloaders = resume_dataloaders
        self._session_options = dict(
            enable_checkpoint=enable_checkpoint, enable_detection=enable_detection,
            extra_state_fn=extra_state_fn, load_extra_state_fn=load_extra_state_fn, load_fallback=load_fallback,
            recovery_mode=RecoveryMode(recovery_mode) if recovery_mode is not None else None,
            orchestration=orchestration, fault_callback=fault_callback, oob_fault_callback=oob_fault_callback,
            durable_checkpoint=durable_checkpoint)
        self.session: Optional[ResiliencySession] = None
        self.adapter: Any = None
        self.accelerator: Any = None

    # ----------------------------------------------------------------- attach

    def attach(self, accelerator: Any) -> ResiliencySession:
        """Collective (every rank): attach to `accelerator` after `prepare()`, load the newest
        recoverable state and return the session (`step_count` is the resume point)."""
        from lm_resiliency.adapters.accelerate import AccelerateAdapter, _distributed_type, check_prepared

        if self.session is not None:
            raise RuntimeError("this ResiliencyPlugin is already attached; create one plugin per Accelerator")
        check_prepared(accelerator)
        owner = accelerator.__dict__.get(_ATTR)
        if owner is not None and owner.session is not None:
            raise RuntimeError("lm-resiliency is already attached to this Accelerator "
                               f"({'by the LM_RESILIENCY flag' if owner.from_flag else 'by another plugin'})")
        if _distributed_type(accelerator) == "DEEPSPEED":
            return self._attach_deepspeed(accelerator)
        adapter = AccelerateAdapter(accelerator, resume_dataloaders=self.resume_dataloaders,
                                    skip_replication_if_hsdp=self.checkpoint.skip_replication_if_hsdp)
        session = ResiliencySession(adapter, checkpoint=self.checkpoint, replay=self.replay,
                                    **self._session_options)
        try:
            session.recover()
        except BaseException:
            session.close()
            raise
        self.session, self.adapter, self.accelerator = session, adapter, accelerator
        accelerator.__dict__[_ATTR] = self
        if session.recovered_from is not None:
            epoch, batches = self.resume_position
            logger.info("lm-resiliency: Accelerate run resumes after optimizer step %d (epoch %d, batch %d, "
                        "dataloaders: %s)", session.step_count, epoch, batches, self.resume_dataloaders)
        return session

    def _attach_deepspeed(self, accelerator: Any) -> ResiliencySession:
        """Accelerate's DeepSpeed integration: `DeepSpeedOptimizerWrapper.step` is a no-op and the
        prepared model is the DeepSpeed engine, so the session hooks the engine through the DeepSpeed
        surface (`lm_resiliency.callbacks.deepspeed`), which wraps `engine.step` and counts
        `engine.global_steps`. Accelerate-level state (dataloader positions, `accelerator.step`) is
        not captured on this path: the loop resumes from `step_count`."""
        try:
            from lm_resiliency.callbacks.deepspeed import register_resiliency_hooks
        except ImportError as exc:
            raise NotImplementedError(
                "this Accelerator uses DeepSpeed (distributed_type DEEPSPEED): lm-resiliency must hook the "
                "DeepSpeed engine there, and the DeepSpeed surface (lm_resiliency.callbacks.deepspeed) cannot be "
                f"imported ({exc})") from exc
        if self.resume_dataloaders != "manual":
            logger.warning("lm-resiliency: under Accelerate's DeepSpeed integration dataloader positions are not "
                           "captured; resume the data from step_count (resume_dataloaders=%r is ignored)",
                           self.resume_dataloaders)
        options = {k: v for k, v in self._given.items() if v is not None}  # unset: the DeepSpeed config section
        options.update({k: v for k, v in self._session_options.items() if v is not None})
        session = register_resiliency_hooks(accelerator._models[0], **options)
        self.session, self.accelerator = session, accelerator
        accelerator.__dict__[_ATTR] = self
        return session

    # ------------------------------------------------------------- the handle

    def _require_session(self) -> ResiliencySession:
        if self.session is None:
            raise RuntimeError("ResiliencyPlugin is not attached: call plugin.attach(accelerator) after "
                               "accelerator.prepare(...)")
        return self.session

    @property
    def step_count(self) -> int:
        """Completed optimizer steps (the recovered resume point right after `attach`)."""
        return self._require_session().step_count

    @property
    def resume_position(self) -> tuple:
        """(epoch, batches consumed in it) where the training dataloader resumes."""
        self._require_session()
        if self.adapter is None:
            raise RuntimeError("dataloader positions are not captured under Accelerate's DeepSpeed integration; "
                               "resume the data from step_count")
        return self.adapter.resume_position()

    @property
    def resume_epoch(self) -> int:
        return self.resume_position[0]

    @property
    def resume_batches(self) -> int:
        return self.resume_position[1]

    def skip_first_batches(self, dataloader: Any) -> Any:
        """For resume_dataloaders="manual" loops: arm the recovered position on this prepared
        dataloader and return it; its next iteration continues the interrupted epoch (an
        efficient `accelerate.skip_first_batches` under the hood) and stays tracked."""
        from lm_resiliency.adapters.accelerate import DataLoaderTracker

        self._require_session()
        tracker = dataloader.__dict__.get("_lmr_tracker") if hasattr(dataloader, "__dict__") else None
        if tracker is None or self.adapter is None or tracker not in self.adapter.trackers:
            raise ValueError("skip_first_batches: pass a dataloader returned by this accelerator's prepare() "
                             "before attach")
        assert isinstance(tracker, DataLoaderTracker)
        tracker.continue_next_iteration()
        return dataloader

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def get_session(accelerator: Any) -> Optional[ResiliencySession]:
    """The session attached to `accelerator` (by a plugin or the LM_RESILIENCY flag), or None."""
    plugin = getattr(accelerator, "__dict__", {}).get(_ATTR)
    return plugin.session if plugin is not None else None


# -------------------------------------------------------------------------------- the flag


def _env_int(environ: Dict[str, str], name: str, minimum: int) -> Optional[int]:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(f"{name}={text!r}: expected an integer >= {minimum}")
    return value


def flag_settings(environ: Optional[Dict[str, str]] = None) -> Optional[Dict[str, Any]]:
    """The `LM_RESILIENCY*` environment as ResiliencyPlugin arguments, or None when the flag is off.

    LM_RESILIENCY                      1/true/yes/on enables; unset/empty/0/false/no/off: inert
    LM_RESILIENCY_INTERVAL             capture (and SCOUT check) every N optimizer steps (default 10)
    LM_RESILIENCY_DIR                  node-local checkpoint folder (default ./checkpoints)
    LM_RESILIENCY_DISK_FLUSH_INTERVAL  flush to that folder every N steps (default 100; 0: never)
    LM_RESILIENCY_SHM_DIR              host-slot directory (default /dev/shm/lm-resiliency-<uid>)
    LM_RESILIENCY_DETECTION            0 turns SCOUT off (default on)
    LM_RESILIENCY_DATALOADER_RESUME    auto (default), continue or manual
    LM_RESILIENCY_RUN_ID               run identity across restarts (read by GEMINI itself)
    """
    env = os.environ if environ is None else environ
    value = env.get(FLAG, "").strip().lower()
    if value in _FALSE:
        return None  # inert: nothing else is read, imported or patched
    if value not in _TRUE:
        raise ConfigError(f"{FLAG}={env.get(FLAG)!r}: expected 1/true/yes/on to enable lm-resiliency, or "
                          "unset/0/false/no/off to leave the run untouched")
    from lm_resiliency.adapters.accelerate import RESUME_MODES

    checkpoint: Dict[str, Any] = {}
    directory = env.get("LM_RESILIENCY_DIR", "").strip()
    if directory:
        checkpoint["disk_folder"] = directory
    shm = env.get("LM_RESILIENCY_SHM_DIR", "").strip()
    if shm:
        checkpoint["shared_memory_dir"] = shm
    flush = _env_int(env, "LM_RESILIENCY_DISK_FLUSH_INTERVAL", 0)
    if flush is not None:
        checkpoint["disk_flush_interval"] = flush
    detection = env.get("LM_RESILIENCY_DETECTION", "1").strip().lower()
    if detection not in _TRUE + _FALSE:
        raise ConfigError(f"LM_RESILIENCY_DETECTION={env.get('LM_RESILIENCY_DETECTION')!r}: expected 1 or 0")
    mode = env.get("LM_RESILIENCY_DATALOADER_RESUME", "auto").strip().lower() or "auto"
    if mode not in RESUME_MODES:
        raise ConfigError(f"LM_RESILIENCY_DATALOADER_RESUME={mode!r}: expected one of {RESUME_MODES}")
    return {"interval": _env_int(env, "LM_RESILIENCY_INTERVAL", 1),
            "checkpoint": InMemoryCkptConfig(**checkpoint),
            "enable_detection": detection in _TRUE,
            "resume_dataloaders": mode}


class _FlagAttachment:
    """Per-accelerator state of the LM_RESILIENCY flag: attaches a plugin at the first use of the
    prepared objects (so a script that prepares in several calls is fully covered)."""

    def __init__(self, accelerator: Any, settings: Dict[str, Any]) -> None:
        self.accelerator = weakref.ref(accelerator)
        self.settings = settings
        self.plugin: Optional[ResiliencyPlugin] = None
        self._hooks: List[Any] = []
        self._hooked_models: set = set()
        self._trackers: List[Any] = []
        self.done = False

    def note_prepared(self, accelerator: Any) -> None:
        from lm_resiliency.adapters.accelerate import DataLoaderTracker, trackable

        if self.done:
            return
        for dataloader in trackable(accelerator):
            tracker = DataLoaderTracker.of(dataloader)
            if tracker.before_iteration is None:
                tracker.before_iteration = self.trigger
                self._trackers.append(tracker)
        for model in accelerator._models:
            if id(model) not in self._hooked_models and hasattr(model, "register_forward_pre_hook"):
                self._hooked_models.add(id(model))
                self._hooks.append(model.register_forward_pre_hook(lambda module, args: self.trigger()))

    def trigger(self) -> None:
        if self.done:
            return
        self.done = True
        for hook in self._hooks:
            hook.remove()
        for tracker in self._trackers:
            tracker.before_iteration = None
        accelerator = self.accelerator()
        if accelerator is None:
            return
        owner = accelerator.__dict__.get(_ATTR)
        if owner is not None and owner is not self.plugin and owner.session is not None:
            return  # the script attached its own ResiliencyPlugin: the flag defers to it
        self.plugin = ResiliencyPlugin(**self.settings)
        self.plugin.from_flag = True
        self.plugin.attach(accelerator)



def _on_prepared(accelerator: Any) -> None:
    settings = flag_settings()
    if settings is None:
        return
    attachment = accelerator.__dict__.get("_lm_resiliency_flag")
    if attachment is None:
        attachment = _FlagAttachment(accelerator, settings)
        accelerator.__dict__["_lm_resiliency_flag"] = attachment
    attachment.note_prepared(accelerator)


def install_prepare_hook() -> None:
    """Wrap `accelerate.Accelerator.prepare` so that, while LM_RESILIENCY is set, every prepared
    accelerator gets a ResiliencyPlugin at the first use of its prepared objects. Idempotent."""
    from accelerate import Accelerator

    current = Accelerator.prepare
    if getattr(current, "_lm_resiliency_wrapped", None) is not None:
        return

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        result = current(self, *args, **kwargs)
        _on_prepared(self)
        return result

    prepare.__doc__ = current.__doc__
    prepare.__wrapped__ = current
    prepare._lm_resiliency_wrapped = current
    Accelerator.prepare = prepare


def uninstall_prepare_hook() -> None:
    from accelerate import Accelerator

    original = getattr(Accelerator.prepare, "_lm_resiliency_wrapped", None)
    if original is not None:
        Accelerator.prepare = original


def activate(environ: Optional[Dict[str, str]] = None) -> bool:
    """Honour LM_RESILIENCY: install the prepare hook when it is on. Returns whether it is on.
    A bad LM_RESILIENCY* value raises ConfigError naming the variable."""
    if flag_settings(environ) is None:
        return False
    install_prepare_hook()
    return True


USAGE = ("usage: python -m lm_resiliency.callbacks.accelerate (SCRIPT.py | -m MODULE) [ARGS...]\n"
         "  e.g.  LM_RESILIENCY=1 accelerate launch -m lm_resiliency.callbacks.accelerate train.py --lr 1e-3\n"
         "        LM_RESILIENCY=1 torchrun --nproc-per-node 2 -m lm_resiliency.callbacks.accelerate train.py\n"
         "Runs the script unchanged; with LM_RESILIENCY=1 every Accelerator it prepares gets lm-resiliency.")


def main(argv: Optional[List[str]] = None) -> None:
    """The launcher bootstrap: honour the flag, then run the script as `__main__`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if args else 2)
    try:
        activate()
    except ConfigError as exc:
        print(f"lm-resiliency: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args[0] == "-m":
        if len(args) < 2:
            print(USAGE, file=sys.stderr)
            raise SystemExit(2)
        sys.argv = [args[1]] + args[2:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    script = args[0]
    sys.argv = args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # what `python script.py` puts first
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    from lm_resiliency.callbacks.accelerate import main as _main  # the importable module, not this copy

    _main()
