"""criteo-synth learns through real shards: ps-server and ps-trainer processes, the 26 DLRM tables on the shards.

A CI-sized run (seconds): 2 shards x 2 trainers in sync mode, 60 steps of 2 x 512 samples.  The bar is the
log-loss of the best constant prediction (the test set's own click rate, about 0.59): a model that learnt
nothing from the features cannot pass it, and the run must beat it by a clear margin.
"""

from __future__ import annotations

import math

import pytest

from trainer.workloads.criteo import load_criteo_dataset

pytestmark = pytest.mark.cluster

MARGIN = 0.015  # a one-process run of the same length ends ~0.03 below the constant predictor
ARGS = ["--dataset", "criteo-synth", "--steps", "60", "--batch-size", "512", "--sparse-optimizer", "adagrad",
        "--sparse-lr", "0.05", "--eval-every", "0"]


def constant_logloss() -> float:
    """Test log-loss of predicting the test set's click rate for every sample."""
    p = float(load_criteo_dataset("criteo-synth").y_test.mean())
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def test_criteo_synth_dlrm_on_two_shards_and_two_trainers_beats_the_constant_click_rate(cluster):
    job = cluster(2, 2, ARGS, timeout=600)
    assert job.codes == {"trainer0": 0, "trainer1": 0}, job.trainers[0].log_tail()
    done = job.done(0)
    assert done["test_logloss"] < constant_logloss() - MARGIN
    assert done["final_loss"] < math.log(2)  # the training loss fell from where an untrained model starts
    assert job.done(1)["test_logloss"] == pytest.approx(done["test_logloss"], rel=1e-3)  # the same weights
