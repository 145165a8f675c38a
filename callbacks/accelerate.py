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
(settings from the `LM_RESILIENCY*` variables or a policy file: `lm_resiliency.settings.ResiliencyPolicy`,
shared with Lightning's entry point), attached and recovered at the first use of the
prepared objects (first dataloader iteration or model forward), so everything the script prepares
before its loop is covered. With `LM_RESILIENCY` unset (or 0/false/no/off) the bootstrap only runs
the script: nothing is patched and Accelerate is not even imported by it.

Under Accelerate's DeepSpeed integration (`Accelerator(deepspeed_plugin=...)`) the same plugin and
flag hook the DeepSpeed engine's `step()` (the prepared optimizer's `step()` is a no-op there);
dataloader positions and `accelerator.step` are captured as under MULTI_CPU/MULTI_GPU.
"""

from __future__ import annotations

import functools
import logging
import os
import runpy
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional

from lm_resiliency.adapters import _accelerate_compat as compat
from lm_resiliency.attach import AttachOptions, attach
from lm_resiliency.config import DATALOADER_RESUME_MODES, ConfigError, InMemoryCkptConfig
from lm_resiliency.settings import ResiliencyPolicy
from lm_resiliency.recovery import RecoveryMode
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.session import ResiliencySession

logger = logging.getLogger(__name__)

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
        if resume_dataloaders not in DATALOADER_RESUME_MODES:
            raise ValueError(f"ResiliencyPlugin(resume_dataloaders=...): must be one of {DATALOADER_RESUME_MODES}, "
                             f"got {resume_dataloaders!r}")
        # Checked now, not at attach; the DeepSpeed config section may still fill unset ones there.
        self.options = AttachOptions(
            interval=interval, checkpoint=checkpoint, replay=replay, enable_checkpoint=enable_checkpoint,
            enable_detection=enable_detection, extra_state_fn=extra_state_fn, load_extra_state_fn=load_extra_state_fn,
            load_fallback=load_fallback, recovery_mode=recovery_mode, orchestration=orchestration,
            fault_callback=fault_callback, oob_fault_callback=oob_fault_callback,
            durable_checkpoint=durable_checkpoint, caller="ResiliencyPlugin")
        self.checkpoint, self.replay = self.options.config, self.options.replay_config
        self.resume_dataloaders = resume_dataloaders
        self.session: Optional[ResiliencySession] = None
        self.adapter: Any = None
        self.accelerator: Any = None

    # ----------------------------------------------------------------- attach

    def attach(self, accelerator: Any) -> ResiliencySession:
        """Collective (every rank): attach to `accelerator` after `prepare()`, load the newest
        recoverable state and return the session (`step_count` is the resume point).

        Under Accelerate's DeepSpeed integration the prepared optimizer's `step()` is a no-op, so
        the DeepSpeed engine's `step()` is hooked instead (lm_resiliency.callbacks.deepspeed), and
        the engine config's optional "lm_resiliency" section fills arguments left unset."""
        from lm_resiliency.adapters.accelerate import (AccelerateAdapter, AccelerateDeepSpeedAdapter,
                                                       check_prepared, uses_deepspeed)

        if self.session is not None:
            raise RuntimeError("this ResiliencyPlugin is already attached; create one plugin per Accelerator")
        check_prepared(accelerator)
        owner = accelerator.__dict__.get(_ATTR)
        if owner is not None and owner.session is not None:
            raise RuntimeError("lm-resiliency is already attached to this Accelerator "
                               f"({'by the LM_RESILIENCY flag' if owner.from_flag else 'by another plugin'})")
        options = self.options
        if uses_deepspeed(accelerator):
            from lm_resiliency.adapters.deepspeed import with_config_section
            from lm_resiliency.callbacks.deepspeed import DeepSpeedEngineHooks

            options = with_config_section(compat.models(accelerator)[0], options)
            adapter: Any = AccelerateDeepSpeedAdapter(accelerator, hooks=DeepSpeedEngineHooks,
                                                      resume_dataloaders=self.resume_dataloaders)
            session = attach(adapter, options)
        else:
            adapter = AccelerateAdapter(accelerator, resume_dataloaders=self.resume_dataloaders,
                                        skip_replication_if_hsdp=options.config.skip_replication_if_hsdp)
            session = attach(adapter, options)
        self.session, self.adapter, self.accelerator = session, adapter, accelerator
        accelerator.__dict__[_ATTR] = self
        if session.recovered_from is not None:
            epoch, batches = self.resume_position
            logger.info("lm-resiliency: Accelerate run (%s) resumes after optimizer step %d (epoch %d, batch %d, "
                        "dataloaders: %s)", adapter.describe(), session.step_count, epoch, batches,
                        self.resume_dataloaders)
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
        return self.adapter.loop.resume_position()

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
        if tracker is None or self.adapter is None or tracker not in self.adapter.loop.trackers:
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


def flag_plugin_arguments(policy: ResiliencyPolicy) -> Dict[str, Any]:
    """ResiliencyPlugin arguments for the policy the LM_RESILIENCY flag read
    (`ResiliencyPolicy.from_environment()`: the same variables and policy files as Lightning's)."""
    return dict(policy.arguments(), resume_dataloaders=policy.resume_dataloaders or "auto")


class _FlagAttachment:
    """Per-accelerator state of the LM_RESILIENCY flag: attaches a plugin at the first use of the
    prepared objects (so a script that prepares in several calls is fully covered)."""

    def __init__(self, accelerator: Any, policy: ResiliencyPolicy) -> None:
        self.accelerator = weakref.ref(accelerator)
        self.policy = policy
        self.plugin: Optional[ResiliencyPlugin] = None
        self._hooks: List[Any] = []
        self._hooked_models: set = set()
        self._trackers: List[Any] = []
        self.done = False

    def note_prepared(self, accelerator: Any) -> None:
        from lm_resiliency._torch_compat import find_wrapper, pin_bucket_layout
        from lm_resiliency.adapters.accelerate import DataLoaderTracker, trackable

        if self.done:
            return
        for dataloader in trackable(accelerator):
            tracker = DataLoaderTracker.of(dataloader)
            if tracker.before_iteration is None:
                tracker.before_iteration = self.trigger
                self._trackers.append(tracker)
        for model in compat.models(accelerator):
            if id(model) not in self._hooked_models and hasattr(model, "register_forward_pre_hook"):
                self._hooked_models.add(id(model))
                self._hooks.append(model.register_forward_pre_hook(lambda module, args: self.trigger()))
                # Pin DDP's buckets now, before any forward: a trigger from this hook would run
                # inside DDP's forward, after its reducer began the iteration.
                ddp = find_wrapper(model)
                if ddp is not None:
                    pin_bucket_layout(ddp)

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
        self.plugin = ResiliencyPlugin(**flag_plugin_arguments(self.policy))
        self.plugin.from_flag = True
        self.plugin.attach(accelerator)


def _on_prepared(accelerator: Any) -> None:
    policy = ResiliencyPolicy.from_environment()
    if policy is None:
        return
    attachment = accelerator.__dict__.get("_lm_resiliency_flag")
    if attachment is None:
        attachment = _FlagAttachment(accelerator, policy)
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

    functools.update_wrapper(prepare, current, assigned=("__doc__",), updated=())  # its docstring and __wrapped__
    prepare.__dict__["_lm_resiliency_wrapped"] = current  # ours: install is idempotent, uninstall restores it
    Accelerator.prepare = prepare


def uninstall_prepare_hook() -> None:
    from accelerate import Accelerator

    original = getattr(Accelerator.prepare, "_lm_resiliency_wrapped", None)
    if original is not None:
        Accelerator.prepare = original


def activate(environ: Optional[Dict[str, str]] = None) -> bool:
    """Honour LM_RESILIENCY: install the prepare hook when it is on. Returns whether it is on.
    A bad LM_RESILIENCY* value or policy file raises ConfigError naming it."""
    if ResiliencyPolicy.from_environment(environ) is None:
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
