"""failure -> localization -> recovery on one CPU machine: what `make demo` runs.

    python examples/resiliency_demo.py [--out demo-output] [--no-plot]

Four CPU ranks (gloo) train a small model with GEMINI and SCOUT attached by `enable_resiliency`;
a built-in fault campaign (`enable_fault_injection`) injects a hidden-layer SDC, a compute
straggler, a corrupted node-local checkpoint shard, a killed rank and a hang. SCOUT (and the
supervisor, and GEMINI's integrity check) localize them, a small supervisor relaunches the ranks
after each failure, and GEMINI recovers them. The demo ends with a table, the campaign metrics
of the kit's `evaluate`, `<out>/report.json`, `<out>/timeline.png`, and a bitwise comparison of
the recovered run's final state with an uninterrupted baseline run.

The implementation is the package next to this file (`examples/resiliency_demo/`); see
docs/fault_injection.md, "Demo", for how to read its output.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from resiliency_demo.cli import main  # (the package directory beside this script)

if __name__ == "__main__":
    sys.exit(main())
