"""TorchrunLaunchConfig builds the arguments torchrun parses back into the same rendezvous."""

from __future__ import annotations

import pytest
from torch.distributed.run import config_from_args, get_args_parser

from lm_resiliency.integrations.torchrun import TorchrunLaunchConfig


def test_arguments_round_trip_through_torchruns_own_parser():
    config = TorchrunLaunchConfig(run_id="pytorch-example", endpoint="node-a:29400",
                                  restart_context_path="/tmp/lmr/context.json", min_nodes=1, max_nodes=2,
                                  nproc_per_node=8, max_restarts=4, worker_config="/etc/lmr/worker.toml",
                                  rdzv_conf={"read_timeout": "120"})
    argv = config.arguments(["--module", "examples.train", "--steps", "10"])
    launch, entrypoint, args = config_from_args(get_args_parser().parse_args(argv))
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node, launch.max_restarts) == (1, 2, 8, 4)
    assert (launch.rdzv_backend, launch.rdzv_endpoint, launch.run_id) == ("lm_resiliency", "node-a:29400",
                                                                          "pytorch-example")
    assert launch.rdzv_configs["store_type"] == "tcp" and launch.rdzv_configs["read_timeout"] == "120"
    assert launch.rdzv_configs["lm_resiliency_restart_context_path"] == "/tmp/lmr/context.json"
    assert launch.rdzv_configs["lm_resiliency_worker_config"] == "/etc/lmr/worker.toml"
    assert args[-4:] == ["-m", "examples.train", "--steps", "10"]


@pytest.mark.parametrize("change, field", [
    ({"max_nodes": 0}, "max_nodes"), ({"nproc_per_node": 0}, "nproc_per_node"), ({"max_restarts": -1}, "max_restarts"),
    ({"store_type": "etcd"}, "store_type"), ({"run_id": "a,b"}, "run_id"),
    ({"restart_context_path": "relative/context.json"}, "restart_context_path"),
    ({"worker_config": "/etc/with space.toml"}, "worker_config"),
    ({"rdzv_conf": {"store_type": "file"}}, "rdzv_conf"), ({"rdzv_conf": {"join_timeout": "1,2"}}, "rdzv_conf"),
])
def test_bad_values_raise_naming_the_field(change, field):
    arguments = {"run_id": "r", "endpoint": "/tmp/rdzv", "restart_context_path": "/tmp/c/context.json", **change}
    with pytest.raises(ValueError, match=f"TorchrunLaunchConfig.{field}"):
        TorchrunLaunchConfig(**arguments)
