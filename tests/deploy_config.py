"""Read deploy/docker-compose.yml the way Compose does (resolved by `docker-compose config`)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import yaml

from psserver.codegen import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "deploy" / "docker-compose.yml"
K8S_DIR = REPO_ROOT / "deploy" / "k8s"


def compose_cli() -> str | None:
    return shutil.which("docker-compose")


def resolved_compose(env: dict | None = None, path=None) -> dict:
    """The compose file (or ``path``) with anchors, merges and ${VAR:-default} resolved, by Debian's
    docker-compose."""
    exe = compose_cli()
    if exe is None:
        raise FileNotFoundError("docker-compose is not installed (Debian package docker-compose)")
    out = subprocess.run([exe, "-f", str(path or COMPOSE_FILE), "config"], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})
    return yaml.safe_load(out.stdout)


def k8s_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def compose_demo():
    """deploy/compose_demo.py as a module (a script, not in a package: it runs before any virtual environment)."""
    spec = importlib.util.spec_from_file_location("compose_demo", REPO_ROOT / "deploy" / "compose_demo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module
