"""enable_resiliency in one process: exports, dispatch, argument errors, lifecycle, fallback."""

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import lm_resiliency
from lm_resiliency import InMemoryCkptConfig, RecoveryMode, ResiliencyHandle, enable_resiliency
from lm_resiliency.gemini.manager import RecoveryUnavailable


def _objects():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _config(tmp_path, **kw):
    return InMemoryCkptConfig(disk_folder=str(tmp_path), run_id="unit", **kw)


def _lm_threads():
    return [t for t in threading.enumerate() if t.name.startswith("lm-resiliency")]


def test_package_root_exports_exactly_the_stable_names_that_exist():
    from lm_resiliency.faults import STABLE_EXPORTS

    stable = {"enable_resiliency", "FrameworkName", "ResiliencySession", "ResiliencyHandle",
              "InMemoryCkptConfig", "ReplayHarnessConfig", "DurableCheckpointConfig",
              "CallbackDurableCheckpointAdapter", "SCOUTFaultReport", "SCOUTFaultCallback",
              "OrchestrationHooks", "replay_fault_reports", "RecoveryDecision", "RecoveryDecisionCallback",
              "RecoveryMode", "estimate_chunk_size",
              "ReplayWorkload", "GroupedExpertMaterializer", "LeadingDimensionMaterializer", "AllToAllReplayPolicy",
              "AllToAllCapture", "AllToAllTrafficMatrix", "BalancedAndPermutationPolicy",
              "ResiliencyError", "ConfigError", "RecoveryUnavailable", "RecoveredStateOverwrite", "IdentityMismatch", "BackgroundError",
              "NonFiniteState", "IntegrityError", "CertificationError", "StateEncodingError"} | set(STABLE_EXPORTS)
    assert sorted(lm_resiliency.__all__) == sorted(stable) and len(lm_resiliency.__all__) == len(stable)
    for name in lm_resiliency.__all__:
        assert getattr(lm_resiliency, name) is not None


def test_explicit_pytorch_entry_point_is_the_same_implementation(tmp_path):
    from lm_resiliency.integrations.pytorch import enable_resiliency as explicit

    model, optimizer = _objects()
    session = explicit(model, optimizer, checkpoint=_config(tmp_path))
    assert isinstance(session, lm_resiliency.ResiliencySession) and isinstance(session, ResiliencyHandle)
    session.close()


def test_wrong_first_argument_is_a_type_error():
    with pytest.raises(TypeError, match="cannot infer the framework from builtins.str"):
        enable_resiliency("model", None)


def test_unsupported_argument_is_a_type_error(tmp_path):
    model, optimizer = _objects()
    with pytest.raises(TypeError, match=r"does not accept \['opt_param_scheduler'\]"):
        enable_resiliency(model, optimizer, opt_param_scheduler=object(), checkpoint=_config(tmp_path))
    assert not _lm_threads()


@pytest.mark.parametrize("kwargs,error,message", [
    ({"interval": 0}, ValueError, r"^enable_resiliency\(interval=\.\.\.\): must be a positive int"),
    ({"interval": True}, ValueError, r"^enable_resiliency\(interval=\.\.\.\): must be a positive int"),
    ({"checkpoint": object()}, TypeError, r"^enable_resiliency\(checkpoint=\.\.\.\): expected an InMemoryCkptConfig"),
    ({"replay": object()}, TypeError, r"^enable_resiliency\(replay=\.\.\.\): expected a ReplayHarnessConfig"),
])
def test_wrong_cadence_or_config_objects_are_refused_before_anything_starts(kwargs, error, message):
    model, optimizer = _objects()
    with pytest.raises(error, match=message):
        enable_resiliency(model, optimizer, **kwargs)
    assert not _lm_threads()


def test_group_without_nccl_group_is_a_value_error(tmp_path):
    model, optimizer = _objects()
    with pytest.raises(ValueError, match="pass both group= and nccl_group="):
        enable_resiliency(model, optimizer, group=object(), checkpoint=_config(tmp_path))


def test_optimizer_missing_trainable_parameters(tmp_path):
    model, _ = _objects()
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"does not own these trainable parameters of the model: \['2.bias', "
                                         r"'2.weight'\]"):
        enable_resiliency(model, optimizer, checkpoint=_config(tmp_path))
    assert not _lm_threads()


def test_optimizer_owning_foreign_parameters(tmp_path):
    model, _ = _objects()
    stranger = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(list(model.parameters()) + list(stranger.parameters()), lr=0.1)
    with pytest.raises(ValueError, match="owns 2 parameter\\(s\\) that are not in the model"):
        enable_resiliency(model, optimizer, checkpoint=_config(tmp_path))


def test_extra_state_with_model_key_is_refused(tmp_path):
    model, optimizer = _objects()
    session = enable_resiliency(model, optimizer, interval=1, checkpoint=_config(tmp_path),
                                extra_state_fn=lambda: {"model": {}})
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match=r"extra_state_fn returned \['model'\]"):
        model(torch.ones(1, 4))
    session.close()


def test_close_twice_leaves_nothing_behind(tmp_path):
    model, optimizer = _objects()
    session = enable_resiliency(model, optimizer, interval=1, checkpoint=_config(tmp_path))
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert _lm_threads()
    session.close()
    session.close()
    assert not _lm_threads()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert not model._forward_pre_hooks


def test_load_fallback_runs_exactly_when_no_gemini_state(tmp_path):
    calls = []

    def fallback():
        calls.append(1)
        return 3

    model, optimizer = _objects()
    session = enable_resiliency(model, optimizer, interval=1, checkpoint=_config(tmp_path, disk_flush_interval=1),
                                load_fallback=fallback)
    assert calls == [1] and session.step_count == 3
    for _ in range(2):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    assert session.flush_for_restart() == 5
    session.close()
    model, optimizer = _objects()
    session = enable_resiliency(model, optimizer, interval=1, checkpoint=_config(tmp_path), load_fallback=fallback)
    assert calls == [1] and session.step_count == 5 and session.recovered_from == "gemini"
    session.close()


def test_recovery_verified_without_certified_state_fails_closed(tmp_path):
    model, optimizer = _objects()
    with pytest.raises(RecoveryUnavailable, match="recovery needs a RECOVERY_VERIFIED checkpoint"):
        enable_resiliency(model, optimizer, checkpoint=_config(tmp_path),
                          recovery_mode=RecoveryMode.RECOVERY_VERIFIED, load_fallback=lambda: 0)
    assert not _lm_threads()


def test_prepare_recovery_reports_decision_to_orchestration(tmp_path):
    seen = []

    class Hooks:
        report_recovery = staticmethod(seen.append)

    model, optimizer = _objects()
    session = enable_resiliency(model, optimizer, interval=1, checkpoint=_config(tmp_path), orchestration=Hooks())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    model(torch.ones(1, 4))
    session.manager.maybe_wait()
    assert session.prepare_recovery("straggler", all_ranks_accessible=True) is RecoveryMode.LATEST
    straggler = session.last_recovery_decision
    assert (straggler.mode, straggler.step, straggler.source) == ("latest", 1, "memory")
    assert session.prepare_recovery("hang", all_ranks_accessible=True) is RecoveryMode.RECOVERY_VERIFIED
    hang = session.last_recovery_decision
    assert hang.mode == "recovery_verified" and "no replay evidence" in hang.reason
    assert seen == [straggler, hang]
    assert straggler.to_json()["mode"] == "latest"
    session.close()


def test_copy_checkpoint_to_copies_flushed_shards(tmp_path):
    model, optimizer = _objects()
    session = enable_resiliency(model, optimizer, interval=1, checkpoint=_config(tmp_path / "ckpt"))
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert session.flush_for_restart() == 1
    session.set_restart_destination(lambda: str(tmp_path / "mirror"))
    copied = session.copy_checkpoint_to()
    assert sorted(p.rsplit("/", 1)[1] for p in copied) == ["own-000000000001.gemini", "status.json"]
    session.close()


def test_interpreter_exit_without_close_is_clean(tmp_path):
    script = textwrap.dedent(f"""
        import atexit, threading, torch
        # Registered first, so it runs last: after the session's own exit handler.
        atexit.register(lambda: print("threads at exit:", sorted(t.name for t in threading.enumerate()
                                                                  if t.name.startswith("lm-resiliency"))))
        from lm_resiliency import InMemoryCkptConfig, enable_resiliency
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        session = enable_resiliency(model, optimizer, interval=1,
                                    checkpoint=InMemoryCkptConfig(disk_folder={str(tmp_path)!r}, run_id="exit"))
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        model(torch.ones(1, 4))
        assert threading.active_count() > 1
        print("done")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["done", "threads at exit: []"]


def test_capture_is_not_torn_by_buffers_changed_in_the_next_forward(tmp_path):
    """BatchNorm statistics change inside the forward that runs while the capture copies."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = enable_resiliency(model, optimizer, interval=2, enable_detection=False,
                                checkpoint=_config(tmp_path, disk_flush_interval=1))
    expected = None
    for step in range(1, 4):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:
            expected = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(8, 4))
    session.close()
    manager_state = enable_resiliency(*_objects_bn(), interval=2, enable_detection=False,
                                      checkpoint=_config(tmp_path))
    recovered = manager_state.adapter.module.state_dict()
    assert manager_state.step_count == 2
    for name, value in expected.items():
        assert torch.equal(recovered[name], value), name
    manager_state.close()


def _objects_bn():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_capture_interval_without_a_check_at_its_steps_is_refused(tmp_path):
    from lm_resiliency import ReplayHarnessConfig

    model, optimizer = _objects()
    with pytest.raises(ValueError, match=r"InMemoryCkptConfig.interval=10 is not a multiple of any SCOUT check"):
        enable_resiliency(model, optimizer, checkpoint=_config(tmp_path, interval=10),
                          replay=ReplayHarnessConfig(check_interval=20))
    assert not _lm_threads()


def test_checkpoint_io_marks_framework_checkpoints_with_scout_on(tmp_path):
    model, optimizer = _objects()
    session = enable_resiliency(model, optimizer, checkpoint=_config(tmp_path))
    with session.checkpoint_io("write"):
        pass
    with pytest.raises(ValueError, match="expected 'read' or 'write'"):
        with session.checkpoint_io("delete"):
            pass
    session.close()


def test_a_file_given_as_disk_folder_is_named_as_such(tmp_path):
    (tmp_path / "gemini").write_text("not a folder")
    model, optimizer = _objects()
    with pytest.raises(NotADirectoryError) as refused:
        enable_resiliency(model, optimizer, checkpoint=_config(tmp_path / "gemini"), enable_detection=False)
    assert "InMemoryCkptConfig.disk_folder must be a directory" in str(refused.value)
    assert str(tmp_path / "gemini") in str(refused.value)
