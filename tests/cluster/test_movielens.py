"""MovieLens-100k on 2 shards x 2 trainers (real processes): the issue's RMSE bar, and the single process's RMSE.

The reference is the same loop with ``--backend local`` (tables on LocalRows, the shards' own RowStore and
per-row optimizers, in this process) and batch 2 x b: in sync mode the two trainers see the same global
batches, so the RMSEs should agree within the issue's 1%.
"""

from __future__ import annotations

import pytest
import torch

from trainer.running.loop import TrainConfig, train

pytestmark = pytest.mark.cluster

EPOCHS, B = 3, 512
ML = ["--dataset", "movielens100k", "--epochs", str(EPOCHS), "--batch-size", str(B)]
MEAN_ONLY_RMSE = 1.12  # predicting the training mean (about 1.13 on the pinned split): any learning beats it


def reference_rmse(model: str) -> float:
    """One process, tables on LocalRows, batch 2B: what the cluster's sync run is equivalent to."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = TrainConfig(ps="127.0.0.1:1", backend="local", dataset="movielens100k", model=model,
                          optimizer="adam", batch_size=2 * B, epochs=EPOCHS, progress=False)
        return train(cfg)["test_rmse"]
    finally:
        torch.set_num_threads(threads)


def test_mf_on_two_shards_and_two_trainers_reaches_rmse_093_and_matches_one_process_within_1_percent(cluster):
    job = cluster(2, 2, [*ML, "--model", "mf"], timeout=900)
    assert job.codes == {"trainer0": 0, "trainer1": 0}, job.trainers[0].log_tail()
    rmse = job.done(0)["test_rmse"]
    assert rmse <= 0.93
    assert abs(rmse - reference_rmse("mf")) <= 0.01 * rmse
    assert job.done(1)["test_rmse"] == pytest.approx(rmse, rel=1e-3)  # both evaluate the same weights


def test_async_embeddings_next_to_sync_dense_layers_train_ncf_below_the_mean_predictor(cluster):
    job = cluster(2, 2, [*ML, "--model", "ncf", "--embedding-mode", "async"], timeout=900)
    assert job.codes == {"trainer0": 0, "trainer1": 0}, job.trainers[0].log_tail()
    assert job.done(0)["test_rmse"] < MEAN_ONLY_RMSE
