"""SCOUT certification on 4 real gloo ranks: checkpoint acceptance is job-wide.

Comparison groups {0, 1} and {2, 3} are topology-specific, but an SDC found by one group must
veto the capture and reject the candidate on every rank."""

import json
import os

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)

WORLD = 4
ENV = "dist-env"


def _ledger(rank, root, log_path=None):
    import torch.distributed as dist

    from lm_resiliency.gemini.storage import NodeLocalStore
    from lm_resiliency.trust import (
        CallbackDurableCheckpointAdapter, CertificationLedger, DurableCheckpointConfig)

    def record(*call):
        with open(log_path, "a") as f:
            f.write(json.dumps([rank, *call]) + "\n")

    def save(step):
        record("save", step)
        return f"job-ckpt-{step}"

    adapter = CallbackDurableCheckpointAdapter(
        save_candidate_fn=save, load_checkpoint_fn=lambda i, s: record("load", i, s),
        commit_candidate_fn=lambda i, s: record("commit", i, s),
        quarantine_candidate_fn=lambda i, s, r: record("quarantine", i, s, r))
    store = NodeLocalStore(os.path.join(root, "node-local"), "run", "topo", rank, verify_integrity=False)
    return CertificationLedger(2, store, group=dist.group.WORLD, durable=DurableCheckpointConfig(
        os.path.join(root, "manifests"), ENV, adapter))


def _sdc_in_one_group(rank, world, root):
    log_path = os.path.join(root, f"calls-{rank}.jsonl")
    ledger = _ledger(rank, root, log_path)
    decisions = []
    for step, cycle_end in ((10, False), (20, True), (30, False), (40, True)):
        decisions.append(ledger.boundary(step, "straggler" if rank == 1 else "clean", cycle_end).to_json())
    # Only group {2, 3} sees the corruption.
    decisions.append(ledger.boundary(50, "sdc" if rank in (2, 3) else "clean", False).to_json())
    calls = open(log_path).read().splitlines() if os.path.exists(log_path) else []
    return decisions, [json.loads(c) for c in calls], ledger.trust()


def _restart_and_load(rank, world, root):
    log_path = os.path.join(root, f"restart-{rank}.jsonl")
    ledger = _ledger(rank, root, log_path)
    before = (ledger.recovery_verified_step, ledger.candidate_step, ledger.sdc_detected_step,
              ledger.requires_verified_recovery)
    step = ledger.load_verified_durable()
    calls = [json.loads(c) for c in open(log_path).read().splitlines()]
    return before, step, calls, ledger.requires_verified_recovery


def test_sdc_in_one_group_rejects_everywhere(tmp_path):
    results = run_ranks(_sdc_in_one_group, WORLD, str(tmp_path), timeout=180)
    for rank, (decisions, calls, trust) in enumerate(results):
        cand1, _, cand2, sdc = decisions[1], decisions[2], decisions[3], decisions[4]
        assert cand1["state"] == "CANDIDATE" and cand1["candidate_step"] == 20, rank
        assert cand2["verified_step"] == 20 and cand2["candidate_step"] == 40, rank
        assert all(d["capture"] for d in decisions[:4]), rank
        assert not sdc["capture"], rank
        assert sdc["sdc_detected"] and sdc["requires_verified_recovery"], rank
        assert sdc["rejected_step"] == 40 and sdc["candidate_step"] is None, rank
        assert sdc["reporting_ranks"] == [2, 3] and sdc["verdict"] == "sdc", rank
        assert trust["recovery_verified_step"] == 20 and trust["sdc_detected_step"] == 50, rank
        assert trust["candidate_step"] is None, rank
        # Only rank 0 drives the framework callbacks, exactly once each.
        if rank == 0:
            assert [c[1:3] for c in calls] == [["save", 20], ["commit", "job-ckpt-20"], ["save", 40],
                                               ["quarantine", "job-ckpt-40"]]
        else:
            assert calls == []
    # Every rank took the same decisions.
    assert all(r[0] == results[0][0] for r in results)

    with open(tmp_path / "manifests" / "latest_verified.json") as f:
        assert json.load(f)["checkpoint_id"] == "job-ckpt-20"

    restarted = run_ranks(_restart_and_load, WORLD, str(tmp_path), timeout=180)
    for rank, (before, step, calls, pending) in enumerate(restarted):
        assert before == (20, None, 50, True), rank
        assert step == 20 and not pending, rank
        assert calls == [[rank, "load", "job-ckpt-20", 20]], rank


def _misaligned(rank, world, root):
    ledger = _ledger(rank, root, os.path.join(root, f"calls-{rank}.jsonl"))
    ledger.boundary(10 if rank != 3 else 20, "clean", False)


def test_misaligned_steps_fail_on_every_rank(tmp_path):
    outcomes = run_ranks(_misaligned, WORLD, str(tmp_path), timeout=120, check=False)
    for outcome in outcomes:
        assert outcome.error is not None and "different steps" in outcome.error, outcome


def _certify_then_reopen(rank, world, root):
    """Certify steps 10 and 20 on every rank, then reopen the ledgers twice: with rank 1's record
    gone (its host and disk lost: now a standby's rank), and with rank 2's record holding step 10
    only (a record that disagrees still vetoes)."""
    import shutil

    import torch.distributed as dist

    from lm_resiliency.gemini.storage import NodeLocalStore
    from lm_resiliency.trust import CertificationLedger

    folder = os.path.join(root, f"host-{rank}")

    def ledger():
        store = NodeLocalStore(folder, "run", "topo", rank, verify_integrity=False)
        return store, CertificationLedger(1, store, group=dist.group.WORLD)

    _, first = ledger()
    first.boundary(10, "clean", True)
    first.boundary(20, "clean", True)
    dist.barrier()
    saved = os.path.join(root, f"saved-{rank}")
    shutil.copytree(folder, saved)
    if rank == 1:
        shutil.rmtree(folder)
    dist.barrier()
    adopted = ledger()[1].verified_steps()
    dist.barrier()
    shutil.rmtree(folder)
    shutil.copytree(saved, folder)
    if rank == 2:
        store = NodeLocalStore(folder, "run", "topo", rank, verify_integrity=False)
        status = store.read_status()
        trust = status["trust"]
        trust["verified_history"] = [e for e in trust["verified_history"] if e["step"] == 10]
        trust["recovery_verified_step"] = 10
        store.write_status(status)
    dist.barrier()
    return adopted, ledger()[1].verified_steps()


def test_a_rank_without_a_trust_record_adopts_what_every_holder_agrees_on(tmp_path):
    """A standby's rank on a fresh host has no trust record: it must not wipe the job's
    RECOVERY_VERIFIED history (tests/lab/test_lab_hang.py needs it to resume); a rank whose record
    lacks a step still vetoes it."""
    results = run_ranks(_certify_then_reopen, 3, str(tmp_path))
    assert results == [([20, 10], [10])] * 3
