"""`make demo` as a test: the demo's full campaign on 4 real CPU ranks (about a minute).

Runs examples/resiliency_demo.py (its built-in campaign: hidden SDC, compute straggler, hang,
corrupted node-local shard, killed rank) and checks its report: SDC localized with precision and
recall 1.0, every injected failure localized on the right rank, the restarts recovered from the
right steps (RECOVERY_VERIFIED after the SDC), occurrences not re-injected after a restart, and
a final state bitwise equal to the uninterrupted baseline.
"""

import importlib
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "resiliency_demo.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1"))
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return done, report, out


def test_demo_exits_ok_and_prints_the_table(demo):
    done, report, _ = demo
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    assert "bitwise equal to the baseline: yes" in done.stdout
    for incident in ("hidden-sdc", "slow-rank", "hung-rank", "bad-shard", "killed-rank"):
        assert incident in done.stdout
    assert "SDC incidents: precision=1.00 recall=1.00" in done.stdout
    assert report is not None and report["ok"] is True


def test_sdc_precision_and_recall_are_one_and_final_state_is_bitwise_equal(demo):
    _, report, _ = demo
    sdc = report["sdc_evaluation"]
    assert sdc["injected"] == 1 and sdc["precision"] == 1.0 and sdc["recall"] == 1.0
    assert sdc["false_positive_rate"] == 0.0
    final = report["final_state"]
    assert final["bitwise_equal"] is True
    assert sorted(final["ranks"]) == ["0", "1", "2", "3"]
    assert all(info["values"] > 0 and not info["differing"] for info in final["ranks"].values())


def test_every_failure_is_localized_on_the_injected_rank(demo):
    _, report, _ = demo
    rows = {row["incident"]: row for row in report["incidents"]}
    assert sorted(rows) == ["bad-shard", "hidden-sdc", "hung-rank", "killed-rank", "slow-rank"]
    for row in rows.values():
        assert row["injected"], row
        assert set(row["truth_ranks"]) <= set(row["localized_ranks"]), row
    for name in ("hidden-sdc", "killed-rank", "bad-shard"):   # deterministic detectors: exact
        assert rows[name]["localized_exactly"], rows[name]
    assert rows["hidden-sdc"]["truth_ranks"] == [1] and rows["hidden-sdc"]["detected_by"] == "scout:sdc"
    assert rows["hidden-sdc"]["detected_iteration"] == 10
    assert rows["slow-rank"]["detected_by"] == "scout:compute_straggler"
    assert rows["hung-rank"]["detected_by"] == "scout:hang"
    assert rows["killed-rank"]["detected_by"] == "supervisor:process_termination"
    assert rows["bad-shard"]["detected_by"] == "gemini:checkpoint_rejected"


def test_recovery_steps_and_generations(demo):
    _, report, _ = demo
    gens = report["managed"]["generations"]
    assert [g["end"] for g in gens] == ["sdc_stop", "hang", "rank_died", "finished"]
    # After SDC at step 10 the restart loads the newest RECOVERY_VERIFIED step, 8.
    assert [g["resumed_step"] for g in gens] == [0, 8, 16, 20]
    rows = {row["incident"]: row for row in report["incidents"]}
    assert rows["hidden-sdc"]["recovery_step"] == 8 and "RECOVERY_VERIFIED" in rows["hidden-sdc"]["recovery"]
    assert rows["hidden-sdc"]["work_lost_steps"] == 2
    assert rows["slow-rank"]["work_lost_steps"] == 0
    assert rows["hung-rank"]["recovery_step"] == 16
    assert rows["killed-rank"]["recovery_step"] == 20
    # The corrupted shard was rejected and rank 1's state came from the replica rank 3 holds.
    assert rows["bad-shard"]["recovery_step"] == 20 and "rank 3's replica" in rows["bad-shard"]["recovery"]
    sources = gens[3]["sources"]
    assert "own:1" not in sources["1"] and sources["3"].get("held:1") == "disk"


def test_occurrences_are_not_reinjected_after_a_restart(demo):
    _, report, _ = demo
    journal = report["journal"]
    injected = {}
    for record in journal:
        if record["status"] == "injected":
            injected.setdefault(record["occurrence_id"], set()).add(record["generation"])
    assert injected == {"hidden-sdc@9": {"0"}, "slow-rank@12": {"1"}, "hung-rank@18": {"1"},
                        "bad-shard@23": {"2"}, "killed-rank@23": {"2"}}
    replayed = {(r["occurrence_id"], r["generation"]) for r in journal if r["status"] == "already_claimed"}
    assert ("hidden-sdc@9", "1") in replayed and ("killed-rank@23", "3") in replayed


def test_timeline_picture_is_drawn_when_matplotlib_is_installed(demo):
    _, report, out = demo
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        assert report["timeline_png"] is None
        pytest.skip("matplotlib is not installed (the `demo` extra); the demo skips its picture")
    png = out / "timeline.png"
    assert report["timeline_png"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
