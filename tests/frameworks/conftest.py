import importlib.util

import pytest


@pytest.fixture(scope="session")
def deepspeed_zygote():
    """One process that imported DeepSpeed (and Accelerate), shared by every test that forks DeepSpeed
    ranks from it: test_deepspeed.py and Accelerate's DeepSpeed integration in test_accelerate.py."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    from tests.frameworks.deepspeed_workloads import DeepSpeedZygote

    process = DeepSpeedZygote()
    yield process
    process.close()
