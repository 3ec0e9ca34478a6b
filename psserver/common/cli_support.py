"""Command-line plumbing shared by every psgrpc CLI.

* Every flag falls back to an environment variable named after the CLI and the
  flag: ``ps-trainer --sync-timeout`` reads ``PS_TRAINER_SYNC_TIMEOUT``,
  ``ps-server --port`` reads ``PS_SERVER_PORT``; so containers need no wrapper
  scripts, and a variable meant for one CLI cannot change another (a shared
  ``PS_OUTPUT`` once redirected ``ps-plot``'s image).  The old unprefixed names
  (``PS_PORT``) still work for ``ps-server`` and ``ps-trainer``, with a
  deprecation warning naming the new one.
* Flags are never abbreviated (``--num-trainer`` is an error, not ``--num-trainers``).
* A mistake prints one line with the cause and a hint, never a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import re
import sys
import threading
from typing import Callable

import grpc

from psserver.common.logsafe import shorten

TRUE_WORDS = ("1", "true", "yes", "on")


# The CLIs whose flags were read from PS_<FLAG> before the names carried the CLI's own prefix.
LEGACY_ENV_CLIS = ("ps-server", "ps-trainer")


def env_prefix(prog: str) -> str:
    """``ps-trainer`` -> ``PS_TRAINER_``: the prefix of the environment variables a CLI reads."""
    return re.sub(r"[^A-Z0-9]+", "_", prog.upper()) + "_"  # "ps-server stats" -> PS_SERVER_STATS_


def shown_default(action: argparse.Action) -> str:
    """`` (default X)`` for a flag whose help does not say its default already; nothing for a switch that is off, a
    flag without a default, or one whose default the help explains."""
    default, text = action.default, action.help or ""
    if (default is None or default is False or default == argparse.SUPPRESS or "default" in text
            or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._CountAction))):
        return ""
    return f" (default {', '.join(map(str, default)) if isinstance(default, (list, tuple)) else default})"


class EnvArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.deprecated_env: list[tuple[str, str]] = []  # (old name used, new name)
        self.from_env: list[tuple[argparse.Action, str]] = []  # flags whose default came from the environment

    def add_argument(self, *args, **kwargs):
        return self._with_env(super().add_argument(*args, **kwargs))

    def add_argument_group(self, *args, **kwargs):
        """A group whose flags read the environment too (argparse's groups add arguments without this parser)."""
        return self._env_reading(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, **kwargs):
        return self._env_reading(super().add_mutually_exclusive_group(**kwargs))

    def _env_reading(self, group):
        add, nest = group.add_argument, group.add_mutually_exclusive_group
        group.add_argument = lambda *args, **kwargs: self._with_env(add(*args, **kwargs))
        group.add_mutually_exclusive_group = lambda **kwargs: self._env_reading(nest(**kwargs))
        return group

    def _with_env(self, action):
        """``action``'s default from its environment variable, where that is set; its help names the variable."""
        if not action.option_strings or action.dest == "help":
            return action
        env = env_prefix(self.prog) + action.dest.upper()
        legacy = "PS_" + action.dest.upper()
        action.help = f"{action.help or ''}{shown_default(action)} [env {env}]".strip()
        raw = os.environ.get(env)
        if raw is None and self.prog.split()[0] in LEGACY_ENV_CLIS and legacy in os.environ:
            raw = os.environ[legacy]
            self.deprecated_env.append((legacy, env))
            env = legacy
        if raw is not None:
            self.from_env.append((action, env))
            if isinstance(action, argparse._StoreTrueAction):
                action.default = raw.strip().lower() in TRUE_WORDS
            else:
                action.default = raw  # argparse applies `type` to string defaults
            action.required = False
        return action

    def parse_args(self, *args, **kwargs):
        ns = super().parse_args(*args, **kwargs)
        for action, env in self.from_env:  # argparse checks choices on the command line only
            value = getattr(ns, action.dest, None)
            if action.choices is not None and value not in action.choices:
                self.error(f"environment variable {env}: invalid choice {value!r} for {action.option_strings[0]} "
                           f"(choose from {', '.join(map(str, action.choices))})")
        for old, new in self.deprecated_env:
            sys.stderr.write(f"{self.prog}: warning: environment variable {old} is deprecated; use {new}\n")
        return ns

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


def run_cli(prog: str, main: Callable[[], int | None], skip_teardown: bool = False) -> None:
    """Run ``main`` and turn expected failures into a one-line message and an exit code.

    ``skip_teardown``: leave through ``exit_now`` once torch is loaded -- the teardown it skips is torch's;
    --help and flag errors exit as usual (for a CLI's entrypoint; tests that call this expect SystemExit)."""
    try:
        _run_cli(prog, main)
    except SystemExit as e:
        if skip_teardown and "torch" in sys.modules and (e.code is None or isinstance(e.code, int)):
            exit_now(e.code or 0)
        raise


# ps-server's exit status when a hot standby's primary finds itself replaced (psserver.replication.shipper): it
# may only come back as the standby -- a supervisor (ps-cluster, compose, Kubernetes) restarts it as such.
FENCED_EXIT = 3


def exit_now(code: int) -> None:
    """Exit with ``code`` without the interpreter's teardown, once nothing is left to finish.

    Freeing every module of a process that imported torch takes ~1 s (measured: 0.6-1 s on a loaded 2-core
    machine for ``import torch`` alone), which a trainer used to spend after its done line.  Safe only when
    the work is over: the atexit handlers still run (logging's flush among them) and stdout/stderr are
    flushed; files the program wrote were closed by it.  While a non-daemon thread is still running, the
    normal exit (which waits for it) is taken instead.
    """
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()  # CPython's; what the normal exit would run
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(code)


def _run_cli(prog: str, main: Callable[[], int | None]) -> None:
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
    except (TimeoutError, ConnectionError) as e:
        sys.stderr.write(f"{prog}: error: {e}\nhint: check the --ps addresses, and that the shards and the other "
                         f"trainers are running\n")
        sys.exit(1)
    except (ValueError, OSError, RuntimeError) as e:
        sys.stderr.write(f"{prog}: error: {e}\nhint: run '{prog} --help' for the flags\n")
        sys.exit(1)
    sys.exit(code or 0)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"8G"``, ``"512M"``, ``"1.5g"``, ``"4096"`` (binary units, an optional trailing B or iB) as bytes.

    Raises:
        ValueError: naming the text and the forms accepted.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    size = 0.0
    if m:  # a whole number exactly (2**63 - 1 is under the bound; as a float it rounded up to it)
        number, unit = m.group(1), _UNITS[m.group(2).lower()]
        size = int(number) * unit if "." not in number else float(number) * unit
    if not 1 <= size < 2 ** 63:  # 400 nines are infinity as a float: no traceback, the same one line
        raise ValueError(f"memory size {shorten(str(text), 40)} must be a positive number of bytes (below 2**63), "
                         "optionally with K, M, G or T (binary units), e.g. 8G or 512M")
    return int(size)
