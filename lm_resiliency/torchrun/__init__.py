"""torchrun integration: the `lm_resiliency` rendezvous backend (agent side) and the zero-import
worker bootstrap (worker side). Users reach it through `lm_resiliency.integrations.torchrun`."""
