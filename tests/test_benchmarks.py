"""The SCOUT benchmark runs end to end on a tiny model (its numbers are read in benchmarks/README.md,
never asserted here: timing depends on the machine)."""

import json

import pytest

from benchmarks import scout_bench


def test_replayed_share_is_the_sampled_modules_share_of_multiply_adds():
    # One dim -> 4 dim -> dim block is 8 dim^2 multiply-adds per token, the head dim x vocab:
    # (524288 + 1048576) / (24 * 524288 + 1048576) for the default model.
    assert scout_bench.replayed_share(4096, 256, 24) == pytest.approx(0.1154, abs=1e-4)
    assert scout_bench.replayed_share(4096, 256, 4) == pytest.approx(0.5)


def test_scout_benchmark_runs_checks_without_false_alarms(tmp_path):
    out = tmp_path / "scout.json"
    assert scout_bench.main(["--part", "dense", "--ranks", "3", "--blocks", "2", "--dim", "32", "--vocab", "64", "--seq", "8",
                             "--batch", "2", "--rounds", "1", "--steps", "20", "--no-interval-1",
                             "--out", str(out), "--timeout", "120"]) == 0
    result = json.loads(out.read_text())
    assert [row["config"] for row in result["rows"]] == ["baseline", "SCOUT interval 10"]
    scout = result["summaries"][1]
    assert scout["steps"] == 20 and scout["checks"] == 2
    assert result["unhealthy_replay_results"] == {"SCOUT interval 10": 0}
    assert result["oob_reports"] == {"SCOUT interval 10": 0}
    assert result["config"]["model"]["replayed_share_of_macs"] == pytest.approx(10240 / 18432)
    assert "moe" not in result


def test_scout_benchmark_moe_part_runs_expert_and_all_to_all_checks(tmp_path):
    # EP 2 x expert-DP 2 on 4 ranks; tokens per rank 2 x 8 over 2 local experts: recipes n_exec 4 and 8.
    out = tmp_path / "scout.json"
    assert scout_bench.main(["--part", "moe", "--ranks", "4", "--moe-dim", "16", "--moe-blocks", "2", "--vocab", "64",
                             "--seq", "8", "--batch", "2", "--rounds", "1", "--steps", "20", "--no-interval-1",
                             "--out", str(out), "--timeout", "200"]) == 0
    result = json.loads(out.read_text())["moe"]
    assert [row["config"] for row in result["rows"]] == ["baseline", "expert replay interval 10",
                                                         "expert + AllToAll interval 10"]
    assert result["config"]["recipes"] == [4, 8]
    for summary in result["summaries"][1:]:
        assert summary["steps"] == 20 and summary["checks"] == 2
        assert summary["per_check"]["rank_mean"]["replay_expert"] > 0
    assert result["summaries"][1]["per_check"]["rank_mean"]["all_to_all"] == 0
    assert result["summaries"][2]["per_check"]["rank_mean"]["all_to_all"] > 0
    assert [c["expert_group_ranks"] for c in result["per_config"][1:]] == [[0, 2], [0, 2]]
    assert result["unhealthy_replay_results"] == {"expert replay interval 10": 0, "expert + AllToAll interval 10": 0}
    assert result["oob_reports"] == {"expert replay interval 10": 0, "expert + AllToAll interval 10": 0}


def test_gemini_capture_costs_time_every_integrity_setting(tmp_path):
    from benchmarks import gemini_bench

    out = tmp_path / "capture_costs.json"
    assert gemini_bench.main(["--capture-costs", "--total-mib", "1", "--reps", "2", "--out", str(out),
                              "--tmp", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert sorted(result["settings"]) == [f"verify_integrity={v},check_finite={f}"
                                          for v in (False, True) for f in (False, True)]
    assert all(len(s["per_rep_capture_s"]) == 2 for s in result["settings"].values())
    # The one-pass costs side by side with the copy itself, and both CRC-32 implementations.
    assert all(result[key] > 0 for key in ("copy_s", "crc32_s", "crc32_zlib_s", "finite_check_s"))
    assert result["crc32_backend"] in ("isal", "zlib") and result["crc32_speedup_vs_zlib"] > 0
