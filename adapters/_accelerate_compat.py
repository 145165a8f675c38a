"""Private Accelerate API the Accelerate adapter and surface rely on (all of it is here).

Each checked against accelerate 1.15.0 (tests/unit/test_accelerate_compat.py fails naming the
one that changed):
- `Accelerator._models`, `._optimizers`, `._dataloaders`, `._schedulers`, `._custom_objects`:
  the lists `prepare()` / `register_for_checkpointing()` append to, in preparation order (what
  `Accelerator.save_state` saves; there is no public accessor).
- The class of a prepared dataloader is swapped, per object, for a subclass that reports its
  position (`swap_class`). Accelerate's `DataLoaderAdapter` makes `__class__` a read-only
  property, so the swap writes the object's type slot directly (`object.__dict__["__class__"]`).
"""

from __future__ import annotations

from typing import Any, List

ACCELERATE_CHECKED = "1.15.0"

_CLASS_SLOT = object.__dict__["__class__"]


def models(accelerator: Any) -> List[Any]:
    """The prepared models, in preparation order."""
    return list(accelerator._models)


def optimizers(accelerator: Any) -> List[Any]:
    """The prepared (AcceleratedOptimizer-wrapped) optimizers."""
    return list(accelerator._optimizers)


def dataloaders(accelerator: Any) -> List[Any]:
    """The prepared dataloaders."""
    return list(accelerator._dataloaders)


def schedulers(accelerator: Any) -> List[Any]:
    """The prepared LR schedulers."""
    return list(accelerator._schedulers)


def custom_objects(accelerator: Any) -> List[Any]:
    """The objects registered with `register_for_checkpointing`."""
    return list(accelerator._custom_objects)


def swap_class(obj: Any, cls: type) -> None:
    """Make `obj` an instance of `cls` (a subclass of its class, or its original class back)."""
    _CLASS_SLOT.__set__(obj, cls)
