"""A CLI entrypoint's quick exit (psserver/common/cli_support.py ``exit_now``): no interpreter teardown, but
nothing the program said or registered is lost, and a thread still at work is waited for."""

import subprocess
import sys
import textwrap


def run_child(body: str, **kwargs) -> subprocess.Popen:
    code = textwrap.dedent("""
        import atexit, sys, threading
        import torch  # the quick exit is taken once torch is loaded (the teardown it skips is torch's)
        from psserver.common.cli_support import run_cli
    """) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def test_a_quick_exit_keeps_the_exit_code_the_buffered_output_and_the_atexit_handlers():
    child = run_child("""
        atexit.register(lambda: print("atexit handler ran"))
        def main():
            print("buffered line", end="")  # stdout is a pipe: block-buffered, still in the buffer at exit
            return 3
        run_cli("ps-test", main, skip_teardown=True)
    """)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 3, err
    assert out == "buffered lineatexit handler ran\n"


def test_a_quick_exit_waits_for_a_non_daemon_thread_still_at_work():
    child = run_child("""
        worker = threading.Thread(target=lambda: print("worker finished:", sys.stdin.readline().strip()))
        worker.start()
        def main():
            sys.stderr.write("main returns\\n")
            sys.stderr.flush()
            return 0
        run_cli("ps-test", main, skip_teardown=True)
    """, stdin=subprocess.PIPE)
    assert child.stderr.readline() == "main returns\n"  # the worker is blocked on stdin until we write
    child.stdin.write("its last line\n")
    child.stdin.close()
    out = child.stdout.read()
    assert child.wait(timeout=60) == 0, child.stderr.read()
    assert out == "worker finished: its last line\n"


def test_without_skip_teardown_run_cli_still_raises_system_exit_for_callers_that_catch_it():
    child = run_child("""
        try:
            run_cli("ps-test", lambda: 4)
        except SystemExit as e:
            print("caught", e.code)
    """)
    out, err = child.communicate(timeout=60)
    assert (child.returncode, out) == (0, "caught 4\n"), err
