"""Stable torchrun entry points: the `lm_resiliency` rendezvous backend (registered through the
`torchrun.handlers` entry point), node identity, and what a torchrun worker knows about its
generation, the built-in worker adapters, and the recovery coordinator external managers use.
See docs/torchrun.md."""

from lm_resiliency.torchrun.coordinator import (TorchrunInitialPlacement, TorchrunRecoveryCoordinator,
                                                TorchrunRecoveryRequest, TorchrunSuccessorPlacement)
from lm_resiliency.torchrun.identity import derive_torchrun_node_id
from lm_resiliency.torchrun.launch import TorchrunLaunchConfig
from lm_resiliency.torchrun.plugin import create_rendezvous_handler, get_rendezvous_handler_creator
from lm_resiliency.torchrun.workers import (DeepSpeedWorkerAdapter, MegatronWorkerAdapter, NativePyTorchAdapter,
                                            NativePyTorchDDPAdapter, TorchTitanWorkerAdapter)
from lm_resiliency.torchrun.worker import (TorchrunWorkerAdapter, TorchrunWorkerAdapterError, TorchrunWorkerContext,
                                           get_torchrun_worker_context)

__all__ = ["create_rendezvous_handler", "get_rendezvous_handler_creator", "derive_torchrun_node_id",
           "TorchrunWorkerAdapter", "TorchrunWorkerAdapterError", "TorchrunWorkerContext",
           "get_torchrun_worker_context", "TorchrunLaunchConfig", "TorchrunRecoveryCoordinator",
           "TorchrunRecoveryRequest", "TorchrunInitialPlacement", "TorchrunSuccessorPlacement",
           "NativePyTorchAdapter", "NativePyTorchDDPAdapter", "DeepSpeedWorkerAdapter", "TorchTitanWorkerAdapter",
           "MegatronWorkerAdapter"]
