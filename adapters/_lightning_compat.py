"""Private Lightning API the Lightning adapter relies on (all of it is here).

Each checked against Lightning 2.6.6 (`lightning.pytorch` and `pytorch_lightning`);
tests/unit/test_lightning_compat.py fails naming the one that changed:
- `<package>.trainer.call._call_callbacks_state_dict(trainer)`: every callback's state, keyed as
  Lightning keys it in a checkpoint (what `Trainer.save_checkpoint` writes).
- `Trainer._checkpoint_connector`: its `_loaded_checkpoint` (the checkpoint dictionary Lightning
  restores precision, loops, optimizers and schedulers from after `on_fit_start`), `_ckpt_path`,
  `resume_start(checkpoint_path, weights_only)` (shadowed once on the instance so a user's
  `ckpt_path` does not replace newer GEMINI state), `restore_model()`,
  `restore_datamodule()`, `restore_callbacks()`.
- `FitLoop._combined_loader` (`.flattened`) and `FitLoop._data_fetcher` (`.length`,
  `.iterator`): the training dataloaders of the running epoch, to skip batches already trained on.
- `lightning.fabric.utilities.data._set_sampler_epoch(loader, epoch)` (`lightning_fabric` for
  `pytorch_lightning`): the shuffle order of an epoch.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Optional, Tuple

LIGHTNING_CHECKED = "2.6.6"


def callbacks_state_dict(trainer: Any, package: str) -> Dict[str, Any]:
    """Every callback's state, as Lightning's own checkpoints hold it."""
    return importlib.import_module(f"{package}.trainer.call")._call_callbacks_state_dict(trainer)


def set_loaded_checkpoint(trainer: Any, checkpoint: Dict[str, Any]) -> None:
    """Make `checkpoint` what Lightning restores from when fit starts."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def take_ckpt_path(trainer: Any) -> Optional[str]:
    """The `ckpt_path` the user passed to `fit`, cleared so Lightning does not load it."""
    connector = trainer._checkpoint_connector
    path, connector._ckpt_path = connector._ckpt_path, None
    return path


def skip_next_resume_start(trainer: Any, on_skip: Callable[[Optional[str]], None]) -> None:
    """Lightning's next `resume_start(ckpt_path)` loads nothing; `on_skip(ckpt_path)` runs instead."""
    connector = trainer._checkpoint_connector

    def resume_start(checkpoint_path: Optional[str] = None, weights_only: Any = None) -> None:
        del connector.resume_start  # back to the class method
        on_skip(checkpoint_path)
        connector._ckpt_path = None

    connector.resume_start = resume_start


def forget_resume_start(trainer: Any) -> None:
    """Undo `skip_next_resume_start` if Lightning did not call it."""
    trainer._checkpoint_connector.__dict__.pop("resume_start", None)


def restore_before_setup(trainer: Any) -> None:
    """Restore model, datamodule and callbacks from the loaded checkpoint now (the steps Lightning
    ran already for strategies that restore before setup)."""
    connector = trainer._checkpoint_connector
    connector.restore_model()
    connector.restore_datamodule()
    connector.restore_callbacks()


def training_fetch(trainer: Any) -> Tuple[Any, Any]:
    """(combined loader, data fetcher) of the running fit epoch; (None, None) before one exists."""
    fit_loop = trainer.fit_loop
    return fit_loop._combined_loader, fit_loop._data_fetcher


def set_sampler_epoch(package: str, loader: Any, epoch: int) -> None:
    """Give `loader`'s sampler the shuffle order of `epoch`."""
    fabric = "lightning.fabric" if package == "lightning.pytorch" else "lightning_fabric"
    importlib.import_module(f"{fabric}.utilities.data")._set_sampler_epoch(loader, epoch)
