"""Capture checksums, the non-finite check, and what a single-process manager does with them."""

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.gemini.integrity import (CRC_KEY, CRC_CHUNK_BYTES, NonFiniteState, capture_checksums,
                                            checksum_problem, leaf_paths, nonfinite_indices)
from lm_resiliency.codec import encode_state
from lm_resiliency.trust import RECOVERY_VERIFIED, CertificationError, CertificationLedger


def test_checksum_names_the_corrupt_chunk_and_refuses_unchecked_bytes():
    payload = torch.randint(0, 256, (2 * CRC_CHUNK_BYTES + 5,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(0))
    extra = {CRC_KEY: capture_checksums(payload)}
    assert len(extra[CRC_KEY]["crc32"]) == 3 and checksum_problem(extra, payload) is None
    payload[CRC_CHUNK_BYTES + 7] ^= 0x10
    assert "chunk 1" in checksum_problem(extra, payload)
    assert "no capture checksum" in checksum_problem({}, payload)
    assert "covers" in checksum_problem(extra, payload[:-1])


def test_nonfinite_indices_cover_every_floating_dtype_and_ignore_integers():
    tensors = [torch.zeros(3), torch.tensor([1.0, float("nan")], dtype=torch.bfloat16),
               torch.tensor([float("-inf")], dtype=torch.float16),
               torch.tensor([1e308, 1e308], dtype=torch.float64), torch.tensor([3e38, 3e38]),
               torch.tensor([2**62], dtype=torch.int64), torch.tensor([complex(0, float("inf"))]),
               torch.empty(0)]
    assert nonfinite_indices(tensors) == [1, 2, 6]  # the sums of 3 and 4 overflow, every value is finite


def test_leaf_paths_name_the_state_keys():
    encoded = encode_state({"model": {"w": torch.zeros(1), "b": torch.zeros(1)}, "opt": [torch.zeros(1)]})
    assert leaf_paths(encoded.structure, [1, 2]) == ["state['model']['b']", "state['opt'][0]"]


def _manager(tmp_path, **kw):
    config = InMemoryCkptConfig(disk_folder=str(tmp_path / "disk"), host_memory="heap", run_id="nan",
                                disk_flush_interval=0, timeout_s=10, **kw)
    return InMemoryCheckpointManager(config, install_signal_handlers=False)


def test_nonfinite_capture_is_not_published_and_is_raised_at_the_next_wait(tmp_path, caplog):
    manager = _manager(tmp_path)
    good = {"w": torch.ones(4), "steps": torch.tensor([3])}
    manager.save(good, 10)
    manager.maybe_wait()
    bad = {"w": torch.tensor([1.0, float("nan"), 2.0, 3.0]), "steps": torch.tensor([4])}
    manager.save(bad, 20)
    with pytest.raises(NonFiniteState, match=r"step 20 refused.*state\['w'\].*newest recoverable capture is step 10"):
        manager.maybe_wait()
    assert "state['w']" in caplog.text and "ERROR" in caplog.text
    assert manager.latest_step == 10
    assert manager.find_latest() == 10
    assert torch.equal(manager.load()["w"], good["w"])
    manager.close()


def test_check_finite_false_captures_intended_infinities(tmp_path):
    manager = _manager(tmp_path, check_finite=False)
    manager.save({"mask": torch.tensor([0.0, float("-inf")])}, 1)
    manager.maybe_wait()
    assert manager.find_latest() == 1
    manager.close()


def test_flush_refuses_a_slot_whose_bytes_changed_after_capture(tmp_path):
    manager = _manager(tmp_path, verify_integrity=True)
    manager.save({"w": torch.ones(64)}, 1)
    manager.maybe_wait()
    manager.save({"w": torch.full((64,), 2.0)}, 2)
    manager.maybe_wait()
    newest = manager._own.ready_slots()[0]
    newest.buffer[5] ^= 0x01  # a bit flips in host RAM after the capture
    assert manager.flush_now() == 1  # step 2 is refused, the intact step 1 is written instead
    assert [k.step for k in manager.store.list_shards()] == [1]
    assert manager.latest_step == 1  # the corrupt slot is never offered again
    manager.close()


def test_nonfinite_state_is_never_certified(tmp_path):
    class Store:
        status = None

        def write_status(self, status):
            self.status = status

        def read_status(self):
            return self.status

    ledger = CertificationLedger(1, Store())
    assert ledger.boundary(2, "clean", True).state == RECOVERY_VERIFIED
    decision = ledger.boundary(4, "clean", True, finite=False)
    assert (decision.capture, decision.state, decision.nonfinite_ranks) == (False, None, (0,))
    assert "non-finite" in decision.reason and ledger.verified_steps() == [2]
    with pytest.raises(CertificationError, match="finite must be True or False"):
        ledger.boundary(6, "clean", True, finite=None)


def _session(tmp_path, model, optimizer):
    """enable_resiliency with GEMINI alone, capturing every 2 steps into heap slots."""
    from lm_resiliency import enable_resiliency

    config = InMemoryCkptConfig(disk_folder=str(tmp_path), run_id="session-nan", host_memory="heap",
                                disk_flush_interval=0, timeout_s=10)
    return enable_resiliency(model, optimizer, interval=2, enable_detection=False, checkpoint=config)


def test_session_refuses_nonfinite_parameters_but_not_an_intended_infinite_buffer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    model.register_buffer("mask", torch.tensor([0.0, float("-inf")]))  # intended: never refused
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = _session(tmp_path, model, optimizer)
    error = None
    try:
        for step in range(1, 5):
            x = torch.randn(2, 4)
            if step == 3:
                x[0, 0] = float("nan")
            try:
                model(x).sum().backward()
                optimizer.step()
            except NonFiniteState as exc:
                error = (step, str(exc))
                break
            optimizer.zero_grad()
        assert error is not None and error[0] == 4 and "weight" in error[1] and "ranks [0]" in error[1]
        assert session.manager.latest_step == 2  # step 2 (with the -inf buffer) is the newest capture
    finally:
        session.close()


def test_float8_nan_is_found_not_an_unimplemented_kernel():
    e4m3 = torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn)
    e5m2 = torch.tensor([1.0, float("inf")]).to(torch.float8_e5m2)
    assert nonfinite_indices([e4m3, torch.zeros(2, dtype=torch.float8_e5m2), e5m2]) == [0, 2]


def test_encoding_names_nonfinite_values_outside_tensors():
    np = pytest.importorskip("numpy")
    encoded = encode_state({"a": float("nan"), "b": [1.0, float("-inf")], "c": np.array([0.5, np.nan]),
                            "d": np.float32("inf"), "e": np.array([np.inf], dtype=np.float16), "fine": 1.5,
                            "ints": np.arange(3), "mask": torch.tensor([float("-inf")]), float("nan"): 1})
    assert set(encoded.nonfinite) == {"state['a']", "state['b'][1]", "state['c']", "state['d']", "state['e']",
                                      "state[nan]"}
    assert encode_state({"x": 1.0, "y": np.zeros(2)}).nonfinite == ()


@pytest.mark.parametrize("value, path", [
    (float("nan"), "state['opt']['param_groups'][0]['lr']"),
    (float("inf"), "state['opt']['param_groups'][0]['lr']"),
    ("numpy-nan-array", "state['opt']['param_groups'][0]['lr']"),
    ("numpy-inf-scalar", "state['opt']['param_groups'][0]['lr']"),
    ("float8-nan", "state['opt']['param_groups'][0]['lr']"),
], ids=["float-nan", "float-inf", "numpy-array", "numpy-scalar", "float8"])
def test_nonfinite_values_outside_float32_tensors_are_refused_like_tensors(tmp_path, value, path):
    np = pytest.importorskip("numpy")
    value = {"numpy-nan-array": np.array([0.1, np.nan]), "numpy-inf-scalar": np.float64("inf"),
             "float8-nan": torch.tensor([float("nan")]).to(torch.float8_e4m3fn)}.get(value, value)
    manager = _manager(tmp_path)
    good = {"w": torch.ones(4), "opt": {"param_groups": [{"lr": 0.1}]}}
    manager.save(good, 10)
    manager.maybe_wait()
    manager.save({"w": torch.ones(4), "opt": {"param_groups": [{"lr": value}]}}, 20)
    with pytest.raises(NonFiniteState, match=r"step 20 refused.*" + path.replace("[", r"\[").replace("]", r"\]")):
        manager.maybe_wait()
    assert manager.latest_step == 10 and manager.find_latest() == 10
    assert manager.load()["opt"]["param_groups"][0]["lr"] == 0.1
    manager.close()


def test_check_finite_false_captures_intended_nonfinite_values(tmp_path):
    manager = _manager(tmp_path, check_finite=False)
    manager.save({"best_score": float("inf")}, 1)
    manager.maybe_wait()
    assert manager.find_latest() == 1 and manager.load() == {"best_score": float("inf")}
    manager.close()


@pytest.mark.parametrize("where", ["lr", "betas", "state-value"])
def test_session_refuses_a_nan_learning_rate_and_other_optimizer_values(tmp_path, where):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    model.frozen_now = torch.nn.Parameter(torch.zeros(2))  # gets no gradient: a NaN lr leaves it alone
    optimizer = torch.optim.Adam([{"params": [model.weight, model.bias]}, {"params": [model.frozen_now]}], lr=0.1)
    session = _session(tmp_path, model, optimizer)
    error = None
    try:
        for step in range(1, 5):
            model(torch.randn(2, 4)).sum().backward()
            if step == 4:  # the parameters stay finite: only the optimizer's own values are not
                if where == "lr":
                    optimizer.param_groups[1]["lr"] = float("nan")
                elif where == "betas":
                    optimizer.param_groups[1]["betas"] = (0.9, float("inf"))
                else:
                    optimizer.state[model.weight]["custom"] = float("nan")
            try:
                optimizer.step()
            except NonFiniteState as exc:
                error = (step, str(exc))
                break
            optimizer.zero_grad()
        assert error is not None and error[0] == 4, error
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
        expected = {"lr": "optimizer.param_groups[1]['lr']", "betas": "optimizer.param_groups[1]['betas'][1]",
                    "state-value": "optimizer.state[0]['custom']"}[where]
        assert expected in error[1] and "ranks [0]" in error[1]
        assert session.manager.latest_step == 2  # the NaN learning rate is never captured
    finally:
        session.close()
