"""Campaign state stores: CAS semantics, and two real processes racing for the same occurrences."""

import json
import multiprocessing as mp
import threading

import pytest

from lm_resiliency.faults import (CampaignStateStore, JsonCampaignStateStore, MemoryCampaignStateStore,
                                  enable_fault_injection)
from lm_resiliency.faults.state import empty_state

from tests import harness  # noqa: F401 - configures the shared forkserver (torch preloaded)

from .workloads import batches, make_model, race_claims, sdc_campaign, train


@pytest.fixture(params=["memory", "json"])
def store(request, tmp_path):
    if request.param == "memory":
        return MemoryCampaignStateStore()
    return JsonCampaignStateStore(str(tmp_path / "s.json"))


def test_load_save_cas(store):
    assert store.load() == empty_state()
    state = store.load()
    updated = dict(state, values={"a": 1})
    assert store.compare_and_swap(state, updated)
    assert not store.compare_and_swap(state, dict(state, values={"a": 2}))  # stale expectation
    assert store.load()["values"] == {"a": 1}
    store.save(empty_state())
    assert store.load() == empty_state()
    assert store.claim("x@1/rank-0", {"pid": 1}) and not store.claim("x@1/rank-0", {"pid": 2})
    assert store.claims() == {"x@1/rank-0": {"pid": 1}}
    assert store.setdefault("origin", 5.0) == 5.0 and store.setdefault("origin", 9.0) == 5.0
    with pytest.raises(ValueError):
        store.compare_and_swap(store.load(), {"values": float("nan")})


def test_custom_store_needs_all_three_methods():
    class Incomplete(CampaignStateStore):
        def load(self):
            return {}

        def save(self, state):
            pass

    with pytest.raises(TypeError, match="compare_and_swap"):
        Incomplete()


def test_json_store_fails_closed_on_a_corrupt_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        JsonCampaignStateStore(str(path)).load()
    path.write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(ValueError, match="schema_version"):
        JsonCampaignStateStore(str(path)).claim("k", {})


def test_threads_claim_each_key_once(tmp_path):
    store = JsonCampaignStateStore(str(tmp_path / "s.json"))
    wins = []
    barrier = threading.Barrier(4)

    def worker(name):
        barrier.wait()
        for k in range(25):
            if store.claim(f"i@{k}/rank-0", {"worker": name}):
                wins.append(k)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(wins) == list(range(25))


def test_two_processes_race_for_the_same_occurrences(tmp_path):
    """An old and a replacement worker of one rank, in lockstep, claim occurrence k in round k and
    both try to CAS the same state: exactly one wins each race, every round."""
    rounds = 80
    ctx = mp.get_context("forkserver")
    barrier = ctx.Barrier(2)
    queue = ctx.Queue()
    path = str(tmp_path / "state.json")
    procs = [ctx.Process(target=race_claims, args=(path, rounds, barrier, queue, name))
             for name in ("old", "replacement")]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        worker, won, swapped = queue.get(timeout=120)
        results[worker] = (set(won), set(swapped))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    old_won, old_swapped = results["old"]
    new_won, new_swapped = results["replacement"]
    assert not old_won & new_won and old_won | new_won == set(range(rounds))
    assert not old_swapped & new_swapped and old_swapped | new_swapped == set(range(rounds))
    claims = JsonCampaignStateStore(path).claims()
    assert len(claims) == rounds
    assert {k for k, v in claims.items() if v["worker"] == "old"} == {f"incident@{k}/rank-0" for k in old_won}


def test_session_claims_through_a_custom_store():
    class CountingStore(CampaignStateStore):
        """A user store: the session only needs load/save/compare_and_swap."""

        def __init__(self):
            self.inner, self.swaps = MemoryCampaignStateStore(), 0

        def load(self):
            return self.inner.load()

        def save(self, state):
            self.inner.save(state)

        def compare_and_swap(self, expected, updated):
            self.swaps += 1
            return self.inner.compare_and_swap(expected, updated)

    store = CountingStore()
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=sdc_campaign(0, at=2), state_store=store)
    train(model, optimizer, batches(3))
    # One swap binds the store to the manifest at attach, one claims the occurrence.
    assert store.swaps == 2 and list(store.claims()) == ["sdc@2/rank-0"]
    assert faults.records[0].injected
