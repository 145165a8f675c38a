"""Unchanged training loops for the README's production command (`torchrun --rdzv-backend=lm_resiliency
... --module examples.production_loops.<framework>`); none of them imports lm_resiliency."""
