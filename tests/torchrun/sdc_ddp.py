"""examples/torchrun_ddp.py (which never imports lm_resiliency) with a hidden SDC: in a generation
that started fresh, global rank SDC_RANK silently corrupts one of its own weights after optimizer
step SDC_STEP, like a bit flip in memory. Training goes on, and the all-reduce spreads the damage.
With `hang`, that rank blocks forever after the step instead (its peers wait in the next all-reduce).

    torchrun ... --module tests.torchrun.sdc_ddp OUT_DIR STEPS [SDC_RANK SDC_STEP [hang]]

Every rank also writes OUT_DIR/start-<pid>.json: the step its generation started from and its
node slot."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from examples import torchrun_ddp


def _corrupt_after(sdc_rank: int, sdc_step: int, hang: bool) -> None:
    seen = {"optimizer": None, "steps": 0}

    def after_step(optimizer, args, kwargs) -> None:
        # The training optimizer steps first; any other one (a replay copy) is not counted.
        if seen["optimizer"] is None:
            seen["optimizer"] = optimizer
        if optimizer is not seen["optimizer"]:
            return
        seen["steps"] += 1
        if dist.get_rank() == sdc_rank and seen["steps"] == sdc_step:
            while hang:
                time.sleep(1.0)
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].view(-1)[3] += 0.5

    register_optimizer_step_post_hook(after_step)


def main() -> None:
    out_dir = sys.argv[1]
    start = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0"))
    with open(os.path.join(out_dir, f"start-{os.getpid()}.json"), "w") as f:
        json.dump({"start": start, "group_rank": int(os.environ["GROUP_RANK"])}, f)
    if len(sys.argv) > 4 and start == 0:
        _corrupt_after(int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:6] == ["hang"])
    sys.argv[3:] = []  # the example's own fault knobs stay off
    torchrun_ddp.main()


if __name__ == "__main__":
    main()
