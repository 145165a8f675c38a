"""`python -m lm_resiliency`: the `lm-resiliency` command (lm_resiliency.cli)."""

import sys

from lm_resiliency.cli import main

sys.exit(main())
