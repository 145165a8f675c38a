"""The directory the torchrun backend puts first on workers' PYTHONPATH (its sitecustomize)."""
