"""The house's rules, read off the imports (ast; nothing is run).

* The shard side stands alone: nothing in psserver imports trainer (shards never see a model's code).
* What trainer and shard must agree on lives in one public package, ``psserver.protocol`` (with the shared
  process helpers in ``psserver.common``): trainer imports psserver only through those two.
* The contract is self-contained: ``psserver.protocol`` imports no shard internals, ``psserver.common`` nothing
  else of psserver.
"""

import ast
from pathlib import Path

import psserver
import trainer

PUBLIC = ("psserver.protocol", "psserver.common")


def imported_modules(package) -> list[tuple[str, int, str]]:
    """(file relative to the package's parent, line, dotted module) for every import in the package."""
    root = Path(package.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [f"{node.module}.{a.name}" if node.module in ("psserver", *PUBLIC) else node.module
                         for a in node.names]
            else:
                continue
            found += [(str(path.relative_to(root.parent)), node.lineno, n) for n in names]
    return found


def inside(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_psserver_never_imports_trainer():
    assert [f"{f}:{line} {m}" for f, line, m in imported_modules(psserver) if inside(m, "trainer")] == []


def test_trainer_imports_psserver_only_through_its_public_packages():
    offenders = [f"{f}:{line} {m}" for f, line, m in imported_modules(trainer)
                 if inside(m, "psserver") and not inside(m, *PUBLIC)]
    assert offenders == []


def test_the_contract_imports_no_shard_internals_and_common_imports_nothing_else_of_psserver():
    offenders = []
    for f, line, m in imported_modules(psserver):
        if f.startswith("psserver/protocol/") and inside(m, "psserver") and not inside(m, *PUBLIC):
            offenders.append(f"{f}:{line} {m}")
        if f.startswith("psserver/common/") and inside(m, "psserver") and not inside(m, "psserver.common"):
            offenders.append(f"{f}:{line} {m}")
    assert offenders == []


def test_the_import_scan_sees_the_imports_it_checks():
    """The rules above pass vacuously if the scan finds nothing: it must see trainer's uses of the contract."""
    trainer_imports = {m for _, _, m in imported_modules(trainer)}
    assert "psserver.protocol.job" in trainer_imports and "psserver.protocol.rows.table" in trainer_imports


def test_the_old_sparse_optim_path_still_imports_and_warns_where_it_moved():
    import importlib
    import sys

    import pytest

    sys.modules.pop("psserver.sparse.optim", None)
    with pytest.warns(DeprecationWarning, match="moved to psserver.protocol.rows.optim"):
        old = importlib.import_module("psserver.sparse.optim")
    from psserver.protocol.rows.optim import SparseOptimizerConfig

    assert old.SparseOptimizerConfig is SparseOptimizerConfig


def test_the_library_never_imports_its_measuring_tools():
    offenders = [f"{f}:{line} {m}" for f, line, m in imported_modules(trainer)
                 if not f.startswith("trainer/tools/") and inside(m, "trainer.tools")]
    assert offenders == []
