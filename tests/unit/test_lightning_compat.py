"""adapters/_lightning_compat.py: every private Lightning name it uses still exists with the shape
it was checked against, in both `lightning.pytorch` and `pytorch_lightning`. An upgrade that
renames one fails here, naming it. Real Trainers (no fit), nothing mocked."""

import importlib
import inspect

import pytest

from lm_resiliency.adapters import _lightning_compat as compat

PACKAGES = [("lightning.pytorch", "lightning.fabric"), ("pytorch_lightning", "lightning_fabric")]


def _fail(package: str, name: str) -> str:
    version = importlib.import_module(package).__version__
    return (f"{package} {version} changed {name} (checked against {compat.LIGHTNING_CHECKED}): "
            "review lm_resiliency/adapters/_lightning_compat.py")


@pytest.mark.parametrize("package, fabric", PACKAGES)
def test_private_lightning_names_are_the_checked_ones(package, fabric, tmp_path):
    call = importlib.import_module(f"{package}.trainer.call")
    assert callable(getattr(call, "_call_callbacks_state_dict", None)), _fail(package, "_call_callbacks_state_dict")
    data = importlib.import_module(f"{fabric}.utilities.data")
    assert list(inspect.signature(data._set_sampler_epoch).parameters) == ["dataloader", "epoch"], \
        _fail(fabric, "_set_sampler_epoch(dataloader, epoch)")
    fetchers = importlib.import_module(f"{package}.loops.fetchers")
    fetcher = fetchers._DataFetcher()
    assert {"length", "iterator"} <= set(vars(fetcher)), _fail(package, "_DataFetcher.length/.iterator")

    trainer = importlib.import_module(package).Trainer(default_root_dir=tmp_path, logger=False,
                                                        enable_progress_bar=False, enable_model_summary=False)
    connector = trainer._checkpoint_connector
    for name in ("_loaded_checkpoint", "_ckpt_path"):
        assert name in vars(connector), _fail(package, f"_CheckpointConnector.{name}")
    assert list(inspect.signature(connector.resume_start).parameters) == ["checkpoint_path", "weights_only"], \
        _fail(package, "_CheckpointConnector.resume_start(checkpoint_path, weights_only)")
    for name in ("restore_model", "restore_datamodule", "restore_callbacks"):
        assert callable(getattr(connector, name, None)), _fail(package, f"_CheckpointConnector.{name}")
    assert compat.training_fetch(trainer) == (None, None), _fail(package, "FitLoop._combined_loader/_data_fetcher")
    assert isinstance(compat.callbacks_state_dict(trainer, package), dict)  # default callbacks: checkpointing

    connector._ckpt_path = "given.ckpt"
    skipped = []
    compat.skip_next_resume_start(trainer, skipped.append)
    connector.resume_start("given.ckpt")
    assert skipped == ["given.ckpt"] and connector._ckpt_path is None and "resume_start" not in vars(connector)
    compat.set_loaded_checkpoint(trainer, {"global_step": 3})
    assert connector._loaded_checkpoint == {"global_step": 3}
