"""Real processes: a 2-rank gloo job where only the target rank is corrupted, and a rank that
really dies by SIGKILL after journaling its ground truth."""

import signal

from lm_resiliency.faults import CampaignJournal, InjectionStatus, JsonCampaignStateStore
from tests.harness import run_ranks

from .workloads import child_env_step, gloo_corrupt_one_rank, kill_self_at_iteration


def test_two_rank_gloo_corrupts_only_the_target_rank(tmp_path):
    journal = str(tmp_path / "journal.jsonl")
    results = run_ranks(gloo_corrupt_one_rank, 2, journal, timeout=120)
    view = {r["rank"]: r for r in results[0]["all"]}
    assert view[0]["world"] == view[1]["world"] == 2
    assert view[0]["records"] == []
    assert view[0]["iteration3_equal"] and view[0]["params_equal"]
    [record] = view[1]["records"]
    assert (record["occurrence_id"], record["rank"], record["status"], record["iteration"]) == (
        "sdc@3", 1, "injected", 3)
    assert view[1]["iteration2_equal"] and view[1]["iteration3_negated"] and not view[1]["params_equal"]
    assert results[0]["journal"] == 1
    [only] = CampaignJournal(journal).records()
    assert only.world_size == 2 and only.rank == 1


def test_process_termination_kills_the_rank_and_the_successor_skips_it(tmp_path):
    journal, state = str(tmp_path / "journal.jsonl"), str(tmp_path / "state.json")
    [outcome] = run_ranks(kill_self_at_iteration, 1, journal, state, init=False, check=False, timeout=120)
    assert outcome.killed_by == signal.SIGKILL and outcome.result is None
    [record] = CampaignJournal(journal).records()
    assert (record.occurrence_id, record.status, record.iteration) == ("kill@3", InjectionStatus.INJECTED, 3)
    assert record.evidence["signal"] == "SIGKILL" and record.pid != 0
    # The replacement resumes after step 2, replays iteration 3 and is not killed again.
    [steps] = run_ranks(kill_self_at_iteration, 1, journal, state, init=False, env=child_env_step(2), timeout=120)
    assert steps == 6
    statuses = [r.status for r in CampaignJournal(journal).records()]
    assert statuses == [InjectionStatus.INJECTED, InjectionStatus.ALREADY_CLAIMED]
    assert list(JsonCampaignStateStore(state).claims()) == ["kill@3/rank-0"]
