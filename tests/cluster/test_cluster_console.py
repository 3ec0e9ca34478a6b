"""ps-cluster's console with real processes: one status line per trainer redrawn in place on a terminal (a pty here),
a compact line every few seconds into a pipe; never a line per step, which stays in the run folder's logs."""

import os
import pty
import re
import subprocess
import sys
import threading

ARGS = ["--model", "mlp", "--dataset", "synthetic", "--steps", "30", "--eval-every", "10"]
CLUSTER = [sys.executable, "-c", "from trainer.local.cluster import entrypoint; entrypoint()"]
PER_STEP = re.compile(r"trainer \d: step \d+ loss|rank \d: step \d+/")


def test_into_a_pipe_ps_cluster_prints_compact_lines_with_every_trainer_and_keeps_the_step_lines_in_the_logs(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([*CLUSTER, *ARGS, "--run-dir", str(run)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "psgrpc run summary" in proc.stdout and "test accuracy (rank 0)" in proc.stdout
    compact = [line for line in proc.stderr.splitlines() if re.search(r"\[\d+ s\] trainer 0 ", line)]
    assert compact, proc.stderr
    assert all(" | trainer 1 " in line for line in compact), compact  # every trainer on each line
    assert not PER_STEP.search(proc.stderr), proc.stderr
    assert "starting 2 shards on 127.0.0.1" in proc.stderr  # said before the shards' slow start, not after
    assert PER_STEP.search((run / "trainer0.log").read_text())  # the per-step detail is in the log


def test_on_a_terminal_ps_cluster_redraws_one_line_per_trainer_and_ends_showing_each_one_done(tmp_path):
    main, side = pty.openpty()
    proc = subprocess.Popen([*CLUSTER, *ARGS, "--run-dir", str(tmp_path / "run")], stdout=subprocess.PIPE,
                            stderr=side, env={**os.environ, "COLUMNS": "200"})
    os.close(side)
    chunks = []

    def read_terminal():
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        stdout, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
        reader.join(timeout=30)
        os.close(main)
    screen = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, screen[-2000:]
    assert "\x1b[2F\x1b[J" in screen  # the two trainers' lines redrawn in place
    assert "trainer 0  done 30/30" in screen and "trainer 1  done 30/30" in screen, screen[-2000:]
    assert not PER_STEP.search(screen), screen[-2000:]
    assert b"psgrpc run summary" in stdout
