"""Checkpoint transfer between real gloo processes: a replacement node gets the replaced rank's
flushed shards from its peers and GEMINI recovers from them; a corrupted chunk is refused."""

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.codec import Layout
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.gemini.storage import NodeLocalStore, ShardKey
from lm_resiliency.manager_api import TransferKey, TransferRefused, make_transfer
from lm_resiliency.manager_api.transfer import TorchDistTransfer
from tests.distributed.gemini_workloads import assert_same, make_model, snapshot
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)

RUN = "transfer-run"
STEPS = 3


def _config(node_folder):
    return InMemoryCkptConfig(interval=1, replication_jump=1, disk_flush_interval=1, disk_folder=node_folder,
                              run_id=RUN, host_memory="heap", verify_integrity=True, timeout_s=60,
                              replication_chunk_size=1024)


def _train(rank, config):
    """The GEMINI guide's loop on a DDP model; returns the state captured at the last step."""
    model = DDP(make_model(seed=0))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = InMemoryCheckpointManager(config)
    gen = torch.Generator().manual_seed(100 + rank)
    expected = None
    for step in range(1, STEPS + 1):
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        manager.maybe_wait()
        optimizer.step()
        optimizer.zero_grad()
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
        expected = snapshot(state)
        manager.save(state, step)
    manager.maybe_wait()
    assert manager.flush_now() == STEPS
    manager.close()
    return expected


def _replacement_node(rank, world, folder, store_path):
    node = os.path.join(folder, f"node-{rank}")  # each rank's node-local disk
    expected = _train(rank, _config(node))
    dist.barrier()
    if rank == 1:
        shutil.rmtree(node)  # rank 1 comes back on a replacement node: its disk is empty
    dist.barrier()

    manager = InMemoryCheckpointManager(_config(node))
    store = dist.FileStore(store_path, world)
    with pytest.raises(ValueError, match="dedicated pair"):
        make_transfer("torch_dist", store=store, rank=rank, process_group=dist.group.WORLD)
    pair01 = dist.new_group([0, 1], backend="gloo")  # every rank creates the pairs, in one order
    dist.new_group([1, 2], backend="gloo")
    via_store = make_transfer("torch_dist", store=store, rank=rank, timeout_s=60, chunk_size=1000)
    # Rank 2 holds rank 1's replica (replication_jump=1); rank 1 held rank 0's replica.
    if rank == 2:
        via_store.send(TransferKey(RUN, STEPS, 1), manager.store, to_rank=1)
    if rank == 1:
        via_store.receive(TransferKey(RUN, STEPS, 1), manager.store, from_rank=2)
    if rank in (0, 1):
        via_group = make_transfer("torch_dist", store=store, rank=rank, timeout_s=60, chunk_size=1000,
                                  process_group=pair01)
        if rank == 0:
            via_group.send(TransferKey(RUN, STEPS, 0), manager.store, to_rank=1)
        else:
            via_group.receive(TransferKey(RUN, STEPS, 0), manager.store, from_rank=0)
    received = sorted(k.file_name for k in manager.store.list_shards())
    dist.barrier()
    # The transferred files become the only copies of step 3 for ranks 0 and 1: without them
    # the newest step every rank can load would be step 2 (rank 2 still holds rank 1's replica).
    if rank == 2:
        manager.store.remove_shard(ShardKey("peer", 1, STEPS))
    if rank == 0:
        manager.store.remove_shard(ShardKey("own", 0, STEPS))
    dist.barrier()
    step = manager.find_latest()
    sources = dict(manager.job_recovery_sources)
    state = manager.load()
    manager.close()
    assert_same(state, expected)
    return step, sources, received


def test_replacement_node_recovers_from_transferred_shards(tmp_path):
    results = run_ranks(_replacement_node, 3, str(tmp_path), str(tmp_path / "transfer-store"), timeout=180)
    for step, sources, _ in results:
        assert step == STEPS
        assert sources == {0: (1, "disk"), 1: (1, "disk"), 2: (2, "disk")}
    assert results[1][2] == [f"own-{STEPS:012d}.gemini", f"peer-00000-{STEPS:012d}.gemini"]


class _FlipChunk(TorchDistTransfer):
    """A sender whose chunk 1 is corrupted on the way (after its checksum was taken)."""

    def outgoing_chunks(self, payload, bounds):
        for tag, chunk in super().outgoing_chunks(payload, bounds):
            if tag == 1:
                chunk = chunk.clone()
                chunk[0] ^= 0xFF
            yield tag, chunk


# What the codec makes of {"values": <tensor 0>, "ids": <tensor 1>}: a structure that matches the layout.
STRUCTURE = {"t": "dict", "items": [["values", {"t": "tensor", "i": 0}], ["ids", {"t": "tensor", "i": 1}]]}


def write_replica(store, owner, step, floats):
    """Publish in `store` a real replica shard of `owner` at `step`: `floats` float32s 0, 1, ...
    and five int64s."""
    tensors = [torch.arange(floats, dtype=torch.float32), torch.arange(5, dtype=torch.int64)]
    layout = Layout.for_tensors(tensors)
    payload = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for spec, tensor in zip(layout.specs, tensors):
        payload[spec.offset:spec.offset + spec.nbytes] = tensor.view(torch.uint8)
    store.write_shard(ShardKey("peer", owner, step), layout, STRUCTURE, payload, extra={"note": "x"})


def _shard_store(folder, rank):
    store = NodeLocalStore(os.path.join(folder, f"node-{rank}"), RUN, "topology", rank, verify_integrity=True)
    if rank == 0:
        write_replica(store, 1, 7, 700)
    return store


def _corrupt_then_retry(rank, world, folder, store_path):
    store = dist.FileStore(store_path, world)
    shards = _shard_store(folder, rank)
    key = TransferKey(RUN, 7, 1)
    if rank == 0:
        corrupt = _FlipChunk(store, 0, timeout_s=30, chunk_size=1024)
        with pytest.raises(TransferRefused, match=r"chunk\(s\) \[1\] of 3 failed their CRC-32") as refused:
            corrupt.send(key, shards, to_rank=1)
        make_transfer("torch_dist", store=store, rank=0, timeout_s=30, chunk_size=1024).send(key, shards, to_rank=1)
        return str(refused.value)
    transfer = make_transfer("torch_dist", store=store, rank=1, timeout_s=30, chunk_size=1024)
    with pytest.raises(TransferRefused, match=r"chunk\(s\) \[1\] of 3 failed their CRC-32") as refused:
        transfer.receive(key, shards, from_rank=0)
    left = sorted(os.listdir(shards.directory))  # nothing published, no temporary file
    transfer.receive(key, shards, from_rank=0)
    shard = shards.read_shard(ShardKey("own", 1, 7))
    return str(refused.value), left, shard.payload[:2800].view(torch.float32).tolist(), shard.structure


def test_corrupted_chunk_is_refused_and_nothing_is_published(tmp_path):
    sender, receiver = run_ranks(_corrupt_then_retry, 2, str(tmp_path), str(tmp_path / "transfer-store"),
                                 timeout=120)
    reason, left, values, structure = receiver
    assert left == []
    assert "nothing is written" in reason and reason in sender
    assert values == [float(i) for i in range(700)] and structure == STRUCTURE


class _DieMidway(TorchDistTransfer):
    """A sender whose process dies after its first chunk."""

    def outgoing_chunks(self, payload, bounds):
        for tag, chunk in super().outgoing_chunks(payload, bounds):
            if tag == 1:
                os._exit(3)
            yield tag, chunk


def _sender_dies(rank, world, folder, store_path):
    store = dist.FileStore(store_path, world)
    shards = _shard_store(folder, rank)
    key = TransferKey(RUN, 7, 1)
    if rank == 0:
        _DieMidway(store, 0, timeout_s=5, chunk_size=1024).send(key, shards, to_rank=1)
    transfer = make_transfer("torch_dist", store=store, rank=1, timeout_s=5, chunk_size=1024)
    with pytest.raises(TimeoutError, match="did not complete within 5.0s"):
        transfer.receive(key, shards, from_rank=0)
    return sorted(os.listdir(shards.directory))


def test_sender_killed_midway_leaves_nothing_published(tmp_path):
    sender, receiver = run_ranks(_sender_dies, 2, str(tmp_path), str(tmp_path / "transfer-store"), timeout=120,
                                 check=False)
    assert sender.exitcode == 3
    assert receiver.error is None and receiver.result == []
