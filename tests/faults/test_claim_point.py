"""An occurrence is claimed when its fault is about to be performed, not when it is armed: a worker
that stops between the two leaves it to its successor, and workers of one rank racing at the
hooked call inject it exactly once."""

import torch

from lm_resiliency.faults import (CallbackFaultExecutor, CampaignJournal, InjectionStatus, JsonCampaignStateStore,
                                  MemoryCampaignStateStore, enable_fault_injection)
from tests.harness import run_ranks

from .test_session import capture, corrupted_calls, reference_outputs
from .workloads import (batches, child_env_step, make_model, race_for_occurrences, sdc_campaign,
                        stop_at_a_step_boundary, train)


def test_worker_stopped_after_arming_leaves_the_occurrence_to_its_successor(tmp_path):
    store = JsonCampaignStateStore(str(tmp_path / "state.json"))
    journal = CampaignJournal(str(tmp_path / "journal.jsonl"))
    shared = {"campaign": sdc_campaign(0, at=3), "state_store": store, "journal": journal}
    data = batches(5)
    model, optimizer = make_model()
    first = enable_fault_injection(model, optimizer, generation="0", **shared)
    train(model, optimizer, data[:2])  # step 2's boundary arms sdc@3; then the job is preempted
    assert first.active_occurrences == ("sdc@3",) and store.claims() == {}
    first.close()
    [released] = journal.records()
    assert (released.occurrence_id, released.status, released.iteration) == ("sdc@3", InjectionStatus.ARMED, 3)
    assert store.claims() == {}

    # The replacement resumes after step 2 and meets the hooked call of iteration 3 itself.
    model, optimizer = make_model()
    train(model, optimizer, data[:2])
    second = enable_fault_injection(model, optimizer, generation="1", start_iteration=2, **shared)
    seen = capture(model)
    train(model, optimizer, data[2:])
    ref, _ = reference_outputs(5)
    assert corrupted_calls(seen, ref[2:])[0] == 0 and torch.equal(seen[0], -ref[2])
    assert [(r.status, r.generation, r.iteration) for r in journal.records()] == [
        (InjectionStatus.ARMED, "0", 3), (InjectionStatus.INJECTED, "1", 3)]
    [owner] = store.claims().values()
    assert owner["generation"] == "1" and owner["iteration"] == 3

    report = second.evaluate()
    [evaluation] = report.evaluations
    assert report.injected == 1 and evaluation.injected and evaluation.truth_ranks == (0,)
    assert evaluation.injected_iteration == 3


def test_worker_process_preempted_at_a_step_boundary_then_a_new_process_injects(tmp_path):
    state, journal = str(tmp_path / "state.json"), str(tmp_path / "journal.jsonl")
    [first] = run_ranks(stop_at_a_step_boundary, 1, state, journal, 2, init=False, timeout=120)
    assert first == {"active": ["sdc@3"], "records": []}  # exited with sdc@3 armed, never performed
    assert JsonCampaignStateStore(state).claims() == {}
    [second] = run_ranks(stop_at_a_step_boundary, 1, state, journal, 4, init=False, env=child_env_step(2),
                         timeout=120)
    [record] = CampaignJournal(journal).records()
    assert (record.occurrence_id, record.status, record.iteration) == ("sdc@3", InjectionStatus.INJECTED, 3)
    assert record.evidence["elements_changed"] > 0 and second["records"] == [record.to_json()]
    assert list(JsonCampaignStateStore(state).claims()) == ["sdc@3/rank-0"]


def test_claim_is_taken_right_before_the_fault_is_performed():
    store = MemoryCampaignStateStore()
    claims_seen = []

    def look_at_the_claims(request):
        claims_seen.append(store.claims())

    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=sdc_campaign(0, at=2), state_store=store,
                                    executor=CallbackFaultExecutor(look_at_the_claims))
    train(model, optimizer, batches(1))
    assert faults.active_occurrences == ("sdc@2",) and store.claims() == {}  # armed, not claimed
    train(model, optimizer, batches(1))
    assert [list(c) for c in claims_seen] == [["sdc@2/rank-0"]]
    assert claims_seen[0]["sdc@2/rank-0"]["iteration"] == 2


def test_in_process_recovery_rearms_an_occurrence_that_never_ran():
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=sdc_campaign(0, at=3))
    train(model, optimizer, batches(2))  # sdc@3 armed
    faults.set_iteration(1)  # recovered to step 1 before iteration 3 ran
    train(model, optimizer, batches(3)[1:])
    assert [(r.status, r.iteration) for r in faults.records] == [
        (InjectionStatus.ARMED, 3), (InjectionStatus.INJECTED, 3)]


def test_two_processes_racing_at_the_hooked_call_inject_each_occurrence_once(tmp_path):
    rounds = 30
    state, journal = str(tmp_path / "state.json"), str(tmp_path / "journal.jsonl")
    results = run_ranks(race_for_occurrences, 2, state, journal, rounds, timeout=180)
    iterations = [set(r["flipped"]) for r in results]
    assert not iterations[0] & iterations[1] and iterations[0] | iterations[1] == set(range(1, rounds + 1))
    for r in results:  # what each session journaled as injected is what it really did
        assert r["injected"] == [f"race@{k}" for k in r["flipped"]]
    by_occurrence = {}
    for record in CampaignJournal(journal).records():
        by_occurrence.setdefault(record.occurrence_id, []).append((record.status, record.iteration))
    assert sorted(by_occurrence) == sorted(f"race@{k}" for k in range(1, rounds + 1))
    for occurrence, statuses in by_occurrence.items():
        k = int(occurrence.split("@")[1])
        assert sorted(statuses) == sorted([(InjectionStatus.INJECTED, k), (InjectionStatus.ALREADY_CLAIMED, k)])
    claims = JsonCampaignStateStore(state).claims()
    winner = {k: r["generation"] for r in results for k in r["flipped"]}
    assert {key: owner["generation"] for key, owner in claims.items()} == {
        f"race@{k}/rank-0": generation for k, generation in winner.items()}
