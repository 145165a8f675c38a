"""A worker module that imports two higher-level frameworks (TorchTitan, then DeepSpeed)."""

import torchtitan  # noqa: F401
import deepspeed  # noqa: F401
