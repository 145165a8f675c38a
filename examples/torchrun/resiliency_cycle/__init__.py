"""The torchrun resiliency cycle (see docs/torchrun.md, "The resiliency cycle")."""
