"""The `lm-resiliency` command (also `python -m lm_resiliency`).

    lm-resiliency inspect [DISK_FOLDER] [--shared-memory-dir DIR] [--run-id ID [--world-size N]] [--json]
    lm-resiliency timeline RUN_DIR [--run-id ID] [--out PICTURE.png] [--no-picture] [--json]
    lm-resiliency cleanup [--shared-memory-dir DIR] [--disk-folder DIR ...] [--older-than AGE] [--dry-run]
    lm-resiliency discover-moe-regimes --observations ... --environment ... --request ... [--output ...]

Exit status: 0 done; 1 nothing found to show, or (inspect --run-id) nothing a relaunch could
resume from; 2 a usage error; 3 (timeline) the table was printed but the picture could not be
drawn (matplotlib missing). `cleanup` and `discover-moe-regimes` are
`python -m lm_resiliency.cleanup` and `lm-resiliency-discover-moe-regimes`, which keep working;
their options and exit statuses are theirs.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from lm_resiliency.cli import inspect_state, timeline

PROG = "lm-resiliency"
# Subcommands that are whole programs of their own: their arguments are passed through untouched.
_PASSED_THROUGH = {"cleanup": "remove GEMINI state of dead runs on this node (python -m lm_resiliency.cleanup)",
                   "discover-moe-regimes": "build a SCOUT MoE replay catalog from profiler observations "
                                           "(lm-resiliency-discover-moe-regimes)"}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog=PROG, description="See what lm-resiliency keeps on this node and what it did.",
                                  epilog="Run `lm-resiliency <command> --help` for a command's options.")
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    inspect_state.add_arguments(commands.add_parser(
        "inspect", help="every run's GEMINI state on this node and the step a relaunch resumes from",
        description=inspect_state.__doc__))
    timeline.add_arguments(commands.add_parser(
        "timeline", help="a run's launches, recoveries, captures and SCOUT reports, as a table and a picture",
        description=timeline.__doc__))
    for name, text in _PASSED_THROUGH.items():
        commands.add_parser(name, help=text, add_help=False)
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "cleanup":
        from lm_resiliency.cleanup import main as cleanup

        return cleanup(args[1:])
    if args and args[0] == "discover-moe-regimes":
        from lm_resiliency.scout.moe_regimes import main as discover

        return discover(args[1:])
    parsed = parser().parse_args(args)
    if parsed.command == "inspect":
        return inspect_state.run(parsed)
    return timeline.run(parsed)


__all__ = ["main", "parser"]
