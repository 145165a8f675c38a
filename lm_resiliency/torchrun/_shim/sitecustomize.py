"""lm-resiliency's torchrun worker shim. The `lm_resiliency` rendezvous backend puts this
directory first on PYTHONPATH when `lm_resiliency_worker_config` is set, so each worker runs the
zero-import bootstrap before its user module. Any sitecustomize this one shadows still runs."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_shadowed_sitecustomize() -> None:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    this = sys.modules.pop("sitecustomize")
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401 - the next one on sys.path, if any
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
    finally:
        sys.modules["sitecustomize"] = this  # the import system finishes importing this module


def _start() -> None:
    # The package this shim belongs to, even when the agent found it outside PYTHONPATH.
    root = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
    try:
        import lm_resiliency  # noqa: F401
    except ImportError:
        sys.path.append(root)
    from lm_resiliency.torchrun.bootstrap import start

    start()


_run_shadowed_sitecustomize()
_start()
