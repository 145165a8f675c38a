"""GEMINI loaders refuse hostile files (issue 13, items 10-13): non-regular files, deep JSON,
compressed or oversized archive entries, and temp files of killed flushes left behind."""

import json
import os
import signal
import subprocess
import sys
import threading
import zipfile

import pytest
import torch

from lm_resiliency.codec import MAX_STATE_DEPTH, StateTooDeepError, decode_state, encode_state
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.files import MAX_JSON_DEPTH, json_nesting, loads_strict_json
from lm_resiliency.gemini.shm import SharedMemoryUnavailable
from lm_resiliency.gemini.storage import STATUS_FILE, ShardRejected, StatusRejected, temp_scope
from lm_resiliency.wire import decode_json, encode_json
from tests.distributed.gemini_workloads import assert_same
from tests.unit.test_shm import capture, crash, make_arena, rank_dir, sample_state as shm_state
from tests.unit.test_storage import (
    RUN, TOPO, ROOT, _CHILD, dead_pid, make_store, own, pack, temp_files, write,
)

DEEP = 100_000  # far past any recursion limit


def deep_json(levels=DEEP):
    return "[" * levels + "]" * levels


def finishes(fn, timeout_s=20.0):
    """Run `fn` in a thread; (finished, its exception). A hung open is left blocked, not killed."""
    outcome = {}

    def target():
        try:
            fn()
        except BaseException as exc:  # handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive(), outcome.get("error")


def unblock(fifo):
    """Give a reader blocked on `fifo` (old code) a writer, so the thread ends."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def rezip(path, compress_type=zipfile.ZIP_STORED, edit=None):
    """Rewrite a shard's zip archive entry by entry (same names and bytes)."""
    with zipfile.ZipFile(path) as src:
        entries = [(info.filename, src.read(info)) for info in src.infolist()]
    with zipfile.ZipFile(path, "w", compression=compress_type) as dst:
        for name, data in entries:
            dst.writestr(name, edit(name, data) if edit else data)


# ------------------------------------------------------------------ item 10: non-regular files


@pytest.mark.parametrize("which", ["shard", "status"])
def test_fifo_named_like_a_shard_or_status_is_refused_without_blocking(tmp_path, which):
    store = make_store(tmp_path)
    if which == "shard":
        path, call, rejection = os.path.join(store.directory, own(store, 3).file_name), \
            (lambda: store.read_shard(own(store, 3))), ShardRejected
    else:
        path, call, rejection = os.path.join(store.directory, STATUS_FILE), store.read_status, StatusRejected
    os.mkfifo(path, 0o600)
    try:
        done, error = finishes(call)
        assert done, f"reading a FIFO named {os.path.basename(path)} blocked"
        assert isinstance(error, rejection) and "not a regular file" in str(error), error
    finally:
        unblock(path)


def test_fifo_owner_record_of_a_shared_memory_rank_dir_is_refused_without_blocking(tmp_path):
    arena = make_arena(tmp_path)
    crash(arena)
    owner = os.path.join(rank_dir(tmp_path), "owner.json")
    os.unlink(owner)
    os.mkfifo(owner, 0o600)
    try:
        done, error = finishes(lambda: make_arena(tmp_path).close(keep=True))
        assert done, "claiming a rank directory whose owner record is a FIFO blocked"
        assert isinstance(error, SharedMemoryUnavailable) and "no valid owner.json" in str(error), error
    finally:
        unblock(owner)


# ------------------------------------------------------------------ item 11: nesting


def test_json_nesting_counts_brackets_outside_strings_only():
    assert json_nesting('{"a": [1, {"b": "[[[{{"}], "c\\\\": "\\"]"}') == 3
    assert json_nesting('"unterminated [[[[') == 0
    assert json_nesting(deep_json()) == DEEP
    with pytest.raises(ValueError, match=f"nested {DEEP} levels deep; at most {MAX_JSON_DEPTH}"):
        loads_strict_json(deep_json())
    assert loads_strict_json(deep_json(MAX_JSON_DEPTH)) is not None


def test_deeply_nested_shard_metadata_is_rejected_not_a_recursion_error(tmp_path):
    store = make_store(tmp_path)
    path = write(store, own(store, 1))
    obj = torch.load(path, weights_only=True)
    obj["metadata"] = deep_json()
    torch.save(obj, path)
    with pytest.raises(ShardRejected, match=r"not a GEMINI shard metadata: not valid JSON \(JSON nested 100000 levels"):
        store.read_shard(own(store, 1))


def test_deeply_nested_status_sidecar_is_rejected_not_a_recursion_error(tmp_path):
    store = make_store(tmp_path)
    store.write_status({"ok": True})
    with open(os.path.join(store.directory, STATUS_FILE), "w") as f:
        f.write(deep_json())
    with pytest.raises(StatusRejected, match=r"not a GEMINI status sidecar: not valid JSON \(JSON nested 100000 levels"):
        store.read_status()


def test_deeply_nested_shared_memory_sidecar_is_refused_and_the_other_slot_adopted(tmp_path, caplog):
    from lm_resiliency.gemini.slots import SlotPair

    arena = make_arena(tmp_path)
    pair = SlotPair("own", arena.allocate, 5.0, mirror=arena)
    capture(pair, shm_state(1), 1)
    capture(pair, shm_state(2), 2)
    crash(arena)
    sidecars = sorted(n for n in os.listdir(rank_dir(tmp_path)) if n.startswith("own_") and n.endswith(".json"))
    newest = max(sidecars, key=lambda n: json.load(open(os.path.join(rank_dir(tmp_path), n)))["step"])
    with open(os.path.join(rank_dir(tmp_path), newest), "w") as f:
        f.write(deep_json())
    successor = make_arena(tmp_path)
    try:
        adopted = successor.adopt()
        assert [s.step for s in adopted] == [1]
        state = decode_state(adopted[0].structure, [t.clone() for t in adopted[0].layout.views(adopted[0].buffer)])
        assert_same(state, shm_state(1))
        assert "nested 100000 levels" in caplog.text
    finally:
        successor.close(keep=False)


def nest(levels):
    state = {"w": torch.ones(2)}
    for _ in range(levels):
        state = {"inner": state}
    return state


def test_too_deep_state_is_refused_at_save_not_in_the_background_flush(tmp_path):
    config = InMemoryCkptConfig(disk_folder=str(tmp_path / "disk"), host_memory="heap", disk_flush_interval=1,
                                timeout_s=30.0)
    with InMemoryCheckpointManager(config, install_signal_handlers=False) as manager:
        with pytest.raises(ValueError, match=f"deeper than {MAX_STATE_DEPTH} levels") as info:
            manager.save(nest(330), 1)
        assert isinstance(info.value, StateTooDeepError)
        manager.save(nest(MAX_STATE_DEPTH - 1), 2)  # the deepest accepted state round-trips
        manager.maybe_wait()
        manager.flush_now()
    assert json_nesting(json.dumps(encode_state(nest(MAX_STATE_DEPTH - 1)).structure)) < MAX_JSON_DEPTH


def test_too_deep_caller_metadata_fails_the_write(tmp_path):
    store = make_store(tmp_path)
    layout, structure, payload = pack()
    extra = {}
    for _ in range(MAX_JSON_DEPTH):
        extra = {"x": extra}
    with pytest.raises(ValueError, match=f"nested deeper than {MAX_JSON_DEPTH - 1} levels"):
        store.write_shard(own(store, 1), layout, structure, payload, extra)
    with pytest.raises(ValueError, match="nested deeper"):
        store.write_status(extra)
    assert store.list_shards() == [] and temp_files(store) == []


def test_wire_documents_nested_too_deeply_are_refused():
    raw = torch.frombuffer(bytearray(deep_json().encode()), dtype=torch.uint8)
    with pytest.raises(ValueError, match="JSON nested 100000 levels deep; at most 256 are accepted"):
        decode_json(raw)
    assert decode_json(encode_json({"a": [[1]]})) == {"a": [[1]]}


def test_manager_falls_back_to_the_older_step_when_the_newest_shard_is_deeply_nested(tmp_path):
    config = InMemoryCkptConfig(disk_folder=str(tmp_path / "disk"), host_memory="heap", disk_flush_interval=1,
                                verify_integrity=True, run_id="deep", timeout_s=30.0)
    states = {step: {"w": torch.arange(6.0) + step, "step": step} for step in (1, 2)}
    with InMemoryCheckpointManager(config, install_signal_handlers=False) as manager:
        for step, state in states.items():
            manager.save(state, step)
            manager.maybe_wait()
            manager.flush_now()
        newest = os.path.join(manager.store.directory, own(manager.store, 2).file_name)
    obj = torch.load(newest, weights_only=True)
    obj["metadata"] = deep_json()
    torch.save(obj, newest)
    with InMemoryCheckpointManager(config, install_signal_handlers=False) as successor:
        assert successor.find_latest() == 1
        assert_same(successor.load(), states[1])


# ------------------------------------------------------------------ item 12: compressed archives


def test_compressed_shard_is_refused_before_torch_load_inflates_it(tmp_path):
    store = make_store(tmp_path)
    layout, structure, _ = pack({"big": torch.zeros(8 << 20, dtype=torch.uint8)})
    store.write_shard(own(store, 1), layout, structure, torch.zeros(layout.total_bytes, dtype=torch.uint8))
    path = os.path.join(store.directory, own(store, 1).file_name)
    rezip(path, zipfile.ZIP_DEFLATED)
    assert os.path.getsize(path) < 64 << 10  # 8 MiB of state in a few KiB
    with pytest.raises(ShardRejected, match=r"archive entry '[^']+' is compressed \(method 8\)"):
        store.read_shard(own(store, 1))


def test_stored_shard_rewritten_entry_by_entry_still_loads(tmp_path):
    """The archive check refuses what is hostile, not what zipfile writes uncompressed."""
    store = make_store(tmp_path)
    path = write(store, own(store, 1))
    rezip(path)
    assert store.read_shard(own(store, 1)).key == own(store, 1)


def test_entry_sizes_past_the_end_of_the_file_are_refused(tmp_path):
    store = make_store(tmp_path)
    path = write(store, own(store, 1))
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data/0"))
    with open(path, "rb") as f:
        data = bytearray(f.read())
    # Patch the storage's central-directory record: compressed and uncompressed sizes (offsets 20, 24).
    name = info.filename.encode()
    at = data.find(b"PK\x01\x02")
    while data[at + 46: at + 46 + len(name)] != name:
        at = data.find(b"PK\x01\x02", at + 4)
    data[at + 20: at + 28] = (1 << 31).to_bytes(4, "little") * 2
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(ShardRejected, match="past the end of the"):
        store.read_shard(own(store, 1))


# ------------------------------------------------------------------ item 13: temp files


def test_store_construction_reaps_dead_writers_temps_of_every_file_only(tmp_path):
    store = make_store(tmp_path)
    scope = temp_scope()
    foreign = "0123456789abcdef" if scope != "0123456789abcdef" else "fedcba9876543210"
    pid = dead_pid()
    dead = [f".{own(store, 7).file_name}.tmp-{scope}-{pid}-aa", f".{STATUS_FILE}.tmp-{scope}-{pid}-bb",
            f".peer-00001-000000000007.gemini.tmp-{scope}-{pid}-cc"]
    kept = [f".{own(store, 7).file_name}.tmp-{scope}-{os.getpid()}-dd",
            f".{own(store, 7).file_name}.tmp-{foreign}-{pid}-ee"]
    for name in dead + kept:
        with open(os.path.join(store.directory, name), "wb") as f:
            f.write(b"partial")
    make_store(tmp_path)
    assert temp_files(store) == sorted(kept)


def test_temp_of_a_flush_killed_mid_write_is_reaped_when_the_next_process_opens_the_store(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", _CHILD, ROOT, str(tmp_path), RUN, TOPO],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "in-fsync", "child writer never reached fsync"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    store = make_store(tmp_path)  # the next process: step 7 is never written again
    assert temp_files(store) == [] and store.list_shards() == []
