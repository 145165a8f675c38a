"""enable_resiliency with AMP (torch.amp.GradScaler on CPU) and torch.compile, in one process.

A forced overflow (an inf in the batch) makes `scaler.step()` skip `optimizer.step()`; a capture is
recovered by a fresh session over the node-local disk tier, into fresh objects, as after a restart.
"""

import logging

import pytest
import torch
from torch import nn

from lm_resiliency import InMemoryCkptConfig, enable_resiliency

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _batch(step, overflow_at=()):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    if step in overflow_at:
        x[0, 0] = float("inf")  # inf activations -> inf/NaN gradients -> scaler.step() skips
    return x


def _objects(compile_mode=None):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # growth_interval=3: the scale moves every few steps, so a lost scaler state shows.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    # "wrapper" / "in_place", optionally ":<backend>" (default "eager", which runs the same kernels).
    how, _, backend = (compile_mode or "").partition(":")
    if how == "wrapper":
        return model, torch.compile(model, backend=backend or "eager"), optimizer, scaler
    if how == "in_place":
        model.compile(backend=backend or "eager")
    return model, model, optimizer, scaler


def _config(folder, interval=2):
    return InMemoryCkptConfig(disk_folder=str(folder), run_id="amp-unit", disk_flush_interval=interval)


def _train(folder, steps, *, overflow_at=(), compile_mode=None, use_scaler=True, interval=2, counters=None):
    """The documented loop; returns (resumed step, final model/optimizer/scaler state)."""
    model, wrapped, optimizer, scaler = _objects(compile_mode)
    options = {"scaler": scaler} if use_scaler else {}
    session = enable_resiliency(wrapped, optimizer, interval=interval, checkpoint=_config(folder, interval),
                                **options)
    resumed = session.step_count
    for step in range(session.step_count, steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = wrapped(_batch(step, overflow_at)).float().pow(2).mean()
        scaler.scale(loss).backward() if use_scaler else loss.backward()
        if use_scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        if counters is not None:
            counters.append((step + 1, session.step_count))
    session.close()
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "optimizer": optimizer.state_dict()["state"], "scaler": scaler.state_dict()}
    return resumed, state


def _assert_bitwise(a, b):
    assert a["scaler"] == b["scaler"]
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for index, per_param in a["optimizer"].items():
        for key, value in per_param.items():
            assert torch.equal(value, b["optimizer"][index][key]), (index, key)


def test_skipped_step_counts_so_loop_counter_and_step_count_agree(tmp_path):
    counters = []
    _, state = _train(tmp_path / "a", 6, overflow_at=(2, 3), counters=counters)
    assert counters == [(s, s) for s in range(1, 7)]
    # Two skips: each halved the scale (backoff 0.5); the growth tracker restarted after them.
    assert state["scaler"]["scale"] == 2.0 ** 8 and state["scaler"]["_growth_tracker"] == 2


def test_scaler_state_recovered_bitwise_and_run_ends_as_uninterrupted(tmp_path):
    overflow = (1, 5)
    _, baseline = _train(tmp_path / "baseline", 8, overflow_at=overflow)
    _, at_four = _train(tmp_path / "four", 4, overflow_at=overflow)
    folder = tmp_path / "managed"
    _train(folder, 5, overflow_at=overflow)  # captures step 4; step 5 is lost with the "crash"
    # A fresh process would restore step 4: scale and growth tracker exactly as they were then.
    model, _, optimizer, scaler = _objects()
    session = enable_resiliency(model, optimizer, scaler=scaler, interval=2, checkpoint=_config(folder))
    assert (session.step_count, session.recovered_from) == (4, "gemini")
    assert scaler.state_dict() == at_four["scaler"]
    assert (at_four["scaler"]["scale"], at_four["scaler"]["_growth_tracker"]) == (2.0 ** 9, 2)  # not the initial state
    session.close()
    resumed, final = _train(folder, 8, overflow_at=overflow)
    assert resumed == 4
    _assert_bitwise(final, baseline)


def test_skipped_step_at_a_capture_boundary_is_not_captured(tmp_path):
    folder = tmp_path / "run"
    _train(folder, 5, overflow_at=(3,))  # step 4 (loop index 3) skipped: the newest capture is step 2
    resumed, final = _train(folder, 6, overflow_at=(3,))
    assert resumed == 2
    _, baseline = _train(tmp_path / "baseline", 6, overflow_at=(3,))
    _assert_bitwise(final, baseline)


def test_scaler_and_checkpoint_must_agree(tmp_path):
    _train(tmp_path / "amp", 2)
    model, _, optimizer, _ = _objects()
    with pytest.raises(ValueError, match="has GradScaler state but no scaler= was given"):
        enable_resiliency(model, optimizer, interval=2, checkpoint=_config(tmp_path / "amp"))
    _train(tmp_path / "fp32", 2, use_scaler=False)
    model, _, optimizer, scaler = _objects()
    with pytest.raises(ValueError, match="scaler= was given, but the recovered checkpoint has no GradScaler"):
        enable_resiliency(model, optimizer, scaler=scaler, interval=2, checkpoint=_config(tmp_path / "fp32"))
    model, _, optimizer, _ = _objects()
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(ValueError, match="from an enabled scaler, but scaler= is disabled"):
        enable_resiliency(model, optimizer, scaler=disabled, interval=2, checkpoint=_config(tmp_path / "amp"))
    with pytest.raises(TypeError, match="scaler= must be a torch.amp.GradScaler"):
        enable_resiliency(model, optimizer, scaler=object(), interval=2, checkpoint=_config(tmp_path / "x"))


def test_close_gives_the_scaler_its_own_step_back(tmp_path):
    model, _, optimizer, scaler = _objects()
    session = enable_resiliency(model, optimizer, scaler=scaler, checkpoint=_config(tmp_path))
    assert "step" in vars(scaler)
    session.close()
    assert "step" not in vars(scaler)


@pytest.mark.parametrize("compile_mode", [
    "wrapper", "in_place",
    # Inductor generates and builds C++ kernels: about a minute per compile on 2 busy cores.
    pytest.param("wrapper:inductor", marks=[pytest.mark.slow, pytest.mark.timeout(900)]),
])
def test_compiled_model_restores_bitwise_under_the_users_keys(tmp_path, compile_mode):
    _, baseline = _train(tmp_path / "baseline", 6, compile_mode=compile_mode, use_scaler=False)
    folder = tmp_path / "managed"
    _train(folder, 4, compile_mode=compile_mode, use_scaler=False)
    # The capture is keyed as the plain module's state_dict (no `_orig_mod.`): an uncompiled
    # process recovers it too.
    plain, _, optimizer, _ = _objects()
    session = enable_resiliency(plain, optimizer, interval=2, checkpoint=_config(folder))
    assert session.step_count == 4
    session.close()
    resumed, final = _train(folder, 6, compile_mode=compile_mode, use_scaler=False)
    assert resumed == 4
    _assert_bitwise(final, baseline)


def test_session_hooks_are_not_traced_by_torch_compile(tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _train(tmp_path, 4, compile_mode="in_place", use_scaler=False)
    # One compiled frame and graph: the model's forward. The session's forward hook runs inside
    # the compiled `_call_impl`; traced, it added 60+ frames of lm-resiliency code and graph breaks.
    assert counters["frames"]["total"] == 1 and counters["stats"]["unique_graphs"] == 1


def test_scout_replay_is_off_for_a_compiled_model_with_a_warning(tmp_path, caplog):
    _, wrapped, optimizer, _ = _objects("wrapper")
    with caplog.at_level(logging.WARNING, logger="lm_resiliency.scout.harness"):
        session = enable_resiliency(wrapped, optimizer, checkpoint=_config(tmp_path))
    assert session.scout is not None and session.scout.detector is None and session.ledger is None
    assert "SCOUT: replay checks disabled: torch.compile runs ['(root)']" in caplog.text
    session.close()
