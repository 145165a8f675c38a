"""ResiliencyCallback with the real Lightning Trainer on real gloo processes.

Kill-and-resume tests SIGKILL every rank right after optimizer step 7 (GEMINI interval 2, so
step 6 is the newest capture), start the same program again, and compare its final model,
optimizer, scheduler, RNG and the data it trained on with an uninterrupted run of the same
program without lm-resiliency (run in the same processes after the resumed fit).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("lightning")

from tests.distributed.gemini_workloads import assert_same
from tests.harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lightning_env():
    """MASTER_ADDR/PORT for Lightning's env:// rendezvous (the harness sets RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK, so Lightning sees a TorchElastic-style launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _kill_then_resume(fn, world, folder, *args, timeout=80, after=()):
    killed = run_ranks(fn, world, folder, *args, "kill", *after, timeout=timeout, init=False,
                       env=_lightning_env(), check=False)
    assert [o.killed_by for o in killed] == [signal.SIGKILL] * world, [o.error for o in killed]
    return run_ranks(fn, world, folder, *args, "resume", *after, timeout=timeout, init=False,
                     env=_lightning_env())


def _check_resumed_like_uninterrupted(results):
    for rank, (resumed, baseline) in enumerate(results):
        assert resumed["recovered"] == 6, f"rank {rank} resumed from {resumed['recovered']}"
        assert baseline["recovered"] is None
        # The data position: the resumed run trains on exactly the batches the uninterrupted one
        # trained on after step 6 (mid-epoch, plain DataLoader + DistributedSampler).
        tail = [seen for seen in baseline["seen"] if seen[0] >= 6]
        assert resumed["seen"] == tail, f"rank {rank}: resumed batches differ from the uninterrupted run"
        assert resumed["state"]["global_step"] == baseline["state"]["global_step"] == 10
        assert_same(resumed["state"], baseline["state"], f"rank {rank}")


@pytest.mark.timeout(180)
def test_ddp_sigkill_resumes_bitwise_equal_to_uninterrupted(tmp_path):
    from tests.frameworks.lightning_workloads import kill_then_resume_and_baseline

    results = _kill_then_resume(kill_then_resume_and_baseline, 2, str(tmp_path), 10, 1)
    _check_resumed_like_uninterrupted(results)
    # 8 batches per rank per epoch: step 6 is mid-epoch 0, the resumed run finishes epoch 0 and
    # stops in epoch 1 at max_steps (which Lightning counts as epoch 1 completed).
    assert results[0][0]["state"]["epoch"] == results[0][1]["state"]["epoch"] == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("accumulate", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_ddp_four_ranks_forward_order_model_sigkill_resumes_bitwise_equal(tmp_path, accumulate):
    """4 ranks (3+ show DDP's bucket layout in the last bits), layers registered in forward order over
    three buckets: the layout lm-resiliency pins at on_fit_start makes the resumed run exact (with
    LMR_TEST_DDP_PIN=0 it is not)."""
    from tests.frameworks.lightning_workloads import kill_then_resume_and_baseline

    results = _kill_then_resume(kill_then_resume_and_baseline, 4, str(tmp_path), 10, accumulate,
                                timeout=200, after=(False, True))
    _check_resumed_like_uninterrupted(results)


@pytest.mark.timeout(180)
def test_ddp_gradient_accumulation_sigkill_resumes_bitwise_equal(tmp_path):
    from tests.frameworks.lightning_workloads import kill_then_resume_and_baseline

    results = _kill_then_resume(kill_then_resume_and_baseline, 2, str(tmp_path), 10, 2)
    _check_resumed_like_uninterrupted(results)
    # Two micro-batches per step: the resumed run saw 2 batches for each of steps 7..10.
    assert [s[0] for s in results[0][0]["seen"]] == [6, 6, 7, 7, 8, 8, 9, 9]


@pytest.mark.timeout(180)
def test_ddp_manual_optimization_sigkill_resumes_bitwise_equal(tmp_path):
    from tests.frameworks.lightning_workloads import kill_then_resume_and_baseline

    results = _kill_then_resume(kill_then_resume_and_baseline, 2, str(tmp_path), 10, 1, after=(True,))
    _check_resumed_like_uninterrupted(results)


@pytest.mark.timeout(120)
def test_accumulation_captures_only_at_optimizer_steps_and_metrics_reach_the_logger(tmp_path):
    from tests.frameworks.lightning_workloads import fit_observed

    results = run_ranks(fit_observed, 2, str(tmp_path), 6, 2, None, timeout=80, init=False, env=_lightning_env())
    for result in results:
        assert result["batches"] == 12 and result["global_step"] == 6
        assert result["captures"] == [2, 4, 6]  # 12 micro-batches, interval 2: three captures
        assert all(global_step == session_step for global_step, session_step in result["session_steps"])
        scout = [m for _, m in result["metrics"] if "lm_resiliency/scout_healthy" in m]
        assert len(scout) == 3 and all(m["lm_resiliency/scout_healthy"] == 1.0 for m in scout)
        captured = [m["lm_resiliency/gemini_captured_step"] for _, m in result["metrics"]
                    if "lm_resiliency/gemini_captured_step" in m]
        assert captured and captured == sorted(captured) and set(captured) <= {2.0, 4.0, 6.0}


@pytest.mark.timeout(120)
def test_scout_sdc_finding_reaches_the_lightning_logger(tmp_path):
    from tests.frameworks.lightning_workloads import fit_observed

    # Rank 2 of 3 silently corrupts a weight before step 2; SCOUT's replay outvotes it.
    results = run_ranks(fit_observed, 3, str(tmp_path), 4, 1, (2, 2), timeout=100, init=False,
                        env=_lightning_env())
    for result in results:
        first = next(m for step, m in result["metrics"] if "lm_resiliency/scout_sdc" in m)
        assert first["lm_resiliency/scout_sdc"] == 1.0 and first["lm_resiliency/scout_healthy"] == 0.0
        assert first["lm_resiliency/scout_sdc_rank_2"] == 1.0 and first["lm_resiliency/scout_suspect_ranks"] == 1.0
        assert result["captures"] == []  # SCOUT vetoes GEMINI captures of a corrupted state


@pytest.mark.timeout(240)
def test_model_parallel_dp2_tp2_sigkill_resumes_bitwise_equal(tmp_path):
    from tests.frameworks.lightning_workloads import fit_model_parallel

    results = _kill_then_resume(fit_model_parallel, 4, str(tmp_path), 10, timeout=110)
    coordinates = set()
    for rank, (resumed, baseline) in enumerate(results):
        assert resumed["recovered"] == 6
        topology = resumed["topology"]
        assert topology["kind"] == "fsdp2_tp" and topology["mesh_shape"] == [2, 2]
        assert topology["mesh_dim_names"] == ["data_parallel", "tensor_parallel"]
        coordinates.add(tuple(topology["coordinate"]))
        assert resumed["seen"] == [seen for seen in baseline["seen"] if seen[0] >= 6]
        assert_same(resumed["state"], baseline["state"], f"rank {rank}")
        # SCOUT replays the FSDP2+TP model among data-parallel peers of one TP coordinate; clean: no reports.
        assert resumed["peers"] == ((0, 2) if rank % 2 == 0 else (1, 3))
        assert [(step, healthy, reports) for step, healthy, reports in resumed["replay"]] == \
            [(8, True, []), (10, True, [])]
    assert coordinates == {(0, 0), (0, 1), (1, 0), (1, 1)}


@pytest.mark.timeout(120)
def test_single_process_with_validation_and_checkpoint_callbacks_resumes_exactly(tmp_path):
    from tests.frameworks.lightning_workloads import fit_single_with_validation

    # Validation runs right after the captured step 6; ModelCheckpoint (top-2) and EarlyStopping
    # states travel in GEMINI, and Lightning does not repeat that validation on resume.
    results = _kill_then_resume(fit_single_with_validation, 1, str(tmp_path))
    resumed, baseline = results[0]
    assert resumed["recovered"] == 6
    assert resumed["seen"] == [seen for seen in baseline["seen"] if seen[0] >= 6]
    assert resumed["state"]["best_k"] == baseline["state"]["best_k"] and len(resumed["state"]["best_k"]) == 2
    assert_same(resumed["state"], baseline["state"])


def _tiny(base):
    """A minimal single-process LightningModule on `base` (lightning.pytorch's or pytorch_lightning's)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(base):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=4)

    return Tiny()


def test_pytorch_lightning_alias(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from lm_resiliency import InMemoryCkptConfig
    from lm_resiliency.callbacks.lightning import ResiliencyCallback

    callback = ResiliencyCallback(interval=2, run_id="pl-alias", checkpoint=InMemoryCkptConfig(
        disk_folder=str(tmp_path / "g"), host_memory="heap"))
    assert isinstance(callback, pl.Callback)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                         default_root_dir=str(tmp_path))
    trainer.fit(_tiny(pl.LightningModule))
    assert callback.topology.kind == "single" and callback.captured_step == 2


def test_explicit_entry_point_adds_the_callback_and_resumes(tmp_path):
    """lm_resiliency.integrations.lightning.enable_resiliency(trainer, ...): the same ResiliencyCallback,
    placed before ModelCheckpoint as Trainer(callbacks=[...]) would; a second fit of the run resumes from
    the step-4 capture its first fit flushed to disk."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lm_resiliency import InMemoryCkptConfig
    from lm_resiliency.callbacks.lightning import ResiliencyCallback
    from lm_resiliency.integrations.lightning import enable_resiliency

    config = InMemoryCkptConfig(disk_folder=str(tmp_path / "g"), disk_flush_interval=2,
                                shared_memory_dir=str(tmp_path / "shm"))
    recovered = []
    for max_steps in (4, 6):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                            callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))], enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=str(tmp_path))
        callback = enable_resiliency(trainer, interval=2, run_id="integration-entry", checkpoint=config,
                                     enable_detection=False)
        assert isinstance(callback, ResiliencyCallback)
        assert [type(cb).__name__ for cb in trainer.callbacks][-2:] == ["ResiliencyCallback", "ModelCheckpoint"]
        with pytest.raises(ValueError, match="already has a ResiliencyCallback"):
            enable_resiliency(trainer, interval=2)
        trainer.fit(_tiny(L.LightningModule))
        recovered.append(callback.recovered_step)
    assert recovered == [None, 4] and trainer.global_step == 6
    with pytest.raises(TypeError, match="expected a Lightning Trainer"):
        enable_resiliency(object())


# ------------------------------------------------------------------ zero-code opt-in

_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading
    import torch
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)
        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=4)

    root = sys.argv[1]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(Tiny())
    added = [cb for cb in trainer.callbacks if type(cb).__module__ == "lm_resiliency.callbacks.lightning"]
    print("RESULT " + json.dumps({
        "callbacks": [type(cb).__name__ for cb in added],
        "interval": added[0].config.interval if added else None,
        "captured_step": added[0].captured_step if added else None,
        "topology": dict(added[0].topology.descriptor) if added else None,
        "gemini_dir": os.path.isdir(os.environ.get("LM_RESILIENCY_DIR", "checkpoints")),
        "threads": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()),
    }))
""")


def _run_script(tmp_path, name, env_updates):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LM_RESILIENCY")}
    env.update(env_updates, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script), str(tmp_path / name)], capture_output=True, text=True,
                          timeout=80, env=env, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), done.stderr


@pytest.mark.timeout(120)
def test_entry_point_enables_without_code_change(tmp_path):
    # The script never imports lm_resiliency: Lightning's callbacks_factory entry point adds it.
    result, _ = _run_script(tmp_path, "on", {
        "LM_RESILIENCY": "1", "LM_RESILIENCY_INTERVAL": "2", "LM_RESILIENCY_RUN_ID": "entry-point-test",
        "LM_RESILIENCY_DIR": str(tmp_path / "gemini"), "LM_RESILIENCY_SHM_DIR": str(tmp_path / "shm")})
    assert result["callbacks"] == ["ResiliencyCallback"] and result["interval"] == 2 and result["gemini_dir"]
    assert result["captured_step"] == 2  # step 4's capture completes at teardown
    assert result["topology"]["kind"] == "single"
    assert not any(t.startswith("lm-resiliency") for t in result["threads"])  # closed at teardown


@pytest.mark.timeout(120)
def test_entry_point_is_inert_when_unset(tmp_path):
    result, stderr = _run_script(tmp_path, "off", {})
    assert result["callbacks"] == [] and not result["gemini_dir"]
    assert not any("lm-resiliency" in t or "GEMINI" in t or "SCOUT" in t for t in result["threads"])
    assert "lm-resiliency" not in stderr


@pytest.mark.timeout(120)
def test_entry_point_takes_a_policy_file(tmp_path):
    # LM_RESILIENCY=<policy file>: the same ResiliencyPolicy the Accelerate flag reads (parsing and its
    # errors: tests/unit/test_config.py); a policy file names absolute paths.
    policy = tmp_path / "policy.toml"
    policy.write_text(f'schema_version = 1\ninterval = 2\nenable_detection = false\n[checkpoint]\n'
                      f'disk_folder = "{tmp_path / "checkpoints"}"\nrun_id = "policy-file-test"\n'
                      f'shared_memory_dir = "{tmp_path / "shm"}"\n')
    result, _ = _run_script(tmp_path, "policy", {"LM_RESILIENCY": str(policy)})
    assert result["callbacks"] == ["ResiliencyCallback"] and result["interval"] == 2 and result["gemini_dir"]
    assert result["captured_step"] == 2


# ------------------------------------------------------------------ misuse


def test_unsupported_strategies_get_a_clear_error():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    from lm_resiliency.adapters.lightning import LightningStrategyError, check_strategy

    with pytest.raises(LightningStrategyError, match="FSDPStrategy.*use ModelParallelStrategy"):
        check_strategy(FSDPStrategy())
    assert check_strategy(DDPStrategy()) == "ddp"
    assert check_strategy(ModelParallelStrategy()) == "model_parallel"
    import torch

    assert check_strategy(SingleDeviceStrategy(torch.device("cpu"))) == "single"


def _tiny_trainer(tmp_path, callbacks):
    import lightning.pytorch as L

    return L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                     default_root_dir=str(tmp_path))


def _tiny_module(optimizers=1):
    import lightning.pytorch as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
            self.automatic_optimization = optimizers == 1

        def training_step(self, batch, batch_idx):
            loss = (self.a(batch[0]) + self.b(batch[0])).pow(2).mean()
            if not self.automatic_optimization:
                self.manual_backward(loss)
                for opt in self.optimizers():
                    opt.step()
                    opt.zero_grad()
            return loss

        def configure_optimizers(self):
            if optimizers == 1:
                return torch.optim.SGD(self.parameters(), lr=0.1)
            return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)]

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)

    return Tiny()


@pytest.mark.timeout(120)
def test_misuse_is_refused_with_clear_errors(tmp_path):
    from lm_resiliency import InMemoryCkptConfig
    from lm_resiliency.adapters.lightning import LightningStrategyError
    from lm_resiliency.callbacks.lightning import ResiliencyCallback

    def callback(**kw):
        return ResiliencyCallback(interval=1, checkpoint=InMemoryCkptConfig(
            disk_folder=str(tmp_path / "g"), host_memory="heap", run_id="misuse"), **kw)

    with pytest.raises(LightningStrategyError, match="exactly one torch optimizer.*found 2"):
        _tiny_trainer(tmp_path, [callback()]).fit(_tiny_module(optimizers=2))
    with pytest.raises(RuntimeError, match="2 ResiliencyCallback instances"):
        _tiny_trainer(tmp_path, [callback(), callback()]).fit(_tiny_module())
    with pytest.raises(TypeError, match="InMemoryCkptConfig"):
        ResiliencyCallback(checkpoint={"interval": 2})
    with pytest.raises(ValueError, match="interval"):
        ResiliencyCallback(interval=0)

    # An explicit callback wins over the one the LM_RESILIENCY entry point adds.
    explicit, from_env = callback(), callback()
    from_env.from_entry_point = True
    trainer = _tiny_trainer(tmp_path, [explicit, from_env])
    trainer.fit(_tiny_module())
    assert explicit.topology is not None and from_env.topology is None


# ------------------------------------------------------------------ metrics helpers


def test_replay_and_oob_metrics():
    from lm_resiliency.callbacks.lightning import oob_metrics, replay_metrics
    from lm_resiliency.scout.reports import CheckOutcome, ReplayResult, SCOUTFaultReport, StragglerFinding

    check = CheckOutcome("output", "body", (0, 1, 2), {0: "a", 1: "a", 2: "b"}, "sdc", faulty=(2,))
    slow = StragglerFinding("compute", (1,), ("h1",), 2.5, True, 0.9)
    metrics = replay_metrics(ReplayResult(4, (check,), (slow,)))
    assert metrics["scout_sdc"] == 1.0 and metrics["scout_sdc_rank_2"] == 1.0
    assert metrics["scout_stragglers"] == 1.0 and metrics["scout_compute_straggler_rank_1"] == 2.5
    reports = [SCOUTFaultReport("hang", "rank", (3,)), SCOUTFaultReport("hang", "rank", (1,))]
    assert oob_metrics(reports) == {"oob_faults": 2.0, "oob_hang": 2.0, "oob_hang_rank_3": 1.0,
                                    "oob_hang_rank_1": 1.0}


@pytest.mark.slow  # three 2-process Lightning launches: ~60 s idle, more on a loaded machine
@pytest.mark.timeout(300)
def test_example_self_test():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "lightning_ddp.py"), "--self-test"],
                          capture_output=True, text=True, timeout=290, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed from GEMINI step 6" in done.stdout and "bitwise equal" in done.stdout


@pytest.mark.timeout(240)
def test_boring_model_one_rank_killed_resumes_bitwise_equal(tmp_path):
    """LM_RESILIENCY=1 on Lightning's BoringModel, 3 DDP ranks, rank 1 SIGKILLed mid-epoch. The
    dataset is drawn from the global generator in train_dataloader(), after on_fit_start: the
    RNG streams must be restored only right before the first resumed batch (restored in
    on_fit_start, the relaunch trained on other data and ended up to 0.023 away)."""
    from tests.frameworks.lightning_workloads import fit_boring

    killed = run_ranks(fit_boring, 3, str(tmp_path), "kill", timeout=110, init=False, env=_lightning_env(),
                       check=False)
    assert killed[1].killed_by == signal.SIGKILL, [o.error for o in killed]
    results = run_ranks(fit_boring, 3, str(tmp_path), "resume", timeout=110, init=False, env=_lightning_env())
    for rank, (resumed, baseline) in enumerate(results):
        assert resumed["recovered"] == 6 and baseline["recovered"] is None, rank
        assert resumed["global_step"] == baseline["global_step"] == 10
        assert_same(resumed["model"], baseline["model"], f"rank {rank}")
