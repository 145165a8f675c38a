"""Node-owned shared-memory host slots: publication, adoption, refusal, reaping, fallback."""

import errno
import json
import logging
import os
import stat
import subprocess
import sys
import time

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.config import ConfigError
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.gemini import shm
from lm_resiliency.codec import Layout, decode_state, encode_state
from lm_resiliency.gemini.shm import SharedMemoryUnavailable, SharedSlotArena, shared_namespace
from lm_resiliency.gemini.slots import SlotPair
from lm_resiliency.gemini.storage import temp_scope
from tests.distributed.gemini_workloads import assert_same

RUN = "run-shm"
TOPO = "topo-1"
OTHER_UID = 12345


def make_arena(tmp_path, rank=0, verify=False, run_id=RUN, topology=TOPO, peer_owner=1, root=None,
               reap_after_s=24 * 3600.0):
    return SharedSlotArena(str(root or tmp_path / "shm"), run_id, topology, rank,
                           series=str(tmp_path / "disk"), verify_integrity=verify, pin_memory=False,
                           peer_owner=peer_owner, reap_other_runs_after_s=reap_after_s)


def sample_state(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 16, generator=gen), "b": torch.arange(7, dtype=torch.int64) + seed,
            "flag": torch.tensor([True, False]), "meta": {"step": seed, "name": "x"}}


def capture(pair, state, step, owner=0):
    """What the manager does: begin_write, copy, publish."""
    enc = encode_state(state)
    layout = Layout.for_tensors(enc.tensors)
    slot = pair.begin_write(layout)
    for view, tensor in zip(layout.views(slot.buffer), enc.tensors):
        view.copy_(tensor)
    pair.publish(slot, step, enc.structure, owner, {"k": step})
    return slot


def restore(found):
    return decode_state(found.structure, [t.clone() for t in found.layout.views(found.buffer)])


def crash(arena):
    """Stand-in for a SIGKILLed writer in unit tests: unmap, leave every file as it is."""
    arena.close(keep=True)


def rank_dir(tmp_path, rank=0, run_id=RUN, topology=TOPO):
    return os.path.join(tmp_path / "shm", shared_namespace(run_id, topology, str(tmp_path / "disk")),
                        f"rank-{rank:05d}.{temp_scope()}")


def rewrite_sidecar(path, **changes):
    with open(path) as f:
        doc = json.load(f)
    doc.update(changes)
    with open(path, "w") as f:
        json.dump(doc, f)


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ------------------------------------------------------------------ publication and adoption


def test_successor_adopts_ready_slots_bitwise(tmp_path):
    arena = make_arena(tmp_path)
    own = SlotPair("own", arena.allocate, 5.0, mirror=arena)
    first = capture(own, sample_state(1), 10)
    second = capture(own, sample_state(2), 20)
    crash(arena)

    successor = make_arena(tmp_path)
    found = successor.adopt()
    assert [(s.name, s.step) for s in found] == [(second.name, 20), (first.name, 10)]
    assert successor.predecessor_pid == os.getpid()
    assert_same(restore(found[0]), sample_state(2))
    assert_same(restore(found[1]), sample_state(1))
    assert found[0].extra == {"k": 20} and found[0].owner_rank == 0
    successor.close(keep=False)


def test_directory_and_files_are_owner_only(tmp_path):
    arena = make_arena(tmp_path)
    own = SlotPair("own", arena.allocate, 5.0, mirror=arena)
    slot = capture(own, sample_state(), 1)
    d = arena.directory
    for path in (str(tmp_path / "shm"), os.path.dirname(d), d):
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, path
    for name in os.listdir(d):
        st = os.lstat(os.path.join(d, name))
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, name
    assert sorted(os.listdir(d)) == sorted(["owner.json", f"{slot.name}.json", f"{slot.name}.seg"])
    arena.close(keep=False)


def test_slot_being_rewritten_is_not_ready_and_previous_is_used(tmp_path):
    arena = make_arena(tmp_path)
    own = SlotPair("own", arena.allocate, 5.0, mirror=arena)
    older = capture(own, sample_state(1), 1)
    newer = capture(own, sample_state(2), 2)
    # The next capture starts writing into the older slot (step 1) and "dies" half way through.
    enc = encode_state(sample_state(3))
    layout = Layout.for_tensors(enc.tensors)
    slot = own.begin_write(layout)
    assert slot is older
    assert not os.path.exists(os.path.join(arena.directory, f"{older.name}.json"))  # retracted first
    slot.buffer[: layout.total_bytes // 2].fill_(0xAB)
    crash(arena)

    successor = make_arena(tmp_path)
    found = successor.adopt()
    assert [(s.name, s.step) for s in found] == [(newer.name, 2)]
    assert_same(restore(found[0]), sample_state(2))
    assert not os.path.exists(os.path.join(successor.directory, f"{older.name}.seg"))  # half-written: removed
    successor.close(keep=False)


def test_clean_close_removes_everything_and_keep_leaves_slots(tmp_path):
    arena = make_arena(tmp_path)
    own = SlotPair("own", arena.allocate, 5.0, mirror=arena)
    capture(own, sample_state(), 1)
    arena.close(keep=True)
    assert os.listdir(rank_dir(tmp_path))
    successor = make_arena(tmp_path)
    assert len(successor.adopt()) == 1
    successor.close(keep=False)
    assert os.listdir(tmp_path / "shm") == []


def test_peer_slot_identity_checked_against_pairing(tmp_path):
    arena = make_arena(tmp_path, peer_owner=3)
    peer = SlotPair("peer", arena.allocate, 5.0, mirror=arena)
    capture(peer, sample_state(), 4, owner=3)
    crash(arena)
    successor = make_arena(tmp_path, peer_owner=3)
    assert [s.owner_rank for s in successor.adopt()] == [3]
    successor.close(keep=False)


def test_peer_slot_from_unexpected_owner_is_refused(tmp_path, caplog):
    arena = make_arena(tmp_path, peer_owner=3)
    peer = SlotPair("peer", arena.allocate, 5.0, mirror=arena)
    capture(peer, sample_state(), 4, owner=3)
    crash(arena)
    with caplog.at_level(logging.WARNING):
        successor = make_arena(tmp_path, peer_owner=2)
        assert successor.adopt() == []
    assert "wrong owner rank" in caplog.text
    successor.close(keep=False)


# ----------------------------------------------------------------------------- refusal


def _published(tmp_path, verify=False):
    arena = make_arena(tmp_path, verify=verify)
    own = SlotPair("own", arena.allocate, 5.0, mirror=arena)
    slot = capture(own, sample_state(), 5)
    crash(arena)
    d = rank_dir(tmp_path)
    return os.path.join(d, f"{slot.name}.seg"), os.path.join(d, f"{slot.name}.json")


def _refused(tmp_path, caplog, reason, verify=False):
    with caplog.at_level(logging.WARNING):
        arena = make_arena(tmp_path, verify=verify)
        assert arena.adopt() == []
    assert "refuses shared slot own_" in caplog.text and reason in caplog.text, caplog.text
    # A refused slot is removed, never left to be picked up later.
    assert not any(n.endswith(".json") and n != "owner.json" for n in os.listdir(arena.directory))
    arena.close(keep=False)


@pytest.mark.parametrize("which", ["segment", "sidecar"])
def test_foreign_uid_is_refused(tmp_path, caplog, which):
    seg, sidecar = _published(tmp_path)
    os.chown(seg if which == "segment" else sidecar, OTHER_UID, OTHER_UID)
    _refused(tmp_path, caplog, f"owned by uid {OTHER_UID}")


@pytest.mark.parametrize("change, reason", [
    ({"run_id": "another-run"}, "wrong run id"),
    ({"topology": "another-topology"}, "wrong topology"),
    ({"holder_rank": 1}, "wrong holder rank"),
    ({"owner_rank": 1}, "wrong owner rank"),
    ({"slot": "peer_a"}, "wrong slot name"),
    ({"step": -1}, "step must be at least 0, got -1"),
    ({"version": 99}, "version"),
    ({"layout": {"total_bytes": 8, "tensors": "nope"}}, "bad layout"),
])
def test_wrong_identity_is_refused(tmp_path, caplog, change, reason):
    _, sidecar = _published(tmp_path)
    rewrite_sidecar(sidecar, **change)
    _refused(tmp_path, caplog, reason)


def test_malformed_sidecar_is_refused(tmp_path, caplog):
    _, sidecar = _published(tmp_path)
    with open(sidecar, "w") as f:
        f.write('{"version": 1, "version": 1}')
    _refused(tmp_path, caplog, "not a shared-memory slot sidecar: not valid JSON (duplicate JSON key")


def test_symlinked_segment_is_refused(tmp_path, caplog):
    seg, _ = _published(tmp_path)
    target = tmp_path / "elsewhere.seg"
    with open(seg, "rb") as f:
        target.write_bytes(f.read())
    os.unlink(seg)
    os.symlink(target, seg)
    _refused(tmp_path, caplog, "symbolic link")
    assert target.exists()  # the link target is never touched


def test_symlinked_sidecar_is_refused(tmp_path, caplog):
    _, sidecar = _published(tmp_path)
    target = tmp_path / "elsewhere.json"
    with open(sidecar) as f:
        target.write_text(f.read())
    os.unlink(sidecar)
    os.symlink(target, sidecar)
    _refused(tmp_path, caplog, "symbolic link")


def test_truncated_segment_is_refused(tmp_path, caplog):
    seg, _ = _published(tmp_path)
    os.truncate(seg, os.path.getsize(seg) // 2)
    _refused(tmp_path, caplog, "truncated or resized")


def test_replaced_segment_is_refused(tmp_path, caplog):
    seg, _ = _published(tmp_path)
    with open(seg, "rb") as f:
        data = f.read()
    with open(seg + ".new", "wb") as f:  # same name and bytes, another file
        f.write(data)
    os.chmod(seg + ".new", 0o600)
    os.replace(seg + ".new", seg)
    _refused(tmp_path, caplog, "replaced")


def test_group_readable_segment_is_refused(tmp_path, caplog):
    seg, _ = _published(tmp_path)
    os.chmod(seg, 0o644)
    _refused(tmp_path, caplog, "expected 0600")


def test_unchecksummed_slot_refused_when_integrity_is_required(tmp_path, caplog):
    _published(tmp_path, verify=False)
    _refused(tmp_path, caplog, "without integrity checksum", verify=True)


def test_flipped_payload_byte_fails_crc(tmp_path):
    seg, _ = _published(tmp_path, verify=True)
    arena = make_arena(tmp_path, verify=True)
    (found,) = arena.adopt()
    assert arena.verify(found.name) is None
    with open(seg, "r+b") as f:  # the same pages the arena maps
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    assert "CRC-32 mismatch" in arena.verify(found.name)
    arena.close(keep=False)


def test_symlinked_root_is_unavailable(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "shm")
    with pytest.raises(SharedMemoryUnavailable, match="symbolic link"):
        make_arena(tmp_path)


def test_foreign_root_is_unavailable(tmp_path):
    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(SharedMemoryUnavailable, match=f"uid {OTHER_UID}"):
        make_arena(tmp_path)


def test_live_owner_is_never_taken_over(tmp_path):
    first = make_arena(tmp_path)
    with pytest.raises(SharedMemoryUnavailable, match="another GEMINI manager of this process"):
        make_arena(tmp_path)
    crash(first)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = os.path.join(rank_dir(tmp_path), "owner.json")
        with open(owner, "w") as f:
            json.dump({"version": 1, "scope": temp_scope(), "pid": sleeper.pid,
                       "start_time": shm.process_start_time(sleeper.pid)}, f)
        with pytest.raises(SharedMemoryUnavailable, match=f"live process {sleeper.pid}"):
            make_arena(tmp_path)
        # A recycled PID (same number, other start time) is not the owner.
        with open(owner, "w") as f:
            json.dump({"version": 1, "scope": temp_scope(), "pid": sleeper.pid, "start_time": 1}, f)
        arena = make_arena(tmp_path)
        assert arena.predecessor_pid == sleeper.pid
        arena.close(keep=False)
    finally:
        sleeper.kill()
        sleeper.wait()


# ------------------------------------------------------------------------------ reaping


def _stale_rank_dir(tmp_path, run_id, pid, scope=None, start_time=None):
    """A rank directory of another run as a dead (or live) writer leaves it."""
    arena = make_arena(tmp_path, run_id=run_id)
    own = SlotPair("own", arena.allocate, 5.0, mirror=arena)
    capture(own, sample_state(), 1)
    crash(arena)
    d = rank_dir(tmp_path, run_id=run_id)
    with open(os.path.join(d, "owner.json"), "w") as f:
        json.dump({"version": 1, "scope": scope or temp_scope(), "pid": pid, "start_time": start_time}, f)
    if scope is not None:
        moved = d[: -len(temp_scope())] + scope
        os.rename(d, moved)
        d = moved
    return d


def backdate(directory, seconds):
    """Make a rank directory look last written `seconds` ago."""
    when = time.time() - seconds
    for name in os.listdir(directory):
        os.utime(os.path.join(directory, name), (when, when), follow_symlinks=False)
    os.utime(directory, (when, when))


def test_new_run_reaps_only_old_dead_runs_of_this_scope(tmp_path, caplog):
    day = 24 * 3600
    old = _stale_rank_dir(tmp_path, "old-dead", dead_pid())
    backdate(old, day + 60)
    young = _stale_rank_dir(tmp_path, "young-dead", dead_pid())
    backdate(young, day - 600)  # a relaunch of that crashed job can still recover from it
    foreign = _stale_rank_dir(tmp_path, "old-foreign", dead_pid(), scope="0123456789abcdef")
    backdate(foreign, 2 * day)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = _stale_rank_dir(tmp_path, "old-live", sleeper.pid, start_time=shm.process_start_time(sleeper.pid))
        backdate(live, 2 * day)
        with caplog.at_level(logging.INFO, logger="lm_resiliency.gemini.shm"):
            arena = make_arena(tmp_path, run_id="new-run")  # default bound: 24 h
        assert not os.path.exists(old) and not os.path.exists(os.path.dirname(old))
        assert any(name.startswith("own_") and name.endswith(".json") for name in os.listdir(young))
        assert f"keeping shared-memory slots {young}" in caplog.text
        assert os.path.exists(foreign) and os.listdir(foreign)  # another boot/PID namespace: untouched
        assert os.path.exists(live) and os.listdir(live)  # owner alive: untouched
        arena.close(keep=False)
        # A bound of 0 (the pre-bound behaviour) reaps the young dead run too, never the live one.
        make_arena(tmp_path, run_id="newer-run", reap_after_s=0).close(keep=False)
        assert not os.path.exists(young)
        assert os.path.exists(live) and os.listdir(live)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_same_run_is_adopted_not_reaped(tmp_path):
    d = _stale_rank_dir(tmp_path, RUN, dead_pid())
    arena = make_arena(tmp_path)
    assert arena.directory == d and len(arena.adopt()) == 1
    arena.close(keep=False)


def test_unattributable_directory_is_kept(tmp_path):
    d = _stale_rank_dir(tmp_path, "old-broken", dead_pid())
    os.unlink(os.path.join(d, "owner.json"))
    make_arena(tmp_path, run_id="new-run").close(keep=False)
    assert os.path.exists(d)


# --------------------------------------------------------------------------- fallback


def test_full_shared_memory_falls_back_to_heap(tmp_path, monkeypatch, caplog):
    arena = make_arena(tmp_path)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    own = SlotPair("own", arena.allocate, 5.0, mirror=arena)
    with caplog.at_level(logging.WARNING):
        slot = capture(own, sample_state(), 1)
    assert "using process heap memory" in caplog.text
    assert not arena.is_shared(slot.name, slot.buffer)
    assert os.listdir(arena.directory) == ["owner.json"]  # nothing half-made, nothing READY
    report = arena.report()
    assert report.slot_bytes == {slot.name: slot.buffer.numel()} and report.total_bytes == slot.buffer.numel()
    arena.close(keep=False)


def test_memory_is_bounded_and_reported(tmp_path):
    arena = make_arena(tmp_path)
    own = SlotPair("own", arena.allocate, 5.0, mirror=arena)
    peer = SlotPair("peer", arena.allocate, 5.0, mirror=arena)
    for step in range(1, 6):
        capture(own, sample_state(step), step)
        capture(peer, sample_state(step), step, owner=1)
    capture(own, {"big": torch.zeros(4096)}, 6)  # grows one slot: the old segment is replaced
    report = arena.report()
    assert sorted(report.slot_bytes) == ["own_a", "own_b", "peer_a", "peer_b"] and report.max_slots == 4
    segs = sorted(n for n in os.listdir(arena.directory) if n.endswith(".seg"))
    assert segs == ["own_a.seg", "own_b.seg", "peer_a.seg", "peer_b.seg"]
    assert report.total_bytes == sum(os.path.getsize(os.path.join(arena.directory, n)) for n in segs)
    with pytest.raises(ValueError, match="slot name"):
        arena.allocate("own_c", 10)
    arena.close(keep=False)


# ----------------------------------------------------------------------- manager level


def _manager(tmp_path, **kw):
    base = dict(interval=1, disk_flush_interval=0, disk_folder=str(tmp_path / "disk"), run_id=RUN,
                shared_memory_dir=str(tmp_path / "shm"), timeout_s=30)
    base.update(kw)
    return InMemoryCheckpointManager(InMemoryCkptConfig(**base), install_signal_handlers=False)


def test_manager_successor_recovers_from_shared_memory(tmp_path):
    first = _manager(tmp_path, verify_integrity=True)
    first.save(sample_state(1), 1)
    first.save(sample_state(2), 2)
    first.maybe_wait()
    assert first.host_memory().mode == "shared" and first.host_memory().total_bytes > 0
    first.close(keep_shared=True)

    second = _manager(tmp_path, verify_integrity=True)
    assert second.find_latest() == 2
    assert second.recovery_sources == {"own:0": "shared-memory"}
    assert_same(second.load(), sample_state(2))
    assert not os.listdir(tmp_path / "disk" / os.listdir(tmp_path / "disk")[0] / "rank-00000")
    second.close()
    assert os.listdir(tmp_path / "shm") == []


def test_manager_close_default_removes_and_env_keeps(tmp_path, monkeypatch):
    first = _manager(tmp_path)
    first.save(sample_state(1), 1)
    first.maybe_wait()
    monkeypatch.setenv("LM_RESILIENCY_KEEP_SHARED_MEMORY", "1")
    first.close()
    second = _manager(tmp_path)
    assert second.find_latest() == 1
    monkeypatch.delenv("LM_RESILIENCY_KEEP_SHARED_MEMORY")
    second.close()
    assert os.listdir(tmp_path / "shm") == []


def test_manager_corrupt_shared_slot_falls_back_to_older_step(tmp_path):
    first = _manager(tmp_path, verify_integrity=True)
    first.save(sample_state(1), 1)
    first.save(sample_state(2), 2)
    first.maybe_wait()
    d = first.host_memory().directory
    first.close(keep_shared=True)
    newest = max(("own_a", "own_b"), key=lambda n: json.load(open(os.path.join(d, f"{n}.json")))["step"])
    with open(os.path.join(d, f"{newest}.seg"), "r+b") as f:
        f.write(b"\xff\xff\xff\xff")

    second = _manager(tmp_path, verify_integrity=True)
    assert second.find_latest() == 1
    assert_same(second.load(), sample_state(1))
    assert not os.path.exists(os.path.join(d, f"{newest}.json"))  # never offered again
    second.close()


def test_manager_heap_mode_never_touches_shared_memory(tmp_path):
    manager = _manager(tmp_path, host_memory="heap")
    manager.save(sample_state(1), 1)
    manager.maybe_wait()
    report = manager.host_memory()
    assert report.mode == "heap" and report.directory is None and report.total_bytes > 0
    assert not os.path.exists(tmp_path / "shm")
    manager.close()


def test_manager_unusable_shared_memory_dir_falls_back_with_warning(tmp_path, caplog):
    (tmp_path / "a-file").write_text("x")
    with caplog.at_level(logging.WARNING):
        manager = _manager(tmp_path, shared_memory_dir=str(tmp_path / "a-file" / "shm"))
    assert "falling back to process heap slots" in caplog.text
    manager.save(sample_state(3), 3)
    assert manager.find_latest() == 3 and manager.recovery_sources == {"own:0": "memory"}
    assert_same(manager.load(), sample_state(3))
    assert manager.host_memory().mode == "heap"
    manager.close()


@pytest.mark.parametrize("field, value", [
    ("host_memory", "shm"), ("host_memory", ""), ("host_memory", None), ("host_memory", 1),
    ("shared_memory_dir", ""), ("shared_memory_dir", "  "), ("shared_memory_dir", 3),
])
def test_config_rejects_bad_host_memory_fields(field, value):
    with pytest.raises(ConfigError, match=f"InMemoryCkptConfig.{field}"):
        InMemoryCkptConfig(**{field: value})


def test_config_host_memory_defaults():
    config = InMemoryCkptConfig()
    assert config.host_memory == "shared" and config.shared_memory_dir is None
    assert InMemoryCkptConfig(host_memory="heap", shared_memory_dir="/tmp/x").host_memory == "heap"


# ---------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_cuda_capture_into_page_locked_shared_slot(tmp_path):
    first = _manager(tmp_path, pin_memory=True)
    state = {"w": torch.randn(1024, 256, device="cuda"), "step": 1}
    first.save(state, 1)
    first.maybe_wait()
    slot = first._own.ready_slots()[0]
    assert slot.buffer.is_pinned(), "shared slot must be page-locked for asynchronous copies"
    expected = state["w"].cpu()
    first.close(keep_shared=True)

    second = _manager(tmp_path, pin_memory=True)
    assert second.find_latest() == 1 and second.recovery_sources == {"own:0": "shared-memory"}
    assert second._own.ready_slots()[0].buffer.is_pinned()
    assert torch.equal(second.load()["w"], expected)
    second.close()


def test_recovered_state_is_a_private_copy_on_write_view(tmp_path):
    first = _manager(tmp_path, verify_integrity=True)
    first.save(sample_state(1), 1)
    first.maybe_wait()
    first.close(keep_shared=True)

    second = _manager(tmp_path, verify_integrity=True)
    assert second.find_latest() == 1
    state = second.load()
    (slot,) = second._own.ready_slots()
    assert slot.lent
    state["w"].add_(1.0)  # e.g. an optimizer updating state it adopted without copying
    assert second._arena.verify(slot.name) is None, "the caller's writes never reach the shared slot"
    mutated = state["w"].clone()
    for step in (2, 3, 4):  # rewrite both slots: the lent pages must not change under the caller
        second.save(sample_state(step), step)
        second.maybe_wait()
    assert torch.equal(state["w"], mutated)
    assert second.find_latest() == 4
    assert_same(second.load(), sample_state(4))
    assert len(second.host_memory().slot_bytes) <= 4
    second.close()
