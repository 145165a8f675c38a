"""Accelerate surface on real Accelerate (MULTI_CPU, 2 ranks over gloo): ResiliencyPlugin and the
LM_RESILIENCY flag. A killed run resumes at the last captured step and finishes bitwise equal to an
uninterrupted one, with gradient accumulation; misuse gets a clear error."""

import importlib.util
import os
import subprocess
import sys
import uuid

import pytest
import torch

pytest.importorskip("accelerate")

from tests.distributed.gemini_workloads import assert_same
from tests.frameworks.accelerate_workloads import run_script, train_with_plugin
from tests.harness import run_ranks

from lm_resiliency.callbacks.accelerate import ResiliencyPlugin

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOAD = os.path.join(ROOT, "tests", "frameworks", "accelerate_workloads.py")
pytestmark = pytest.mark.timeout(90)


def _run_id(tag):
    return f"acc-{tag}-{uuid.uuid4().hex[:8]}"


# 3 epochs x 5 micro-batches per rank, gradient_accumulation_steps=2 -> Accelerate syncs after
# micro-batches 2, 4 and 5 of each epoch: optimizer steps 1-3 are epoch 0, 4-6 epoch 1, 7-9 epoch 2.
# interval=2 -> captures at steps 2, 4, 6, 8.
@pytest.mark.parametrize("kill_after, resumed_at, batches_left, mode", [
    (5, 4, 8, "auto"),     # last capture mid-epoch 1 (2 of its 5 micro-batches consumed)
    (7, 6, 5, "auto"),     # last capture at the end of epoch 1
    (5, 4, 8, "continue"),  # the loop starts at resume_epoch; the loader continues the interrupted epoch
    (5, 4, 8, "manual"),   # the loop starts at resume_epoch and calls plugin.skip_first_batches
], ids=["mid-epoch", "epoch-end", "continue-loop", "manual-loop"])
def test_killed_run_resumes_bitwise_with_gradient_accumulation(tmp_path, kill_after, resumed_at, batches_left, mode):
    _kill_and_resume(tmp_path, kill_after, resumed_at, batches_left, mode, entry_point=False)


@pytest.mark.timeout(240)
def test_explicit_entry_point_resumes_bitwise(tmp_path):
    """lm_resiliency.integrations.accelerate.enable_resiliency(accelerator, ...) is the same plugin."""
    _kill_and_resume(tmp_path, 5, 4, 8, "auto", entry_point=True)


@pytest.mark.timeout(240)
def test_four_ranks_forward_order_model_resumes_bitwise(tmp_path):
    """MULTI_CPU on 4 ranks (3+ show DDP's bucket layout in the last bits), layers registered in
    forward order over three DDP buckets: the plugin finds Accelerate's DDP wrapper and pins its layout,
    so the resumed run is exact (with LMR_TEST_DDP_PIN=0 it is not)."""
    _kill_and_resume(tmp_path, 5, 4, 8, "auto", entry_point=False, world=4, forward=True)


def _kill_and_resume(tmp_path, kill_after, resumed_at, batches_left, mode, entry_point, world=2, forward=False):
    timeout = 60 * world // 2
    baseline = run_ranks(train_with_plugin, world, str(tmp_path / "baseline"), _run_id("base"), 3, 2, None, mode,
                         False, forward, timeout=timeout)
    for rank in range(world):
        # One capture per applied optimizer step that is due, never per micro-batch.
        assert baseline[rank]["captured"] == [2, 4, 6, 8]
        assert (baseline[rank]["resumed"], baseline[rank]["steps"], baseline[rank]["batches"]) == (0, 9, 15)
    folder, run_id = str(tmp_path / "managed"), _run_id("kill")
    killed = run_ranks(train_with_plugin, world, folder, run_id, 3, 2, kill_after, mode, entry_point, forward,
                       timeout=timeout, check=False)
    assert [o.killed_by for o in killed] == [9] * world, [o.error for o in killed]
    resumed = run_ranks(train_with_plugin, world, folder, run_id, 3, 2, None, mode, entry_point, forward,
                        timeout=timeout)
    for rank in range(world):
        assert resumed[rank]["resumed"] == resumed_at
        assert resumed[rank]["batches"] == batches_left  # the data position resumed, not the epoch start
        assert resumed[rank]["captured"] == [s for s in (2, 4, 6, 8) if s > resumed_at]
        assert resumed[rank]["steps"] == 9
        assert_same(resumed[rank]["state"], baseline[rank]["state"])


DEEPSPEED = "tests.frameworks.accelerate_workloads:train_deepspeed"


# Accelerate's DeepSpeed integration (Accelerator(deepspeed_plugin=...)): the same loop and cadence as
# above (9 optimizer steps, captures at 2, 4, 6, 8), killed after step 5 -> resumed at 4, mid-epoch 1.
@pytest.mark.timeout(240, func_only=True)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_integration_killed_run_resumes_bitwise(deepspeed_zygote, tmp_path, stage):
    if importlib.util.find_spec("transformers") is None:  # Accelerate's DeepSpeedPlugin imports it
        pytest.skip("Accelerate's DeepSpeed integration needs transformers (the test extra installs it)")
    baseline = deepspeed_zygote.run(DEEPSPEED, 2, stage, None, None, timeout=80)
    folder, run_id = str(tmp_path / "gemini"), _run_id(f"ds{stage}")
    killed = deepspeed_zygote.run(DEEPSPEED, 2, stage, folder, run_id, 5, timeout=80, check=False)
    assert [o.killed_by for o in killed] == [9, 9], [o.error for o in killed]
    resumed = deepspeed_zygote.run(DEEPSPEED, 2, stage, folder, run_id, timeout=80)
    for rank in range(2):
        out = resumed[rank]
        assert (out["resumed"], out["captured"], out["batches"]) == (4, [6, 8], 8)
        # The DeepSpeed engine's step() drove every capture: its hooks counted the 5 optimizer steps of
        # this run, the prepared optimizer is Accelerate's no-op wrapper, and no torch optimizer hook exists.
        assert out["driven_by"] == {"adapter": "AccelerateDeepSpeedAdapter", "hooks": "DeepSpeedEngineHooks",
                                    "engine_steps": 5, "step_count": 9, "global_steps": 9,
                                    "wrapper": "DeepSpeedOptimizerWrapper", "torch_optimizer_hooks": 0}
        assert baseline[rank]["batches"] == 15
        assert_same(out["state"], baseline[rank]["state"])
    if stage == 3:  # partitioned: each rank restored its own slice of the weights
        assert not all(a.equal(b) for a, b in zip(resumed[0]["state"]["partitions"].values(),
                                                  resumed[1]["state"]["partitions"].values()))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("deepspeed", [None, "2"], ids=["multi-cpu", "deepspeed-zero2"])
def test_plugin_example_self_test(deepspeed):
    """examples/accelerate_plugin.py under torchrun: killed after step 5, resumed after step 4, and every
    repeated step prints exactly the loss of the crashed run; also under Accelerate's DeepSpeed integration."""
    extra = []
    if deepspeed is not None:
        if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("transformers") is None:
            pytest.skip("needs deepspeed and transformers")
        extra = ["--deepspeed", deepspeed]
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "accelerate_plugin.py"), "--self-test",
                           *extra], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "OK: resumed at the last captured step" in done.stdout


def _load(path):
    return torch.load(path, weights_only=False)


def test_flag_enables_unchanged_script_and_is_inert_when_unset(tmp_path):
    """The workload's __main__ is plain Accelerate (no lm-resiliency). Run through the bootstrap
    (`python -m lm_resiliency.callbacks.accelerate script.py`) exactly as a launcher would."""
    knobs = {"LM_RESILIENCY_INTERVAL": "2", "LM_RESILIENCY_DIR": str(tmp_path / "ckpt"),
             "LM_RESILIENCY_DISK_FLUSH_INTERVAL": "2", "LM_RESILIENCY_RUN_ID": _run_id("flag"),
             "LM_RESILIENCY_SHM_DIR": str(tmp_path / "shm")}  # private: no other run reaps the crashed slots
    # Off: every other knob set, the flag 0 -> nothing patched, imported or written.
    run_ranks(run_script, 2, ["--out", str(tmp_path / "off")], env={**knobs, "LM_RESILIENCY": "0"}, timeout=60)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "shm").exists()
    off = [_load(tmp_path / "off" / f"rank{r}.pt") for r in range(2)]
    for state in off:
        assert state["patched_prepare"] is False and state["lm_resiliency_imported"] is False
        assert state["batches"] == 15
    # On: the same script crashes after optimizer step 5, is started again and resumes from step 4.
    env = {**knobs, "LM_RESILIENCY": "1"}
    crashed = run_ranks(run_script, 2, ["--out", str(tmp_path / "crashed"), "--crash-after-steps", "5"], env=env,
                        timeout=60, check=False)
    assert [o.killed_by for o in crashed] == [9, 9], [o.error for o in crashed]
    assert (tmp_path / "ckpt").is_dir()
    run_ranks(run_script, 2, ["--out", str(tmp_path / "on")], env=env, timeout=60)
    for rank in range(2):
        on = _load(tmp_path / "on" / f"rank{rank}.pt")
        assert on["patched_prepare"] is True and on["lm_resiliency_imported"] is True
        assert on["batches"] == 8  # the unchanged loop skipped what ran before the crash
        strip = ("batches", "patched_prepare", "lm_resiliency_imported")
        assert_same({k: v for k, v in on.items() if k not in strip},
                    {k: v for k, v in off[rank].items() if k not in strip})


@pytest.mark.timeout(240)
def test_flag_four_ranks_forward_order_model_resumes_bitwise(tmp_path):
    """The flag pins DDP's bucket layout when prepare() returns (a first model forward that attaches
    would be too late): on 4 ranks a crashed run resumes exactly like an uninterrupted flag run."""
    env = {"LM_RESILIENCY": "1", "LM_RESILIENCY_INTERVAL": "2", "LM_RESILIENCY_DIR": str(tmp_path / "ckpt"),
           "LM_RESILIENCY_DISK_FLUSH_INTERVAL": "2", "LM_RESILIENCY_RUN_ID": _run_id("flag4"),
           "LM_RESILIENCY_SHM_DIR": str(tmp_path / "shm"), "LM_RESILIENCY_DETECTION": "0"}
    base_env = dict(env, LM_RESILIENCY_DIR=str(tmp_path / "base"), LM_RESILIENCY_RUN_ID=_run_id("flag4-base"))
    run_ranks(run_script, 4, ["--out", str(tmp_path / "uninterrupted"), "--forward"], env=base_env, timeout=120)
    crashed = run_ranks(run_script, 4, ["--out", str(tmp_path / "crashed"), "--forward", "--crash-after-steps", "5"],
                        env=env, timeout=120, check=False)
    assert [o.killed_by for o in crashed] == [9] * 4, [o.error for o in crashed]
    run_ranks(run_script, 4, ["--out", str(tmp_path / "resumed"), "--forward"], env=env, timeout=120)
    for rank in range(4):
        resumed, uninterrupted = (_load(tmp_path / run / f"rank{rank}.pt") for run in ("resumed", "uninterrupted"))
        assert (resumed["batches"], uninterrupted["batches"]) == (8, 15)
        assert_same({k: v for k, v in resumed.items() if k != "batches"},
                    {k: v for k, v in uninterrupted.items() if k != "batches"}, f"rank {rank}")


@pytest.mark.timeout(240)
def test_flag_under_torchrun_launcher(tmp_path):
    """The real command line: torchrun ... -m lm_resiliency.callbacks.accelerate script.py. A first
    launch trains one epoch; a second launch of the same command with --epochs 2 resumes from the
    flushed capture. Results are read from files, never from exit codes (see CPU-FRAMEWORKS.md)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", LM_RESILIENCY="1", LM_RESILIENCY_INTERVAL="1",
               LM_RESILIENCY_DISK_FLUSH_INTERVAL="1", LM_RESILIENCY_DIR=str(tmp_path / "ckpt"),
               LM_RESILIENCY_DETECTION="0", LM_RESILIENCY_RUN_ID=_run_id("torchrun"),
               LM_RESILIENCY_SHM_DIR=str(tmp_path / "shm"),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "lm_resiliency.callbacks.accelerate", WORKLOAD]
    for epochs, out in ((1, "first"), (2, "second")):
        done = subprocess.run(command + ["--out", str(tmp_path / out), "--epochs", str(epochs)], env=env,
                              capture_output=True, text=True, timeout=90)
        results = [tmp_path / out / f"rank{r}.pt" for r in range(2)]
        assert all(p.exists() for p in results), done.stdout[-3000:] + done.stderr[-3000:]
    for rank in range(2):
        first, second = _load(tmp_path / "first" / f"rank{rank}.pt"), _load(tmp_path / "second" / f"rank{rank}.pt")
        assert first["patched_prepare"] and (first["batches"], second["batches"]) == (5, 5)
        assert first["scheduler"]["last_epoch"] == 3 * 2  # 3 steps, AcceleratedScheduler steps x num_processes
        assert second["scheduler"]["last_epoch"] == 6 * 2  # resumed at step 3, not from scratch


@pytest.mark.timeout(240)
def test_flag_under_accelerate_launch(tmp_path):
    """`accelerate launch -m lm_resiliency.callbacks.accelerate script.py` (one CPU process,
    DistributedType NO): the second launch resumes from the first one's flushed capture."""
    accelerate_cli = os.path.join(os.path.dirname(sys.executable), "accelerate")
    if not os.path.exists(accelerate_cli):
        pytest.skip("the accelerate CLI is not installed next to this interpreter")
    env = dict(os.environ, OMP_NUM_THREADS="1", LM_RESILIENCY="1", LM_RESILIENCY_INTERVAL="1",
               LM_RESILIENCY_DISK_FLUSH_INTERVAL="1", LM_RESILIENCY_DIR=str(tmp_path / "ckpt"),
               LM_RESILIENCY_DETECTION="0", LM_RESILIENCY_RUN_ID=_run_id("launch"),
               LM_RESILIENCY_SHM_DIR=str(tmp_path / "shm"),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    command = [accelerate_cli, "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no",
               "-m", "lm_resiliency.callbacks.accelerate", WORKLOAD]
    for epochs, out in ((1, "first"), (2, "second")):
        done = subprocess.run(command + ["--out", str(tmp_path / out), "--epochs", str(epochs)], env=env,
                              capture_output=True, text=True, timeout=90)
        assert (tmp_path / out / "rank0.pt").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    first, second = _load(tmp_path / "first" / "rank0.pt"), _load(tmp_path / "second" / "rank0.pt")
    # One process: 10 micro-batches per epoch, 5 optimizer steps.
    assert first["patched_prepare"] and (first["batches"], second["batches"]) == (10, 10)
    assert (first["scheduler"]["last_epoch"], second["scheduler"]["last_epoch"]) == (5, 10)


def _misuse(rank, world):
    import torch
    from accelerate import Accelerator

    from lm_resiliency.adapters.accelerate import AcceleratePreparationError
    from lm_resiliency.callbacks.accelerate import ResiliencyPlugin

    errors = {}
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        ResiliencyPlugin(interval=1).attach(accelerator)
    except AcceleratePreparationError as exc:
        errors["before_prepare"] = str(exc)
    model = accelerator.prepare(model)
    try:
        ResiliencyPlugin(interval=1).attach(accelerator)
    except AcceleratePreparationError as exc:
        errors["no_optimizer"] = str(exc)
    optimizer = accelerator.prepare(optimizer)
    plugin = ResiliencyPlugin(interval=1, enable_detection=False)
    try:
        plugin.step_count
    except RuntimeError as exc:
        errors["not_attached"] = str(exc)
    session = plugin.attach(accelerator)
    try:
        ResiliencyPlugin(interval=1).attach(accelerator)
    except RuntimeError as exc:
        errors["twice"] = str(exc)
    try:
        ResiliencyPlugin(interval=1).attach(model)
    except TypeError as exc:
        errors["not_an_accelerator"] = str(exc)
    session.close()
    return errors


def test_misuse_gets_clear_errors():
    errors = run_ranks(_misuse, 2, timeout=60)[0]
    assert "before accelerator.prepare()" in errors["before_prepare"]
    assert "prepared optimizer" in errors["no_optimizer"]
    assert "not attached" in errors["not_attached"]
    assert "already attached" in errors["twice"]
    assert "expected an accelerate.Accelerator" in errors["not_an_accelerator"]


def test_flag_reads_the_shared_policy_and_refuses_bad_values_before_the_script_runs(tmp_path):
    """The flag and Lightning's entry point read one ResiliencyPolicy (tests/unit/test_config.py);
    here: what the plugin gets from it, and the bootstrap's exit 2 on a bad value."""
    from lm_resiliency.callbacks.accelerate import flag_plugin_arguments, main
    from lm_resiliency.settings import ResiliencyPolicy

    policy = tmp_path / "policy.toml"
    policy.write_text('schema_version = 1\ninterval = 4\n[checkpoint]\nrun_id = "r"\n')
    arguments = flag_plugin_arguments(ResiliencyPolicy.from_environment(
        {"LM_RESILIENCY": str(policy), "LM_RESILIENCY_DIR": "/tmp/x", "LM_RESILIENCY_DETECTION": "0",
         "LM_RESILIENCY_DATALOADER_RESUME": "continue"}))
    plugin = ResiliencyPlugin(**arguments)
    assert plugin.checkpoint.interval == 4 and plugin.replay.check_interval == 4
    assert (plugin.checkpoint.disk_folder, plugin.checkpoint.run_id) == ("/tmp/x", "r")
    assert plugin.resume_dataloaders == "continue" and arguments["enable_detection"] is False
    assert flag_plugin_arguments(ResiliencyPolicy())["resume_dataloaders"] == "auto"
    for bad in ("maybe", str(tmp_path / "missing.toml")):
        old = os.environ.get("LM_RESILIENCY")
        os.environ["LM_RESILIENCY"] = bad
        try:
            with pytest.raises(SystemExit) as exit_info:
                main([WORKLOAD, "--out", "/nonexistent"])  # refused before the script runs
            assert exit_info.value.code == 2
        finally:
            if old is None:
                del os.environ["LM_RESILIENCY"]
            else:
                os.environ["LM_RESILIENCY"] = old
