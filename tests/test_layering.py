"""The package's import direction, read with `ast` (no module is imported, torch is not needed).

Layers, highest first; a module may import its own layer or lower ones, never a higher one:

    surface   lm_resiliency (root), api, integrations.*, experimental, callbacks.*, torchrun.*, cli.*,
              __main__
    adapters  adapters.*
    session   session, attach, settings, adapter (the framework contract), cleanup, faults.*,
              inventory, recovered_state, session_activity
    engine    gemini.*, scout.*, trust.*, manager_api.*  (gemini, scout and trust never import
              each other; trust reaches GEMINI's storage through its StatusStore protocol and
              SCOUT's results through its ReplayEvidence protocol)
    core      wire, codec, files, config, tensor_bytes, checksum, recovery, payload, _values, wrappers,
              _torch_compat, events, log_level, errors

Imports inside functions count as much as module-level ones, and no two modules may import each
other, directly or through others (a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
# adapters/ and callbacks/ live at the top of the repository and install inside lm_resiliency.
SOURCES = {"lm_resiliency": ROOT / "lm_resiliency", "lm_resiliency.adapters": ROOT / "adapters",
           "lm_resiliency.callbacks": ROOT / "callbacks"}

LAYERS = ("core", "engine", "session", "adapters", "surface")
_PREFIXES = (
    ("lm_resiliency.callbacks", "surface"), ("lm_resiliency.integrations", "surface"),
    ("lm_resiliency.api", "surface"), ("lm_resiliency.experimental", "surface"),
    ("lm_resiliency.torchrun", "surface"), ("lm_resiliency.cli", "surface"), ("lm_resiliency.__main__", "surface"),
    ("lm_resiliency.adapters", "adapters"),
    ("lm_resiliency.session", "session"), ("lm_resiliency.attach", "session"),
    ("lm_resiliency.settings", "session"),
    ("lm_resiliency.adapter", "session"), ("lm_resiliency.cleanup", "session"),
    ("lm_resiliency.faults", "session"), ("lm_resiliency.inventory", "session"),
    ("lm_resiliency.recovered_state", "session"), ("lm_resiliency.session_activity", "session"),
    ("lm_resiliency.gemini", "engine"), ("lm_resiliency.scout", "engine"),
    ("lm_resiliency.trust", "engine"), ("lm_resiliency.manager_api", "engine"),
)
CORE = {"lm_resiliency.wire", "lm_resiliency.codec", "lm_resiliency.files", "lm_resiliency.config",
        "lm_resiliency.tensor_bytes", "lm_resiliency.checksum", "lm_resiliency.recovery", "lm_resiliency._values",
        "lm_resiliency.wrappers", "lm_resiliency._torch_compat", "lm_resiliency.payload", "lm_resiliency.events",
        "lm_resiliency.log_level", "lm_resiliency.errors"}
# Engine packages that never import one another (source, target). The manager API may use
# trust's RecoveryDecision builder; the session layer joins the engines.
APART = (("gemini", "scout"), ("scout", "gemini"), ("gemini", "trust"), ("scout", "trust"),
         ("trust", "gemini"), ("trust", "scout"), ("trust", "manager_api"))


def modules() -> Dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def layer(module: str) -> str:
    if module == "lm_resiliency":
        return "surface"
    if module in CORE:
        return "core"
    for prefix, name in _PREFIXES:
        if module == prefix or module.startswith(prefix + "."):
            return name
    raise AssertionError(f"{module} is in no layer: add it to tests/test_layering.py (and docs/architecture.md)")


def imports(module: str, path: Path, known: Set[str]) -> Iterator[Tuple[str, int]]:
    """(imported lm_resiliency module, line) for every import in the file, nested ones included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the submodule; `from mod import name` the module.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            if name == "lm_resiliency" or name.startswith("lm_resiliency."):
                while name not in known:
                    name = name.rpartition(".")[0]
                yield name, node.lineno


def graph() -> Dict[str, Dict[str, int]]:
    found = modules()
    known = set(found)
    edges: Dict[str, Dict[str, int]] = {}
    for module, path in found.items():
        edges[module] = {}
        for target, line in imports(module, path, known):
            if target != module and not module.startswith(target + "."):  # a package's own __init__
                edges[module].setdefault(target, line)
    return edges


def test_every_import_goes_down_the_layers() -> None:
    wrong: List[str] = []
    for source, targets in sorted(graph().items()):
        for target, line in sorted(targets.items()):
            if LAYERS.index(layer(target)) > LAYERS.index(layer(source)):
                wrong.append(f"{source}:{line} ({layer(source)}) imports {target} ({layer(target)})")
    assert not wrong, "imports against the layer direction:\n" + "\n".join(wrong)


def _in(module: str, package: str) -> bool:
    return module == f"lm_resiliency.{package}" or module.startswith(f"lm_resiliency.{package}.")


def test_engines_stay_apart() -> None:
    wrong = [f"{source}:{line} imports {target}" for source, targets in sorted(graph().items())
             for target, line in sorted(targets.items())
             for a, b in APART
             if _in(source, a) and _in(target, b)]
    assert not wrong, "GEMINI, SCOUT and trust are separate engines:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:
    edges = graph()
    cycles: List[str] = []
    state: Dict[str, int] = {}  # 1 on the current path, 2 finished
    path: List[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, {})):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_every_module_has_a_layer() -> None:
    for module in modules():
        assert layer(module) in LAYERS
