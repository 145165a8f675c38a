"""The guard over state lm-resiliency just recovered, against a script's own checkpoint loading.

After GEMINI recovered step N into a model and its optimizer, a script that then loads its own
checkpoint into them (``model.load_state_dict(torch.load("snapshot.pt"))``) replaces step N while
its loop counts from its own checkpoint's position: the run goes on, silently wrong. Two guards,
both here:

- `OverwriteGuard` (every surface whose adapter names its `overwrite_targets()`: the PyTorch
  adapter of `enable_resiliency`, Accelerate, the torchrun native worker adapter). From a GEMINI
  recovery until the first optimizer step after it, `load_state_dict` on the recovered model (on
  any of its modules) or optimizer raises `RecoveredStateOverwrite`, which says what was
  recovered and what to do. The session's own loads happen before it is armed; a load that runs
  as `load_fallback` is no GEMINI recovery, so nothing is armed; Lightning hands recovered state
  to its checkpoint connector, which loads it later, and names no targets.
- `EarlyLoads` (torchrun zero-import workers of a generation that recovers GEMINI state). Such a
  script resumes on its own before the worker adapter attaches (it loads a snapshot into the
  model before wrapping it in DDP); GEMINI then recovers step N over that state while the loop
  starts at the snapshot's position. The bootstrap notes which modules and optimizers were loaded
  before the attach and whether the script read LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP (or the
  worker context); a script that loaded state into the attached objects and never read the step
  is refused before anything is recovered. Loading pretrained weights before attach is fine in a
  script that starts its loop at that step.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Dict, Iterable, List, Optional

import torch

from lm_resiliency.errors import ResiliencyError

RESUME_STEP_NAME = "LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP"


class RecoveredStateOverwrite(ResiliencyError, RuntimeError):
    """User code loaded state into a model or optimizer that lm-resiliency had just recovered."""


def _modules_and_optimizers(targets: Iterable[Any]) -> tuple:
    modules: List[torch.nn.Module] = []
    optimizers: List[torch.optim.Optimizer] = []
    for target in targets:
        if isinstance(target, torch.nn.Module):
            modules.extend(target.modules())  # wrappers (DDP, torch.compile) hold the inner module
        elif isinstance(target, torch.optim.Optimizer):
            optimizers.append(target)
    return modules, optimizers


class OverwriteGuard:
    """Refuses `load_state_dict` on `targets` (modules, with every submodule, and optimizers)
    until `remove()`. `what` says what was recovered, e.g. "run 'r' at GEMINI step 100 (from memory)"."""

    def __init__(self, targets: Iterable[Any], *, step: int, what: str) -> None:
        self.step = step
        self.what = what
        modules, optimizers = _modules_and_optimizers(targets)
        # Hooks travel with copy.deepcopy (an EMA copy of the model): only these objects are refused
        # (by identity: a module class may define __eq__ without __hash__).
        self._guarded = {id(obj) for obj in [*modules, *optimizers]}
        self._handles: List[Any] = []
        for module in modules:
            self._handles.append(module.register_load_state_dict_pre_hook(self._module_hook))
        for optimizer in optimizers:
            self._handles.append(optimizer.register_load_state_dict_pre_hook(self._optimizer_hook))

    def _module_hook(self, module: Any, *args: Any) -> None:
        if id(module) in self._guarded:
            raise RecoveredStateOverwrite(self.message(f"{type(module).__name__}.load_state_dict()"))

    def _optimizer_hook(self, optimizer: Any, state_dict: Any) -> None:
        if id(optimizer) in self._guarded:
            raise RecoveredStateOverwrite(self.message(f"{type(optimizer).__name__}.load_state_dict()"))
        return None

    def message(self, call: str) -> str:
        return (f"lm-resiliency: {call} refused: this launch resumed {self.what}, which restored this model and "
                f"optimizer; loading other state into them now would replace step {self.step} while the training "
                f"loop counts from somewhere else. Start the loop at step {self.step} (resiliency.step_count; under "
                f"torchrun --rdzv-backend=lm_resiliency, {RESUME_STEP_NAME}) and load your own checkpoint only when "
                "nothing was recovered (resiliency.recovered_from != 'gemini'), or pass it as enable_resiliency(..., "
                "load_fallback=...) (docs/porting.md, section 4)")

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()


class EarlyLoads:
    """In a torchrun worker whose generation recovers GEMINI step `step`: the modules and
    optimizers the script loaded state into, and whether it read the step it must resume from.
    `loading()` tells it which loads are lm-resiliency's own (the attach in progress)."""

    def __init__(self, step: int, loading: Any) -> None:
        self.step = step
        self._loading = loading
        self._loaded: Dict[int, Any] = {}  # id -> weak reference: by identity, whatever __eq__ says
        self.read_step = False
        self._lock = threading.Lock()

    def note_load(self, obj: Any) -> None:
        if self._loading():
            return
        try:
            ref = weakref.ref(obj)
        except TypeError:
            return  # not an object the adapter could attach to
        with self._lock:
            self._loaded[id(obj)] = ref

    def note_step_read(self) -> None:
        self.read_step = True

    def watch_module_class(self, module_class: Any) -> None:
        """Note every `load_state_dict` on a module (torch.nn.Module, patched once)."""
        self._watch(module_class)

    def watch_optimizer_class(self, optimizer_class: Any) -> None:
        """Note every `load_state_dict` on an optimizer (torch.optim.Optimizer, patched once)."""
        self._watch(optimizer_class)

    def _watch(self, cls: Any) -> None:
        original = cls.load_state_dict
        early = self

        def load_state_dict(obj: Any, *args: Any, **kwargs: Any) -> Any:
            early.note_load(obj)
            return original(obj, *args, **kwargs)

        load_state_dict.__wrapped__ = original  # type: ignore[attr-defined]
        load_state_dict.__doc__ = original.__doc__
        cls.load_state_dict = load_state_dict

    def problem(self, targets: Iterable[Any]) -> str:
        """This rank's reason not to attach ("" when there is none)."""
        if self.read_step:
            return ""
        modules, optimizers = _modules_and_optimizers(targets)
        with self._lock:
            loaded = sorted({type(obj).__name__ for obj in [*modules, *optimizers]
                             if id(obj) in self._loaded and self._loaded[id(obj)]() is obj})
        if not loaded:
            return ""
        return f"{', '.join(loaded)}.load_state_dict() ran before the attach"

    def refusal(self, problems: List[str], run_id: str) -> Optional[str]:
        """The error every rank raises when any rank has a problem (`problems` by rank), or None."""
        bad = [rank for rank, text in enumerate(problems) if text]
        if not bad:
            return None
        first = problems[bad[0]]
        return (f"this generation resumes run {run_id!r} at GEMINI step {self.step}, and the script loaded its own "
                f"state first ({first}; ranks {', '.join(map(str, bad))}) without reading {RESUME_STEP_NAME}: GEMINI "
                f"would replace that state with step {self.step} while the loop starts from the script's own "
                f"checkpoint position, training the wrong steps. Make the loop start at {RESUME_STEP_NAME} and skip "
                "the script's own resume when it is > 0 (docs/torchrun.md, 'The one loop edit'); nothing was "
                "loaded, GEMINI's state is kept for the next launch")


def watch_environment_reads(name: str, on_read: Any) -> None:
    """Call `on_read()` when the process reads environment variable `name` (os.environ[name],
    .get, os.getenv, `in`). Swaps the class of `os.environ` for a subclass; idempotent per name."""
    environ = os.environ
    base = type(environ)
    watched = getattr(base, "_lm_resiliency_watched", None)
    if watched is not None:
        watched[name] = on_read
        return

    class WatchedEnviron(base):  # type: ignore[misc, valid-type]
        _lm_resiliency_watched = {name: on_read}

        def __getitem__(self, key: Any) -> Any:
            callback = self._lm_resiliency_watched.get(key)
            if callback is not None:
                callback()
            return super().__getitem__(key)

    environ.__class__ = WatchedEnviron
