"""ps-trainer, ps-server and ps-cluster answer --help and refuse a bad flag before importing torch (seconds on
an idle machine, half a minute on a loaded one); the torch-free choices they offer equal their owners'."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIS = {"ps-trainer": "trainer.running.cli", "ps-server": "psserver.cli", "ps-cluster": "trainer.local.cluster"}


def torch_loaded_after(prog: str, argv: list[str]) -> tuple[bool, str]:
    """Run ``prog``'s entrypoint with ``argv`` in a child; (whether torch was imported when it exited, its stderr)."""
    child = (f"import sys\nsys.argv = [{prog!r}, *{argv!r}]\nfrom {CLIS[prog]} import entrypoint\n"
             "try:\n    entrypoint()\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLIBC_TUNABLES="")  # GLIBC_TUNABLES set: no re-exec
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=300)
    assert proc.stdout.strip().splitlines()[-1] in ("True", "False"), proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()[-1] == "True", proc.stderr


@pytest.mark.parametrize("prog", sorted(CLIS))
def test_help_is_printed_without_importing_torch(prog):
    loaded, _ = torch_loaded_after(prog, ["--help"])
    assert not loaded


@pytest.mark.parametrize("prog, argv, message", [
    ("ps-trainer", ["--ps", "127.0.0.1:7000", "--mode", "fast"], "argument --mode: invalid choice: 'fast'"),
    ("ps-trainer", ["--mode", "sync"], "the following arguments are required: --ps"),
    ("ps-server", ["--shard", "0", "--port", "x"], "argument --port: invalid int value: 'x'"),
    ("ps-server", ["--shard", "0", "--tensorboard-every", "0"], "--tensorboard-every must be more than 0 seconds"),
    ("ps-server", ["--shard", "0", "--max-memory", "8X"], "--max-memory: memory size '8X' must be a positive number"),
    ("ps-cluster", ["--model", "bert"], "argument --model: invalid choice: 'bert'"),
    ("ps-cluster", ["--shards", "0"], "--shards (0) and --trainers (2) must be at least 1"),
])
def test_a_flag_error_is_refused_in_one_line_without_importing_torch(prog, argv, message):
    loaded, err = torch_loaded_after(prog, argv)
    assert message in err and "Traceback" not in err
    assert not loaded


def test_the_torch_free_choices_equal_their_owners():
    from psserver.protocol import job
    from psserver.protocol.rows import optim
    from trainer.channels import registering
    from trainer.running import choices
    from trainer.workloads import criteo
    from trainer.workloads import data
    from trainer.workloads import models
    from trainer.workloads import recmodels
    from trainer.workloads import rectrain

    assert (choices.MODES, choices.OPTIMIZERS, choices.STALE_POLICIES) == (job.MODES, job.OPTIMIZERS,
                                                                           job.STALE_POLICIES)
    assert choices.WIRE_DTYPE_NAMES == tuple(job.WIRE_DTYPES)
    assert choices.SPARSE_OPTIMIZERS == optim.SPARSE_OPTIMIZERS
    assert (choices.DATASETS, choices.MODELS, choices.REC_MODELS) == (data.DATASETS, models.MODELS,
                                                                      recmodels.REC_MODELS)
    assert (choices.REC_DATASETS, choices.REC_BATCH) == (rectrain.REC_DATASETS, rectrain.REC_BATCH)
    assert (choices.DATASET_MODELS, choices.CRITEO_BATCH) == (rectrain.DATASET_MODELS, criteo.CRITEO_BATCH)
    assert choices.LOOPBACK_REFUSED_SECONDS == registering.LOOPBACK_REFUSED_SECONDS
