"""A minimal recovery manager for a run started with `lm_resiliency_manager=1` (docs/torchrun.md):
it waits for the first generation, publishes a same-node successor for the next rendezvous round
that loads STEP, and keeps the lease alive for DEADLINE seconds.

    python -m examples.torchrun_manager RDZV_ENDPOINT RUN_ID STEP [DEADLINE]
"""

import logging
import sys
import time

from lm_resiliency.integrations.torchrun import TorchrunRecoveryCoordinator, TorchrunRecoveryRequest


def main() -> None:
    endpoint, run_id, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    deadline = float(sys.argv[4]) if len(sys.argv) > 4 else 300.0
    logging.basicConfig(level=logging.WARNING)
    with TorchrunRecoveryCoordinator.from_endpoint(endpoint, run_id, store_type="file") as manager:
        initial = manager.initial_placement(timeout_s=300)
        print(f"initial generation {initial.generation}: {initial.nodes} node(s)")
        successor = manager.publish_successor(TorchrunRecoveryRequest(
            generation=initial.generation + 1, checkpoint_step=step, trust="latest", deadline_s=deadline,
            reason=f"example manager: resume at step {step}"))
        print(f"published {successor.kind} generation {successor.generation} at step {step}")
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            manager.check_health()
            time.sleep(2)


if __name__ == "__main__":
    main()
