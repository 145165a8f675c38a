"""lm_resiliency/_torch_compat.py: every private torch name it uses still exists with the shape
it was checked against. A torch upgrade that renames one fails here, naming it, before any
replay or topology quietly breaks. Real objects: a 1-rank gloo DeviceMesh and a fully_shard."""

import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import _torch_compat as compat
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _fail(name: str) -> str:
    return (f"torch {torch.__version__} changed {name} (checked against {compat.TORCH_CHECKED}): "
            "review lm_resiliency/_torch_compat.py")


def test_private_names_exist_on_the_classes():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    assert callable(getattr(DeviceMesh, "_get_root_mesh", None)), _fail("DeviceMesh._get_root_mesh")
    assert callable(getattr(dist.distributed_c10d, "_get_default_store", None)), _fail("_get_default_store")
    assert callable(getattr(FSDPModule, "_get_fsdp_state", None)), _fail("FSDPModule._get_fsdp_state")
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    for name in ("_cast_forward_inputs", "_cast_output_dtype"):
        assert callable(getattr(FSDPState, name, None)), _fail(f"FSDPState.{name}")
    assert list(inspect.signature(FSDPState._cast_forward_inputs).parameters) == ["self", "args", "kwargs"], \
        _fail("FSDPState._cast_forward_inputs(args, kwargs)")


def _on_real_objects(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    assert compat.root_mesh(mesh["tp"]) is mesh, _fail("DeviceMesh._get_root_mesh")
    assert isinstance(compat.default_store(), dist.Store), _fail("_get_default_store")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].register_buffer("cache", torch.zeros(2), persistent=False)
    assert compat.non_persistent_buffer_names(model[1]) == {"cache"}, _fail("Module._non_persistent_buffers_set")
    fully_shard(model[0], mesh=mesh["dp"])
    layer = model[0]
    assert compat.fsdp_grouped_modules(layer) == (layer,), _fail("FSDPState._modules")
    groups = compat.fsdp_param_groups(layer)
    assert groups and all(hasattr(g, "is_sharded") and callable(g.reshard) for g in groups), \
        _fail("FSDPState._fsdp_param_groups")
    slots = compat.fsdp_forward_hook_slots(layer)
    assert sorted(kind for _, _, kind in slots) == ["post", "pre"], \
        _fail("FSDPState._pre/_post_forward_hook_handle ids in the module's hook dicts")
    pre, post = layer._forward_pre_hooks.copy(), layer._forward_hooks.copy()
    for hooks, hook_id, kind in slots:
        hooks[hook_id] = compat.fsdp_cast_hook(layer, kind)
    layer.unshard()
    x = torch.randn(3, 4)
    assert layer(x).shape == (3, 4)  # runs with only the dtype casts in FSDP's places
    layer._forward_pre_hooks.update(pre)
    layer._forward_hooks.update(post)
    grouped = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2))
    fully_shard([grouped[0], grouped[1]], mesh=mesh["dp"])  # TorchTitan's norm + output head
    assert compat.fsdp_grouped_modules(grouped[0]) == (grouped[0], grouped[1]), _fail("FSDPState._modules")
    assert len(compat.fsdp_forward_hook_slots(grouped[1])) == 4, _fail("_MultiHandle.handles")

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    assert "_comm_hooks" in vars(ddp) and "_use_python_reducer" in vars(ddp), \
        _fail("DistributedDataParallel._comm_hooks/_use_python_reducer")
    assert compat.registered_hook_name(ddp) is None and compat.uses_python_reducer(ddp) is False
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    assert compat.registered_hook_name(ddp) == "allreduce_hook", _fail("DistributedDataParallel._comm_hooks")
    return True


def test_private_names_work_on_real_objects():
    assert run_ranks(_on_real_objects, 1, timeout=90) == [True]
