"""The house's rules, read off the imports (ast; nothing is run).

* The shard side stands alone: nothing in psserver imports trainer (shards never see a model's code).
* What trainer and shard must agree on lives in one public package, ``psserver.protocol`` (with the shared
  process helpers in ``psserver.common``): trainer imports psserver only through those two.
* The contract is self-contained: ``psserver.protocol`` imports no shard internals, ``psserver.common`` nothing
  else of psserver.
* Arrows run one way: no import cycle among psserver's modules, nor among trainer's (type-only and deferred
  imports included); psserver's wings are floors, each importing only the ones below it (``WINGS``).
* Collaborators are handed what they call and offer public methods: no psserver or trainer method reaches
  through an object it holds (``self.x._y``) into that object's private members, and no trainer library code reads
  or calls another object's private member at all (``shard._call(...)``, ``s._count(...)``).
"""

import ast
from pathlib import Path

import pytest

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


def test_the_library_never_imports_its_measuring_tools():
    offenders = [f"{f}:{line} {m}" for f, line, m in imported_modules(trainer)
                 if not f.startswith("trainer/tools/") and inside(m, "trainer.tools")]
    assert offenders == []


def module_graph(package) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (anywhere in the file: under TYPE_CHECKING, in a function)."""
    root = Path(package.__file__).parent
    modules = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str:  # the module a dotted name lives in: itself, or the nearest enclosing module
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            targets |= {owner(n) for n in names if inside(n, package.__name__)}
        graph[module] = targets - {module, ""}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle's modules (the strongly connected components with more than one module; Tarjan's)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_psserver_has_no_import_cycle():
    assert import_cycles(module_graph(psserver)) == []


# psserver's wings from the ground up: a wing imports the contract, the common helpers and the wings below it.
WINGS = ("state", "sparse", "members", "partition", "resharding", "serving", "replication")


# trainer's wings from the ground up (its tools, above them all, are the measuring tools: a user's view).
TRAINER_WINGS = ("channels", "tables", "membership", "stepping", "workloads", "running", "local")


def wing_offenders(package, wings: tuple[str, ...]) -> list[str]:
    """Imports of ``package``'s modules that reach a wing above their own."""
    floor = {w: k for k, w in enumerate(wings)}
    offenders = []
    for f, line, m in imported_modules(package):
        parts = f.split("/")
        if len(parts) < 3 or parts[1] not in floor:
            continue
        target = m.split(".")
        if inside(m, package.__name__) and len(target) > 1 and target[1] in floor and \
                floor[target[1]] > floor[parts[1]]:
            offenders.append(f"{f}:{line} {m}")
    return offenders


def wings_on_disk(package, others: tuple[str, ...]) -> set[str]:
    return {p.name for p in Path(package.__file__).parent.iterdir() if p.is_dir() and p.name not in
            (*others, "__pycache__")}


def test_psserver_wings_import_only_the_wings_below_them():
    assert wing_offenders(psserver, WINGS) == []
    assert wings_on_disk(psserver, ("protocol", "common")) == set(WINGS)  # a new wing takes its floor here


def test_trainer_wings_import_only_the_wings_below_them_and_no_module_sits_outside_a_wing():
    assert wing_offenders(trainer, TRAINER_WINGS) == []
    assert wings_on_disk(trainer, ("tools",)) == set(TRAINER_WINGS)  # a new wing takes its floor here
    root = Path(trainer.__file__).parent
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py"]  # (what users import: trainer/__init__)


def test_the_wing_rule_sees_an_import_upward():
    """The rules above pass vacuously if the scan misses an arrow from a lower wing to a higher one."""
    assert wing_offenders(trainer, tuple(reversed(TRAINER_WINGS)))  # (every real arrow upward, read reversed)


def test_trainer_has_no_import_cycle():
    """(trainer.tables.sparse_client and trainer.tables.table_window imported each other: the errors they share are a room of
    their own now, trainer.tables.row_errors.)"""
    assert import_cycles(module_graph(trainer)) == []


def test_the_cycle_finder_finds_a_cycle_and_the_graph_holds_the_arrows_it_checks():
    """The test above passes vacuously if the scan sees no arrows or the finder misses cycles."""
    graph = module_graph(psserver)
    assert "psserver.state.metrics" in graph["psserver.partition.shard"] and "psserver.state.stats" in graph["psserver.state.metrics"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", [psserver, trainer], ids=["psserver", "trainer"])
def test_no_library_method_reaches_into_a_collaborators_private_members(package):
    root = Path(package.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts or "proto" in path.relative_to(root).parts:
            continue  # generated code
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
                    and node.value.value.id == "self"):
                offenders.append(f"{path.relative_to(root.parent)}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []


def private_reads_of_others(root: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Every read or call of a private member (``x._y``, ``x.y._z``) whose object is not ``self`` or ``cls`` under
    ``root``, outside the folders ``skip`` names."""
    offenders = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if "__pycache__" in path.parts or "proto" in parts or parts[0] in skip:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                offenders.append(f"{path.relative_to(root.parent)}:{node.lineno} {ast.unparse(node)}")
    return offenders


def test_no_trainer_library_code_reads_or_calls_another_objects_private_members():
    """(The measuring tools, trainer/tools, instrument the library's internals on purpose and are left out.)"""
    assert private_reads_of_others(Path(trainer.__file__).parent, skip=("tools",)) == []


def test_no_psserver_library_code_reads_or_calls_another_objects_private_members():
    """Two kinds are not another object's: the standard library's own (``os._exit`` after a fork,
    ``argparse._StoreTrueAction`` to read a flag's kind) and, in the re-shard source's machine, ``s``: a copy of
    ``self`` that ``dataclasses.replace`` made (frozen states: each transition returns a new one)."""
    import sys

    def allowed(offender: str) -> bool:
        where, expr = offender.split(" ", 1)
        base = expr.split(".", 1)[0]
        return base in sys.stdlib_module_names or (where.startswith("psserver/resharding/handoff/source.py:")
                                                    and base == "s")

    offenders = private_reads_of_others(Path(psserver.__file__).parent)
    assert [o for o in offenders if not allowed(o)] == []


def test_the_private_read_rule_sees_a_call_of_another_objects_private_method(tmp_path):
    """The rule above passes vacuously if the scan misses ``other._call(...)``: it must flag it, and not ``self``'s."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("def f(shard, self):\n    self._own()\n    return shard._call('x')\n")
    assert private_reads_of_others(tmp_path / "pkg") == ["pkg/m.py:3 shard._call"]


def _user_code() -> list[tuple[str, str]]:
    """(where, code) of what users copy: README's and the docs' python blocks, and docs/examples/."""
    root = Path(trainer.__file__).parent.parent
    found = [(str(p.relative_to(root)), p.read_text()) for p in sorted((root / "docs" / "examples").glob("*.py"))]
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for k, block in enumerate(page.read_text().split("```python")[1:]):
            found.append((f"{page.relative_to(root)} block {k + 1}", block.split("```")[0]))
    return found


def test_what_users_write_imports_the_trainer_package_not_the_servers():
    """A user's script imports connect, the tables and their optimizers and initialisers from ``trainer``; a path
    into ``psserver`` would tie it to the server's layout (issue 36 item 5)."""
    code = _user_code()
    assert len(code) > 3  # the scan sees the README's and the docs' examples
    offenders = [where for where, text in code
                 if any(inside(m, "psserver") for m in _imports_in(text))]
    assert offenders == []


def _imports_in(text: str) -> list[str]:
    try:
        tree = ast.parse(text)
    except SyntaxError:  # a fragment (a signature, an elided body): its import lines alone
        tree = ast.parse("\n".join(line for line in text.splitlines() if line.startswith(("import ", "from "))))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_the_public_names_import_from_trainer():
    import trainer as package

    for name in package.__all__:
        assert getattr(package, name) is not None, name
