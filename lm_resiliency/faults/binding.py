"""What a campaign binds to, per framework: the model parts its module paths resolve in, the
optimizer its faults see, and the campaign clock, which follows the framework's own step.

- a `torch.nn.Module` with a `torch.optim.Optimizer` (None: `advance()` by hand): the iteration
  ends when its `step()` ran (step post-hook);
- Megatron Core model chunks (a list or tuple) with the `MegatronOptimizer` (or a torch
  optimizer): when `step()` returned `update_successful` True (a skipped update does not count);
- a DeepSpeed engine alone (it owns its optimizer): when `engine.step()` changed
  `engine.global_steps` (a gradient-accumulation micro-step does not count);
- a TorchTitan `Trainer` alone: when `trainer.optimizers.step()` ran in a new `trainer.step`
  (the zero-lr steps its checkpointing runs do not count).

Frameworks are recognized by their objects' own attributes; none is imported here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

Hook = Callable[[], None]


@dataclass(frozen=True)
class Clock:
    """How the framework's step reaches the session: `install(pre, applied, skipped)` calls
    `pre()` before an optimizer update, `applied()` after one that counts and `skipped()` after
    one that does not, and returns the function that removes it. `iteration()` is the iteration
    the framework says is running (None when it keeps no counter we can read)."""

    install: Callable[[Hook, Hook, Hook], Callable[[], None]]
    iteration: Callable[[], Optional[int]]


@dataclass(frozen=True)
class Binding:
    framework: str                      # "pytorch", "megatron", "deepspeed" or "torchtitan"
    parts: Tuple[torch.nn.Module, ...]  # where module paths resolve (model chunks, pipeline parts)
    optimizer: Any                      # what faults see as `request.optimizer`
    clock: Optional[Clock]              # None: the caller advances by hand
    start: Optional[int]                # completed steps the framework reports at attach


def _no_counter() -> Optional[int]:
    return None


def _torch_hooks(optimizer: torch.optim.Optimizer, counts: Callable[[], bool] = lambda: True) -> Clock:
    def install(pre: Hook, applied: Hook, skipped: Hook) -> Callable[[], None]:
        handles = [optimizer.register_step_pre_hook(lambda *_: pre() if counts() else None),
                   optimizer.register_step_post_hook(lambda *_: applied() if counts() else None)]

        def remove() -> None:
            for handle in handles:
                handle.remove()
        return remove
    return Clock(install, _no_counter)


def _wrapped_step(owner: Any, applied_by: Callable[[Any, Any], bool], before: Callable[[], Any],
                  boundary: Callable[[], bool], iteration: Callable[[], Optional[int]]) -> Clock:
    """Wrap `owner.step` on the instance (the class is never touched): `before()` is read before
    the call, `applied_by(result, before)` says whether the update counts."""
    def install(pre: Hook, applied: Hook, skipped: Hook) -> Callable[[], None]:
        if "step" in vars(owner):
            raise RuntimeError(f"{type(owner).__name__}.step is already wrapped on this object (another fault "
                               f"injection or resiliency session?); close() that one first")
        original = owner.step

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            at_boundary = boundary()
            if at_boundary:
                pre()
            previous = before()
            result = original(*args, **kwargs)
            if applied_by(result, previous):
                applied()
            elif at_boundary:
                skipped()
            return result

        owner.step = step

        def remove() -> None:
            if vars(owner).get("step") is step:
                del owner.step
        return remove
    return Clock(install, iteration)


def _is_deepspeed_engine(obj: Any) -> bool:
    return (isinstance(obj, torch.nn.Module) and hasattr(obj, "global_steps") and hasattr(obj, "module")
            and callable(getattr(obj, "is_gradient_accumulation_boundary", None)))


def _is_torchtitan_trainer(obj: Any) -> bool:
    return (not isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, "model_parts", None), (list, tuple))
            and hasattr(obj, "optimizers") and hasattr(obj, "step") and callable(getattr(obj, "train_step", None)))


def _deepspeed(engine: Any) -> Binding:
    clock = _wrapped_step(engine, lambda result, before: engine.global_steps != before,
                          lambda: engine.global_steps, engine.is_gradient_accumulation_boundary,
                          lambda: int(engine.global_steps) + 1)
    return Binding("deepspeed", (engine,), engine.optimizer, clock, int(engine.global_steps))


def _torchtitan(trainer: Any) -> Binding:
    optimizers = trainer.optimizers
    counted = {"step": int(trainer.step)}

    def new_step() -> bool:
        # Only the update of a trainer.step not counted yet: init_optim_state's zero-lr steps
        # (checkpointing) run in a step that already had its update.
        return int(trainer.step) != counted["step"]

    def install(pre: Hook, applied: Hook, skipped: Hook) -> Callable[[], None]:
        def after() -> None:
            counted["step"] = int(trainer.step)
            applied()
        return _torch_hooks(optimizers, new_step).install(pre, after, skipped)

    inner = list(getattr(optimizers, "optimizers", ()))
    parts = tuple(trainer.model_parts)
    return Binding("torchtitan", parts, inner[0] if len(inner) == 1 else optimizers,
                   Clock(install, lambda: int(trainer.step)), int(trainer.step))


def _megatron(chunks: Any, optimizer: Any) -> Binding:
    parts = tuple(chunks)
    for index, chunk in enumerate(parts):
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"enable_fault_injection: model chunk {index} is a {type(chunk).__name__}, not a "
                            f"torch.nn.Module (pass the chunks setup_model_and_optimizer() returned)")
    if not parts:
        raise TypeError("enable_fault_injection: the list of model chunks is empty")
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        clock = _torch_hooks(optimizer) if optimizer is not None else None
        return Binding("megatron", parts, optimizer, clock, None)
    if not callable(getattr(optimizer, "step", None)):
        raise TypeError(f"enable_fault_injection: the optimizer of Megatron model chunks must be the "
                        f"MegatronOptimizer (or a torch optimizer), got {type(optimizer).__name__}")
    clock = _wrapped_step(optimizer, lambda result, before: bool(result[0] if isinstance(result, tuple) else result),
                          _no_counter, lambda: True, _no_counter)
    return Binding("megatron", parts, optimizer, clock, None)


def bind(model: Any, optimizer: Any) -> Binding:
    """The binding of `model` (and `optimizer`) for the first argument of `enable_fault_injection`."""
    if _is_deepspeed_engine(model) or _is_torchtitan_trainer(model):
        what = "DeepSpeed engine" if _is_deepspeed_engine(model) else "TorchTitan Trainer"
        if optimizer is not None:
            raise TypeError(f"enable_fault_injection: a {what} owns its optimizer; pass only the "
                            f"{what.split()[-1].lower()} (enable_fault_injection({what.split()[-1].lower()}, "
                            f"campaign=...))")
        return _deepspeed(model) if _is_deepspeed_engine(model) else _torchtitan(model)
    if isinstance(model, (list, tuple)):
        return _megatron(model, optimizer)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable_fault_injection: expected a torch.nn.Module, Megatron Core model chunks (a list "
                        f"of modules), a DeepSpeed engine or a TorchTitan Trainer, got {type(model).__name__}")
    if optimizer is None:
        return Binding("pytorch", (model,), None, None, None)
    if not hasattr(optimizer, "register_step_post_hook"):
        raise TypeError(f"enable_fault_injection: {type(optimizer).__name__} has no step hooks; "
                        "pass optimizer=None and call session.advance() after each step")
    return Binding("pytorch", (model,), optimizer, _torch_hooks(optimizer), None)


def resolve_modules(parts: Tuple[torch.nn.Module, ...], path: str,
                    fault_id: str) -> List[Tuple[str, torch.nn.Module]]:
    """Every (qualified name, module) `path` names in the model parts: a dotted name as in
    `get_submodule` ("" the root), found behind a wrapper's "module." too; with several parts,
    "<index>.<path>" names one part's, a bare path every part's. A module reachable under several
    names (shared) is one module with several names. Raises ValueError when there is none."""
    prefixed = len(parts) > 1
    head, _, rest = path.partition(".")
    if prefixed and head.isdigit() and int(head) < len(parts):
        scopes = [(head, parts[int(head)], rest)]
    else:
        scopes = [(str(i) if prefixed else "", part, path) for i, part in enumerate(parts)]
    found: List[Tuple[str, torch.nn.Module]] = []
    for prefix, part, name in scopes:
        for candidate in (name, f"module.{name}" if name else "module"):
            try:
                module = part.get_submodule(candidate) if candidate else part
            except AttributeError:
                continue
            names = [n for n, m in part.named_modules(remove_duplicate=False) if m is module] or [candidate]
            found.extend(((f"{prefix}.{n}" if prefix else n).strip("."), module) for n in names)
            break
    if not found:
        raise ValueError(f"fault {fault_id!r}: the model has no submodule {path!r} (module_path must be a dotted "
                         f"name as in model.get_submodule{'; prefix a model part index, e.g. 0.' if prefixed else ''})")
    return found


__all__ = ["Binding", "Clock", "bind", "resolve_modules"]
