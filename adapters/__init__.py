"""Framework adapters: where each framework keeps state and process groups (lm_resiliency.adapters)."""
