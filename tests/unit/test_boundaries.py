"""The shard side stands alone: nothing in psserver imports trainer (shards never see a model's code)."""

import ast
from pathlib import Path

import psserver


def test_psserver_never_imports_trainer():
    offenders = []
    for path in Path(psserver.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "trainer"]
    assert offenders == []
