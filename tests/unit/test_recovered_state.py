"""The recovered-state guard in one process (enable_resiliency, PyTorch adapter): after GEMINI
recovered step N, the script's own `load_state_dict` on the model or optimizer is refused with the
message; it is not refused before the attach, inside load_fallback, after the first optimizer step,
on a copy of the model, or when nothing was recovered."""

from __future__ import annotations

import copy

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, RecoveredStateOverwrite, enable_resiliency


def _objects():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _attach(tmp_path, model, optimizer, **kwargs):
    config = InMemoryCkptConfig(disk_folder=str(tmp_path / "disk"), shared_memory_dir=str(tmp_path / "shm"),
                                run_id="guard", disk_flush_interval=2)
    return enable_resiliency(model, optimizer, interval=2, checkpoint=config, enable_detection=False, **kwargs)


def _train(model, optimizer, steps):
    for _ in range(steps):
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _first_run(tmp_path):
    model, optimizer = _objects()
    session = _attach(tmp_path, model, optimizer)
    _train(model, optimizer, 4)
    session.close()
    return model.state_dict(), optimizer.state_dict()


def test_the_scripts_own_load_after_a_gemini_recovery_is_refused_with_what_to_do(tmp_path):
    saved_model, saved_optimizer = _first_run(tmp_path)
    model, optimizer = _objects()
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    session = _attach(tmp_path, model, optimizer)
    assert (session.recovered_from, session.step_count) == ("gemini", 4)
    recovered = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RecoveredStateOverwrite) as refused:
        model.load_state_dict(snapshot)
    message = str(refused.value)
    assert message.startswith("lm-resiliency: Sequential.load_state_dict() refused: this launch resumed run "
                              "'guard' at GEMINI step 4 (from disk)")
    assert "Start the loop at step 4 (resiliency.step_count" in message and "load_fallback=" in message
    with pytest.raises(RecoveredStateOverwrite, match=r"Linear.load_state_dict\(\) refused"):
        model[0].load_state_dict({k[2:]: v for k, v in snapshot.items() if k.startswith("0.")})
    with pytest.raises(RecoveredStateOverwrite, match=r"AdamW.load_state_dict\(\) refused"):
        optimizer.load_state_dict(saved_optimizer)
    # Nothing was overwritten: the refusal comes before any tensor is copied.
    assert all(torch.equal(model.state_dict()[k], recovered[k]) for k in recovered)
    # A copy of the model (an EMA, say) is the script's own object: its loads are not refused.
    ema = copy.deepcopy(model)
    ema.load_state_dict(snapshot)
    # After the first optimizer step the loop owns the state again.
    _train(model, optimizer, 1)
    model.load_state_dict(saved_model)
    session.close()


def test_loads_before_the_attach_in_load_fallback_and_in_a_fresh_start_are_not_refused(tmp_path):
    model, optimizer = _objects()
    model.load_state_dict(model.state_dict())  # before the attach: pretrained weights, say
    fallback_calls = []

    def load_fallback():
        model.load_state_dict(model.state_dict())
        optimizer.load_state_dict(optimizer.state_dict())
        fallback_calls.append(True)
        return 0

    session = _attach(tmp_path, model, optimizer, load_fallback=load_fallback)
    assert session.recovered_from == "fallback" and fallback_calls == [True]
    model.load_state_dict(model.state_dict())  # nothing was recovered from GEMINI: the script's business
    session.close()


def test_a_second_recover_of_the_same_session_loads_again(tmp_path):
    _first_run(tmp_path)
    model, optimizer = _objects()
    session = _attach(tmp_path, model, optimizer)
    assert session.recover() == 4  # the session's own load is never refused
    with pytest.raises(RecoveredStateOverwrite):
        model.load_state_dict(model.state_dict())
    session.close()
    model.load_state_dict(model.state_dict())  # closed: nothing is guarded any more
