"""Every exception the library defines derives from `ResiliencyError` (exported from the package root)
and keeps the builtin base users already catch."""

import importlib
import inspect
import pkgutil

import lm_resiliency
from lm_resiliency import ConfigError, RecoveryUnavailable, ResiliencyError
from lm_resiliency.torchrun.retirement import NodeRetired

# Not user-facing failures: a retired node's and a released standby's agent exits, and the sweep's private control-flow signals.
OUTSIDE = {"lm_resiliency.torchrun.retirement.NodeRetired", "lm_resiliency.torchrun.backend.StandbyReleased", "lm_resiliency.scout.sweep._Incomplete",
           "lm_resiliency.scout.sweep._NotRun"}
SKIPPED_MODULES = ("lm_resiliency.__main__", "lm_resiliency.torchrun._shim")  # run as programs, not imported


def _library_exceptions():
    modules = ["adapters.accelerate", "adapters.lightning"] + [
        m.name for m in pkgutil.walk_packages(lm_resiliency.__path__, "lm_resiliency.")
        if not m.name.startswith(SKIPPED_MODULES)]
    found = {}
    for name in modules:
        module = importlib.import_module(name if name.startswith("lm_resiliency") else f"lm_resiliency.{name}")
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_library_exception_derives_from_the_one_base():
    found = _library_exceptions()
    assert len(found) > 40
    outside = sorted(name for name, cls in found.items() if not issubclass(cls, ResiliencyError))
    assert outside == sorted(OUTSIDE)


def test_the_builtin_bases_users_catch_are_kept():
    assert issubclass(ConfigError, ValueError) and issubclass(RecoveryUnavailable, RuntimeError)
    assert issubclass(NodeRetired, SystemExit)
    assert "ResiliencyError" in lm_resiliency.__all__
