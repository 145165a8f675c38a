"""The built-in torchrun worker adapters, one per framework (see docs/torchrun.md, Built-in
worker adapters); the bootstrap picks one from the framework a worker imports."""

from lm_resiliency.torchrun.workers.deepspeed import DeepSpeedWorkerAdapter
from lm_resiliency.torchrun.workers.megatron import MegatronWorkerAdapter
from lm_resiliency.torchrun.workers.native import NativePyTorchAdapter, NativePyTorchDDPAdapter
from lm_resiliency.torchrun.workers.torchtitan import TorchTitanWorkerAdapter

__all__ = ["DeepSpeedWorkerAdapter", "MegatronWorkerAdapter", "NativePyTorchAdapter", "NativePyTorchDDPAdapter",
           "TorchTitanWorkerAdapter"]
