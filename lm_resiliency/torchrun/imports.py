"""The worker's import watch: which higher-level framework a torchrun worker imports, and a
callback after chosen modules finish executing (so a framework is patched before user code can
take a name from it). One watch per process, installed by the worker bootstrap."""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Callable, Dict, List, Optional

HIGHER_LEVEL = {"deepspeed": "DeepSpeed", "torchtitan": "TorchTitan", "megatron": "Megatron Core"}


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Notes higher-level framework imports and runs callbacks after chosen modules execute."""

    def __init__(self) -> None:
        self.on_framework: Optional[Callable[[str], None]] = None
        self.after: Dict[str, List[Callable[[Any], None]]] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name in HIGHER_LEVEL and self.on_framework is not None:
            self.on_framework(name)
        callbacks = self.after.pop(name, None)
        if not callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            self.after[name] = callbacks
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            self.after[name] = callbacks
            return spec
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            for callback in callbacks:
                callback(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this loader instance only
        return spec


_WATCH: Optional[_ImportWatch] = None


def _watch() -> _ImportWatch:
    global _WATCH
    if _WATCH is None:
        _WATCH = _ImportWatch()
        sys.meta_path.insert(0, _WATCH)
    return _WATCH


def watch_frameworks(on_framework: Callable[[str], None]) -> List[str]:
    """Call `on_framework(name)` when a higher-level framework starts importing; returns those
    already imported (torch may be imported before the bootstrap, by another sitecustomize)."""
    _watch().on_framework = on_framework
    return [name for name in HIGHER_LEVEL if name in sys.modules]


def when_imported(name: str, callback: Callable[[Any], None]) -> None:
    """`callback(module)` once module `name` has executed: now, if it already has."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
    else:
        _watch().after.setdefault(name, []).append(callback)


def after_construction(cls: Any, callback: Callable[[Any], None]) -> None:
    """Call `callback(obj)` once each `cls` object is constructed: when its outermost __init__
    returns. Subclasses created from now on are instrumented when the class is created, so their
    own __init__ (run around the base's) is included."""
    depth: Dict[int, int] = {}

    def wrap(klass: Any) -> None:
        original = klass.__dict__["__init__"]

        def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
            key = id(obj)
            depth[key] = depth.get(key, 0) + 1
            try:
                original(obj, *args, **kwargs)
            finally:
                depth[key] -= 1
                outermost = depth[key] == 0
                if outermost:
                    del depth[key]
            if outermost:
                callback(obj)

        klass.__init__ = __init__

    wrap(cls)
    hook = cls.__dict__.get("__init_subclass__")

    def __init_subclass__(sub: Any, **kwargs: Any) -> None:
        if hook is not None:
            hook.__func__(sub, **kwargs)
        else:
            super(cls, sub).__init_subclass__(**kwargs)
        if "__init__" in sub.__dict__:
            wrap(sub)

    cls.__init_subclass__ = classmethod(__init_subclass__)
