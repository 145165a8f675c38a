"""Rank functions for SCOUT on FSDP2, HSDP and DP x TP models (module-level for child ranks).

Every run trains `scout_workloads.TinyLM` (Embedding -> 3 Blocks with dropout -> Linear) through
`enable_resiliency`, with embedding, blocks, head and the root `fully_shard`-ed (FSDP2 on a 1-D
mesh; HSDP on a 2x2 mesh, with each block's Linear sharded on its own as well), or with
`parallelize_module` tensor parallelism over the 'tp' dimension of a ('dp', 'tp') mesh. A fault
is a test-side forward (or full backward) hook on ONE rank's sampled hidden layer.
Each run is repeated without SCOUT in the same processes: the two must train bitwise alike.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import InMemoryCkptConfig, ReplayHarnessConfig, enable_resiliency
from lm_resiliency.scout.reports import replay_fault_reports
from tests.distributed import scout_workloads as w


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _build(kind: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    model = w.make_model()
    world = dist.get_world_size()
    if kind == "tp":
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.layers:
            parallelize_module(block, mesh["tp"], {"lin": ColwiseParallel(output_layouts=Replicate())})
        parallelize_module(model, mesh["tp"], {"head": RowwiseParallel(input_layouts=Replicate())})
        return model
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,)) if kind == "fsdp2" else \
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    # Every parameter in a child FSDP module: GEMINI reads state_dict() in the model's forward pre-hook,
    # after FSDP's root pre-forward, and that read reshards the root's own parameters.
    if kind == "hsdp":  # nested: a block's replay also unshards the FSDP module below it
        for block in model.layers:
            fully_shard(block.lin, mesh=mesh)
    for child in (model.emb, *model.layers, model.head):
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _dp_group(kind: str) -> Optional[dist.ProcessGroup]:
    """TP: gradients are averaged by hand over the 'dp' dimension (FSDP reduces its own)."""
    if kind != "tp":
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(tp, world, 2))) for tp in range(2)]
    return groups[rank % 2]


def _average(model: nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    if group is None:
        return
    size = dist.get_world_size(group)
    for p in model.parameters():
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(local, group=group)
        local.div_(size)


def _fsdp_state(model: nn.Module) -> List[Any]:
    """Per FSDP module: its groups' sharded state and training state, and the identity of the
    parameters registered on its submodules (sharded DTensors vs unsharded tensors)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            out.append(([(str(g._sharded_state), str(g._training_state), len(g.comm_ctx.post_forward_order))
                         for g in state._fsdp_param_groups], str(state._training_state)))
    out.append([(n, id(p)) for n, p in model.named_parameters()])
    return out


def _snapshot(model: nn.Module) -> Any:
    params = [(n, _local(p)) for n, p in model.named_parameters()]
    grads = [(n, None if p.grad is None else _local(p.grad)) for n, p in model.named_parameters()]
    return params, grads, _fsdp_state(model), torch.get_rng_state()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            bool(torch.equal(_bytes(a), _bytes(b)))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _train_once(rank: int, kind: str, steps: int, folder: Optional[str], fault_rank: Optional[int],
                fault_step: int, fault: str = "sign_flip") -> Dict[str, Any]:
    torch.manual_seed(0)
    model = _build(kind)
    group = _dp_group(kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    results: Dict[int, Any] = {}
    unchanged: List[int] = []
    session = None
    if folder is not None:
        before: Dict[str, Any] = {}
        # Registered before the session's hook: runs before SCOUT's replay; the one after, after it.
        optimizer.register_step_pre_hook(lambda *a: before.update(state=_snapshot(model)))
        session = enable_resiliency(
            model, optimizer, interval=2,
            checkpoint=InMemoryCkptConfig(disk_folder=folder, run_id=f"scout-{kind}", timeout_s=60),
            replay=ReplayHarnessConfig(hang_stall_threshold_s=120, monitor_poll_interval_s=0.5))

        def after_replay(*a):
            result = session.last_replay_result
            if result is not None and result.step == session.step_count + 1:
                results[result.step] = result
                if _equal(before["state"], _snapshot(model)):
                    unchanged.append(result.step)

        optimizer.register_step_pre_hook(after_replay)
    losses = []
    for step in range(1, steps + 1):
        if rank == fault_rank and step == fault_step:
            path = session.scout.detector.sampled("hidden", step)[0]
            target = model.get_submodule(path)
            if fault in w.BACKWARD_FAULTS:
                target.register_full_backward_hook(w.BACKWARD_FAULTS[fault])
            else:
                target.register_forward_hook(w.FAULTS[fault], with_kwargs=True)
        loss = model(w._batch(rank if group is None else rank // 2, step)).pow(2).mean()
        loss.backward()
        _average(model, group)
        losses.append(loss.detach().clone())
        optimizer.step()
        optimizer.zero_grad()
    final = [(n, _local(p)) for n, p in model.named_parameters()]
    out: Dict[str, Any] = {"losses": losses, "final": final}
    if session is not None:
        detector = session.scout.detector
        out.update(results={s: (r, replay_fault_reports(r)) for s, r in results.items()}, unchanged=unchanged,
                   group_ranks=None if detector is None else detector.group_ranks,
                   topology=session.adapter.topology().descriptor,
                   certified=session.ledger is not None and session.ledger.verified_steps())
        session.close()
    return out


def faulty_shadow_step(rank: int, world: int, kind: str, folder: str, fault_rank: int) -> Dict[str, Any]:
    """One rank's device corrupts optimizer updates, seen only in SCOUT's shadow step (a
    global optimizer post-step hook that skips the live optimizer): the optimizer check, which
    every peer runs on the source's shard slice, must name that rank."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def corrupt(optimizer, args, kwargs):
        if len(optimizer.param_groups[0]["params"]) == 1:  # the shadow optimizer holds one slice
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].view(-1)[0] += 1e-3

    handle = register_optimizer_step_post_hook(corrupt) if rank == fault_rank else None
    try:
        return _train_once(rank, kind, 2, folder, None, 0)
    finally:
        if handle is not None:
            handle.remove()


def sharded_run(rank: int, world: int, kind: str, folder: str, steps: int, fault_rank: Optional[int] = None,
                fault_step: int = 0, fault: str = "sign_flip") -> Dict[str, Any]:
    """Train with SCOUT (checks every 2 steps), then the same run without it; report both."""
    with_scout = _train_once(rank, kind, steps, folder, fault_rank, fault_step, fault)
    without = _train_once(rank, kind, steps, None, None, 0) if fault_rank is None else None
    with_scout["bitwise_equal_to_plain"] = None if without is None else (
        _equal(with_scout["losses"], without["losses"]) and _equal(with_scout["final"], without["final"]))
    del with_scout["losses"], with_scout["final"]
    return with_scout


def unknown_layout(rank: int, world: int, folder: str) -> Dict[str, Any]:
    """A parameter on a ('dp', 'pp') mesh: SCOUT must not guess peers. Returns what the session did."""
    import logging

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "pp"))
    model = w.make_model()
    model.head.weight = nn.Parameter(distribute_tensor(model.head.weight.detach(), mesh["dp"], [Replicate()]))
    warnings: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("lm_resiliency.scout.harness").addHandler(handler)
    session = enable_resiliency(
        model, torch.optim.SGD(model.parameters(), lr=0.1), interval=2,
        checkpoint=InMemoryCkptConfig(disk_folder=folder, run_id="scout-unknown", timeout_s=60),
        replay=ReplayHarnessConfig(hang_stall_threshold_s=120, monitor_poll_interval_s=0.5))
    out = {"detector": session.scout.detector is not None, "ledger": session.ledger is not None,
           "monitor": session.scout.monitor is not None, "warnings": warnings}
    session.close()
    return out
