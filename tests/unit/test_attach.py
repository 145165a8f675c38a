"""attach.py in one process: the options object every surface builds, and the recipe's cleanup."""

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, RecoveryMode, ReplayHarnessConfig
from lm_resiliency.adapters.pytorch import PyTorchAdapter
from lm_resiliency.attach import AttachOptions, attach
from lm_resiliency.config import ConfigError


def _objects():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_interval_is_the_shared_cadence_and_unset_arguments_stay_unset():
    options = AttachOptions(interval=5, recovery_mode="recovery_verified")
    assert options.config.interval == 5 and options.replay_config.check_interval == 5
    assert options.checkpoint is None and options.replay is None  # a DeepSpeed section may still fill them
    assert options.recovery_mode is RecoveryMode.RECOVERY_VERIFIED
    filled = options.replace(checkpoint=InMemoryCkptConfig(run_id="r"), replay=ReplayHarnessConfig())
    assert filled.config.run_id == "r" and filled.config.interval == 5 and filled.replay_config.check_interval == 5


def test_errors_name_the_surface_that_was_called():
    with pytest.raises(ConfigError, match=r"^ResiliencyPlugin\(interval=\.\.\.\): must be a positive int"):
        AttachOptions(interval=0, caller="ResiliencyPlugin")
    with pytest.raises(TypeError, match=r"^ResiliencyCallback\(checkpoint=\.\.\.\): expected an InMemoryCkptConfig"):
        AttachOptions(checkpoint={"interval": 3}, caller="ResiliencyCallback")
    with pytest.raises(ValueError, match="'sometimes' is not a valid RecoveryMode"):
        AttachOptions(recovery_mode="sometimes")


def test_split_keeps_framework_options_apart():
    options, rest = AttachOptions.split({"interval": 3, "scheduler": None, "optimizer": 1})
    assert options.config.interval == 3 and rest == {"scheduler": None, "optimizer": 1}


def test_a_failed_recovery_closes_the_session_and_removes_every_hook(tmp_path):
    model, optimizer = _objects()
    adapter = PyTorchAdapter(model, optimizer)
    options = AttachOptions(interval=2, checkpoint=InMemoryCkptConfig(disk_folder=str(tmp_path), run_id="attach"),
                            enable_detection=False)
    seen = []

    def recover(session):
        seen.append(session)
        assert model._forward_pre_hooks and optimizer._optimizer_step_pre_hooks  # installed by the session
        raise RuntimeError("recovery failed")

    with pytest.raises(RuntimeError, match="^recovery failed$"):
        attach(adapter, options, recover=recover)
    assert not model._forward_pre_hooks and not optimizer._optimizer_step_pre_hooks
    assert not optimizer._optimizer_step_post_hooks
    assert seen[0].manager is not None and seen[0].manager.latest_step == -1
    seen[0].close()  # idempotent: already closed by attach


def test_attach_recovers_by_default(tmp_path):
    model, optimizer = _objects()
    options = AttachOptions(checkpoint=InMemoryCkptConfig(disk_folder=str(tmp_path), run_id="attach-fresh"),
                            enable_detection=False)
    session = attach(PyTorchAdapter(model, optimizer), options)
    try:
        assert session.recovered_from is None and session.step_count == 0
        assert session.config.run_id == "attach-fresh"
    finally:
        session.close()
