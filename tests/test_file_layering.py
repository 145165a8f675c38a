"""Every file and record goes through `lm_resiliency.files` (read with `ast`, nothing imported).

Library code (lm_resiliency/, adapters/, callbacks/) outside files.py never calls the raw file
and JSON primitives below: a document from another process, the store, shared memory or disk is
read by the record layer (`parse_record`/`read_record`, a declared RecordSchema, file trust, a
size bound), published by `atomic_write`, and a private directory comes from
`ensure_private_dir`/`open_private_dir`. Each exception below says why the call is not a record.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

from tests.test_layering import modules

# The calls no library module makes outside files.py ("open" is the builtin).
RAW_CALLS = frozenset({"open", "io.open", "json.loads", "json.load", "os.replace", "os.rename", "os.makedirs",
                       "os.mkdir"})
FILES = "lm_resiliency.files"
# (module, call) -> why that module may make the call.
EXCEPTIONS: Dict[Tuple[str, str], str] = {
    ("lm_resiliency.gemini.storage", "open"): "reads /proc (the boot id, process start times), not a record",
    ("lm_resiliency.gemini.shm", "os.rename"): "renames a whole rank directory (publishing a new one with its "
                                               "owner record, retiring one before removal); its files go "
                                               "through files.atomic_write",
    ("lm_resiliency.events", "os.replace"): "rotates the append-only event log (a complete file renamed aside, "
                                            "not a record being published)",
    ("lm_resiliency.faults.checkpoint_faults", "open"): "a fault executor reads a shard's zip header to corrupt "
                                                         "that shard on purpose",
    ("lm_resiliency.faults.local_executor", "open"): "a fault executor fills a file in its own sandbox on purpose "
                                                     "(the disk exhaustion fault)",
}


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return ""


def raw_calls(path: Path) -> Iterator[Tuple[str, int]]:
    """(raw primitive, line) for each call of one in the file, including names imported from the
    module that defines them (`from os import replace`)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {alias.asname or alias.name: f"{node.module}.{alias.name}"
               for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module in ("os", "json", "io")
               for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _name(node.func)
            name = aliases.get(name, name)
            if name in RAW_CALLS:
                yield name, node.lineno


def found() -> Dict[Tuple[str, str], List[int]]:
    calls: Dict[Tuple[str, str], List[int]] = {}
    for module, path in sorted(modules().items()):
        if module != FILES:
            for name, line in raw_calls(path):
                calls.setdefault((module, name), []).append(line)
    return calls


def test_files_and_records_go_through_the_record_layer() -> None:
    wrong = [f"{module}:{','.join(map(str, lines))} calls {name}" for (module, name), lines in sorted(found().items())
             if (module, name) not in EXCEPTIONS]
    assert not wrong, ("raw file/JSON calls outside lm_resiliency.files (read records with parse_record/read_record "
                       "and a RecordSchema, publish with atomic_write, make private directories with "
                       "ensure_private_dir; or add an exception with its reason):\n" + "\n".join(wrong))


def test_every_exception_is_still_needed_and_says_why() -> None:
    calls = found()
    stale = [f"{module} no longer calls {name}: remove its exception" for module, name in sorted(EXCEPTIONS)
             if (module, name) not in calls]
    assert not stale, "\n".join(stale)
    assert all(len(reason) > 20 for reason in EXCEPTIONS.values())


def test_the_scan_sees_every_form_of_a_raw_call(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text("import json, os\nfrom os import replace as swap\nopen('x')\njson.loads('1')\nswap('a', 'b')\n"
                      "os.makedirs('d')\nos.open('x', 0)\nfiles.open_owned('x')\n")
    assert sorted(raw_calls(source)) == [("json.loads", 4), ("open", 3), ("os.makedirs", 6), ("os.replace", 5)]
