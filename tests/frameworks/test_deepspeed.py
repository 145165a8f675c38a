"""DeepSpeed engine hooks on real DeepSpeed engines: 2 ranks over gloo, ZeRO stages 0-3.

Ranks are forked from one process that imported DeepSpeed once (`DeepSpeedZygote`); the first
start in a fresh environment also compiles DeepSpeed's CPU comm op into TORCH_EXTENSIONS_DIR
(inside the virtual environment by default), which takes minutes once and is not counted in the
per-test timeouts (`func_only=True`).
"""

import importlib.util
import signal

import pytest

# Checked without importing: DeepSpeed is imported only in the zygote and its ranks, never in the
# pytest process (its import is slow and leaves state behind for other tests).
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed", allow_module_level=True)

from tests.distributed.gemini_workloads import assert_same

pytestmark = pytest.mark.timeout(90, func_only=True)

STEPS, KILL_AFTER, INTERVAL = 9, 7, 2


@pytest.fixture
def zygote(deepspeed_zygote):
    return deepspeed_zygote


VARIANTS = {  # id: (stage, precision, CPU offload, managed gradient accumulation, client optimizer+scheduler)
    "zero1": (1, "fp32", False, True, False), "zero2": (2, "fp32", False, True, False),
    "zero3": (3, "fp32", False, True, False), "zero0": (0, "fp32", False, True, False),
    "zero1-bf16": (1, "bf16", False, True, False), "zero2-bf16": (2, "bf16", False, True, False),
    "zero3-bf16": (3, "bf16", False, True, False),
    "zero2-offload": (2, "fp32", True, True, False), "zero3-offload": (3, "fp32", True, True, False),
    "zero2-unmanaged-accumulation": (2, "fp32", False, False, False),
    "zero3-client-optimizer": (3, "fp32", False, True, True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_killed_run_resumes_bitwise_equal(zygote, tmp_path, name):
    stage, *variant = VARIANTS[name]
    baseline = zygote.run("train", 2, stage, None, STEPS, None, *variant)  # plain DeepSpeed, no lm-resiliency
    folder = str(tmp_path / "gemini")
    outcomes = zygote.run("train", 2, stage, folder, STEPS, KILL_AFTER, *variant, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGKILL] * 2, [o.error for o in outcomes]
    resumed = zygote.run("train", 2, stage, folder, STEPS, None, *variant)
    for rank in range(2):
        start, trace, state = resumed[rank]
        # Steps 1..7 ran; interval 2 -> the last capture is step 6, flushed before the kill.
        assert start == 6
        # step_count follows engine.global_steps: one per optimizer step, never per micro-batch.
        assert trace == [(7, 7), (8, 8), (9, 9)]
        micro_steps = STEPS * 2 if variant[2] else STEPS  # engine.step() calls
        assert state["engine"] == [STEPS, STEPS * 16, 0, micro_steps]
        assert_same(state, baseline[rank][2])
    if stage == 3:
        # Partitioned: each rank holds a different slice of the weights.
        assert not all(a.equal(b) for a, b in zip(resumed[0][2]["partitions"].values(),
                                                  resumed[1][2]["partitions"].values()))


@pytest.mark.parametrize("stage", [1, 3])
def test_skipped_step_counts_but_is_not_captured(zygote, tmp_path, stage):
    for trace in zygote.run("skipped_step", 2, stage, str(tmp_path / "gemini")):
        # (step_count, global_steps, skipped_steps, was_step_applied, newest capture) per optimizer step;
        # step 4 overflowed: counted, not applied, not captured; the next capture is step 6.
        assert trace == [(1, 1, 0, True, -1), (2, 2, 0, True, 2), (3, 3, 0, True, 2), (4, 4, 1, False, 2),
                         (5, 5, 1, True, 2), (6, 6, 1, True, 6)]


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_without_optimizer_is_refused(zygote, stage):
    for message in zygote.run("no_optimizer", 2, stage):
        assert "has no optimizer" in message and "\"optimizer\"" in message


def test_misuse_is_refused_before_attaching(zygote):
    for errors in zygote.run("misuse", 2):
        assert "DeepSpeed owns its optimizer" in errors["optimizer"]
        assert "does not accept ['scheduler']" in errors["option"]
        assert '"lm_resiliency".checkpoint' in errors["section"] and "bogus" in errors["section"]


def test_load_checkpoint_seeds_generation_zero_and_is_refused_after_recovery(zygote, tmp_path):
    folder, durable = str(tmp_path / "gemini"), str(tmp_path / "durable")
    assert zygote.run("load_guard", 2, folder, durable, "durable") == [{"global_steps": 3}] * 2
    for out in zygote.run("load_guard", 2, folder, durable, "seed"):
        assert out["recovered_from"] is None and out["start"] == 0
        assert out["loaded"] and out["seeded"] == 3  # seeded from engine.global_steps
        assert out["after"] == 4 and out["global_steps"] == 4
        assert "already ran 1 optimizer step(s)" in out["late_error"]
        assert out["unwrapped"]
    for out in zygote.run("load_guard", 2, folder, durable, "recovered"):
        assert out["recovered_from"] == "gemini" and out["start"] == 4
        assert "restored this engine from GEMINI step 4" in out["error"]
        assert out["global_steps"] == 4  # the refused load changed nothing
        assert out["closed_by_destroy"] and out["unwrapped"]
    # The durable load as load_fallback= (called by enable_resiliency only when GEMINI has nothing).
    for out in zygote.run("load_guard", 2, str(tmp_path / "fresh"), durable, "fallback"):
        assert out["recovered_from"] == "fallback" and out["start"] == 3 and out["global_steps"] == 3


@pytest.mark.parametrize("stage", [2, 3])
def test_state_of_another_model_is_refused(zygote, tmp_path, stage):
    for message in zygote.run("mismatch", 2, stage, str(tmp_path / "gemini")):
        assert "recovered layers.0.weight" in message and "live engine has" in message


def test_config_section_configures_enable_resiliency(zygote, tmp_path):
    folder = str(tmp_path / "gemini")
    for out in zygote.run("config_section", 2, folder):
        assert out == {"interval": 3, "disk_folder": folder, "scout": False, "latest": 3, "step_count": 4}


def _engine_with(section):
    from types import SimpleNamespace

    return SimpleNamespace(_config=SimpleNamespace(_param_dict={"lm_resiliency": section}))


@pytest.mark.parametrize("section,field", [
    ({"interval": 0}, '"lm_resiliency": interval'), ({"interval": True}, '"lm_resiliency": interval'),
    ({"recovery_mode": "newest"}, '"lm_resiliency": recovery_mode'),
    ({"enable_detection": "no"}, '"lm_resiliency": enable_detection'),
    ({"checkpoint": {"interval": -1}}, "InMemoryCkptConfig.interval"), ({"replay": []}, '"lm_resiliency": replay'),
    ({"intervall": 3}, "unknown key(s) ['intervall']"), ([], '"lm_resiliency": the document is not a JSON object'),
    ({"checkpoint": {"disk_folder": "ckpt"}}, '"lm_resiliency".checkpoint.disk_folder: must be an absolute path'),
])
def test_config_section_errors_name_the_field(section, field):
    from lm_resiliency.adapters.deepspeed import read_config_section
    from lm_resiliency.config import ConfigError

    with pytest.raises(ConfigError) as error:
        read_config_section(_engine_with(section))
    assert field in str(error.value)


def test_config_section_fills_only_unset_arguments():
    from lm_resiliency import InMemoryCkptConfig, RecoveryMode
    from lm_resiliency.adapters.deepspeed import apply_config_section

    engine = _engine_with({"interval": 5, "checkpoint": {"disk_folder": "/x"}, "enable_detection": False,
                           "recovery_mode": "recovery_verified"})
    explicit = InMemoryCkptConfig(disk_folder="/explicit")
    merged = apply_config_section(engine, dict(interval=None, checkpoint=explicit, replay=None, enable_checkpoint=True,
                                               enable_detection=True, recovery_mode=None))
    assert merged["interval"] == 5 and merged["checkpoint"] is explicit and merged["replay"] is None
    assert merged["enable_checkpoint"] is True and merged["enable_detection"] is False
    assert merged["recovery_mode"] is RecoveryMode.RECOVERY_VERIFIED
