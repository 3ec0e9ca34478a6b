"""Command-line plumbing shared by every psgrpc CLI.

* Every flag falls back to an environment variable ``PS_<FLAG>`` (``--sync-timeout``
  reads ``PS_SYNC_TIMEOUT``), so containers need no wrapper scripts.
* A mistake prints one line with the cause and a hint, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable

import grpc

TRUE_WORDS = ("1", "true", "yes", "on")


class EnvArgumentParser(argparse.ArgumentParser):
    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if not action.option_strings or action.dest == "help":
            return action
        env = "PS_" + action.dest.upper()
        action.help = f"{action.help or ''} [env {env}]".strip()
        if env in os.environ:
            raw = os.environ[env]
            if isinstance(action, argparse._StoreTrueAction):
                action.default = raw.strip().lower() in TRUE_WORDS
            else:
                action.default = raw  # argparse applies `type` to string defaults
            action.required = False
        return action

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\nhint: run '{self.prog} --help' for the flags\n")
        sys.exit(2)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


MALLOC_TUNABLES = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"


def ensure_malloc_tunables(module: str) -> None:
    """Re-execute this CLI once with glibc's allocator tuned for large message buffers.

    Multi-MB gRPC buffers above malloc's mmap threshold are freshly mapped and
    page-faulted on every call; keeping them on the heap (and on huge pages)
    cut a ResNet-18 step's communication by about a fifth in ps-bench.  The
    setting must be in the environment before the process starts, hence the
    re-exec; set GLIBC_TUNABLES yourself (even to "") to opt out.
    """
    if "GLIBC_TUNABLES" in os.environ or not sys.platform.startswith("linux"):
        return
    env = dict(os.environ, GLIBC_TUNABLES=MALLOC_TUNABLES)
    os.execve(sys.executable, [sys.executable, "-c", f"from {module} import entrypoint; entrypoint()",
                               *sys.argv[1:]], env)


def run_cli(prog: str, main: Callable[[], int | None]) -> None:
    """Run ``main`` and turn expected failures into a one-line message and an exit code."""
    try:
        code = main()
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        sys.exit(130)
    except grpc.RpcError as e:
        code_name = e.code().name if hasattr(e, "code") else "?"
        details = e.details() if hasattr(e, "details") else str(e)
        sys.stderr.write(f"{prog}: error: {code_name}: {details}\nhint: check the --ps addresses and the shards' logs\n")
        sys.exit(1)
    except (ValueError, OSError, RuntimeError, TimeoutError) as e:
        sys.stderr.write(f"{prog}: error: {e}\nhint: run '{prog} --help' for the flags\n")
        sys.exit(1)
    sys.exit(code or 0)
