"""prepare_recovery("hang"|"uncertain") runs SCOUT's full-catalog replay sweep on 4 real gloo ranks."""

import pytest

from tests.distributed.sweep_workloads import run, sharded
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

WORLD = 4


def _sweep(tmp_path, scenario, steps=4, fault_rank=2, timeout_s=60.0):
    return run_ranks(run, WORLD, str(tmp_path), steps, scenario, fault_rank, timeout_s, timeout=200)


def test_clean_sweep_selects_latest(tmp_path):
    for seen in _sweep(tmp_path, "clean"):
        for decision, failure in zip(seen["decisions"], ("hang", "uncertain")):
            assert (decision["failure"], decision["mode"], decision["source"]) == (failure, "latest", "memory")
            assert "full replay sweep completed clean" in decision["reason"]
            assert "every module agreed bitwise" in decision["reason"]
        assert [kind for kind, _ in seen["events"]] == ["recovery", "recovery"] and not seen["latched"]
        # Parameters, buffers, the live RNG and every module's eval mode are as before the sweep.
        assert seen["untouched"] and seen["training"] == [False]
        assert seen["leftover_calls"] == []   # the last peer of each finished call deleted its keys


def _assert_sdc_on(seen, rank, module):
    decision = seen["decisions"][0]
    assert decision["mode"] == "recovery_verified"
    assert f"SDC localized to ranks [{rank}]" in decision["reason"] and module in decision["reason"]
    # As for any replay fault: fault_callback, then the decision, then the fault reports.
    kinds = [kind for kind, _ in seen["events"]]
    assert kinds[:2] == ["callback", "recovery"] and set(kinds[2:]) == {"fault"} and len(kinds) > 2
    assert seen["events"][0][1] == [rank]
    assert all(report["kind"] == "sdc" and report["ranks"] == [rank] for _, report in seen["events"][2:])
    assert seen["latched"] and seen["persisted_latch"]


def test_sign_flip_in_one_hidden_layer_is_localized_to_that_rank(tmp_path):
    for seen in _sweep(tmp_path, "sign_flip", fault_rank=2):
        _assert_sdc_on(seen, 2, "hidden layers.1")
        reports = [report for _, report in seen["events"][2:]]
        # The flipped layer and everything downstream disagree; its parameters and upstream agree.
        assert sorted(r["resource"] for r in reports) == ["hidden:layers.1", "hidden:layers.2", "output:head"]


def test_corrupted_parameter_is_localized_to_that_rank(tmp_path):
    for seen in _sweep(tmp_path, "parameter", fault_rank=1):
        _assert_sdc_on(seen, 1, "parameters layers.0")
        resources = {report["resource"] for _, report in seen["events"][2:]}
        assert "parameters:layers.0" in resources and "parameters:layers.1" not in resources


def test_rank_that_never_calls_makes_the_sweep_incomplete(tmp_path):
    results = _sweep(tmp_path, "absent", fault_rank=3, timeout_s=3.0)
    assert results[3]["decisions"] == []
    for seen in results[:3]:
        decision = seen["decisions"][0]
        assert decision["mode"] == "recovery_verified"
        assert "the full replay sweep did not complete" in decision["reason"]
        assert "ranks [3] did not join the sweep" in decision["reason"]
        assert [kind for kind, _ in seen["events"]] == ["recovery"] and not seen["latched"]
        assert seen["leftover_calls"] == [0]   # unfinished: kept for the rank that skipped it


def test_replay_that_raises_on_one_rank_makes_the_sweep_incomplete(tmp_path):
    for seen in _sweep(tmp_path, "raises", fault_rank=0):
        decision = seen["decisions"][0]
        assert decision["mode"] == "recovery_verified"
        assert "the replay raised on rank 0: RuntimeError: device lost" in decision["reason"]
        assert [kind for kind, _ in seen["events"]] == ["recovery"] and not seen["latched"]


def test_no_recorded_check_step_means_no_evidence(tmp_path):
    # Checks run at steps 2, 4, ...: after one step nothing has been recorded anywhere.
    for seen in _sweep(tmp_path, "clean", steps=1):
        for decision in seen["decisions"]:
            assert decision["mode"] == "recovery_verified"
            assert "no replay evidence is available" in decision["reason"]
            assert "no forward has been recorded at a SCOUT check step" in decision["reason"]


def test_straggler_and_inaccessible_hang_decide_without_a_sweep(tmp_path):
    results = _sweep(tmp_path, "rank_local")
    straggler, inaccessible = results[0]["decisions"][:2]
    assert (straggler["mode"], straggler["reason"]) == (
        "latest", "straggler: every rank is accessible and state is not suspect")
    assert (inaccessible["mode"], inaccessible["reason"]) == (
        "recovery_verified", "a required rank or machine is inaccessible")
    # Rank 0 alone made those calls; had either started a sweep, its later sweeps would be out of
    # step with the other ranks' and come back incomplete instead of clean.
    for seen in results:
        assert [d["mode"] for d in seen["decisions"][-2:]] == ["latest", "latest"]


def test_sharded_model_is_not_swept_over_the_training_process_group(tmp_path):
    for decision in run_ranks(sharded, 2, str(tmp_path), timeout=200):
        assert decision["mode"] == "recovery_verified"
        assert "no replay evidence is available (the model has sharded (FSDP2/HSDP DTensor) parameters" \
            in decision["reason"]


def _final_norm(rank, world, folder, fault_rank):
    """NormedLM (its final LayerNorm sits outside the embedding/hidden/output classes) trained two
    steps under DDP; then one bit of `norm.weight` flips on `fault_rank` and every rank sweeps."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lm_resiliency import InMemoryCkptConfig, enable_resiliency
    from tests.distributed.scout_coverage_workloads import NormedLM

    torch.manual_seed(0)
    model = NormedLM()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session = enable_resiliency(ddp, optimizer, interval=2,
                                checkpoint=InMemoryCkptConfig(disk_folder=folder, run_id="sweep-norm", timeout_s=60))
    for step in range(2):
        tokens = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(1000 * rank + step))
        ddp(tokens).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if rank == fault_rank:
        with torch.no_grad():
            model.norm.weight.view(torch.int32)[3] ^= 1 << 22
    session.prepare_recovery("hang")
    decision = session.last_recovery_decision.to_json()
    swept = [path for _, path, _ in session.scout.sweep._modules]
    session.close()
    return decision, swept


def test_sweep_covers_the_final_norm_outside_the_check_classes(tmp_path):
    for decision, swept in run_ranks(_final_norm, WORLD, str(tmp_path), 1, timeout=200):
        # The output rotation's remaining module is swept: every parameter of the model is signed.
        assert swept == ["emb", "blocks.0", "blocks.1", "blocks.2", "head", "norm"]
        assert decision["mode"] == "recovery_verified"
        assert "SDC localized to ranks [1]" in decision["reason"]
        assert "parameters norm" in decision["reason"] and "output norm" in decision["reason"]
