"""The wheel installs everything under lm_resiliency/ (adapters and callbacks included, and the py.typed
marker) and nothing else."""

import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source_packages():
    found = set()
    for top, dotted in (("lm_resiliency", "lm_resiliency"), ("adapters", "lm_resiliency.adapters"),
                        ("callbacks", "lm_resiliency.callbacks")):
        for path, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files and "__pycache__" not in path:
                relative = os.path.relpath(path, os.path.join(ROOT, top))
                found.add(dotted if relative == "." else dotted + "." + relative.replace(os.sep, "."))
    return found


@pytest.mark.timeout(300)
def test_wheel_contains_every_package_and_nothing_at_the_top(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), ROOT], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert all(t == "lm_resiliency" or t.startswith("lm_resiliency-") for t in tops), tops
    packaged = {os.path.dirname(n).replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packaged == _source_packages()
    assert "lm_resiliency/py.typed" in names  # PEP 561: downstream type checkers read our annotations
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = zipfile.ZipFile(tmp_path / wheel).read(entry_points).decode()
    assert "lm-resiliency = lm_resiliency.cli:main" in scripts  # the command line, beside `python -m lm_resiliency`
    assert "lm-resiliency-discover-moe-regimes = lm_resiliency.scout.moe_regimes:main" in scripts
