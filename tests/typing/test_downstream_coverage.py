"""The downstream typing script (checked by mypy in `make lint`) uses every name the package root exports,
so an export that degrades to `Any` or changes type cannot go unnoticed."""

import ast
import os

import lm_resiliency

DOWNSTREAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "downstream.py")


def test_the_downstream_script_uses_every_export():
    tree = ast.parse(open(DOWNSTREAM, encoding="utf-8").read(), DOWNSTREAM)
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "lm_resiliency" for alias in node.names}
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert sorted(set(lm_resiliency.__all__) - imported) == []
    assert sorted(imported - used) == []   # imported and then used with its type
