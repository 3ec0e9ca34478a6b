"""The Criteo-shaped workload inside ps-trainer / ps-cluster (``--dataset criteo-synth --model dlrm``).

The log is trainer.workloads.recdata's ``make_criteo_synth``, generated at start from the seed (nothing is downloaded):
CRITEO_TRAIN training samples and CRITEO_TEST held-out ones from a different seed's stream of the same hidden
model.  The model is trainer.workloads.recmodels' DLRM with its 26 tables on the shards.  The loss is the click log-loss;
evaluation reports the test log-loss (``test_logloss``) where ratings runs report RMSE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.workloads.data import Dataset
from trainer.workloads.recdata import CriteoLog, make_criteo_synth

CRITEO_DATASETS = ("criteo-synth",)
CRITEO_BATCH = 2048  # the global batch: N trainers take 2048 // N each
CRITEO_TRAIN, CRITEO_TEST = 1 << 17, 1 << 14
CRITEO_DIM = 16


@dataclass
class CriteoDataset(Dataset):
    """The log as the loop's Dataset: x_train / x_test are CriteoLogs (indexable by a batch's rows), y the labels."""

    cardinalities: tuple[int, ...] = ()


def load_criteo_dataset(name: str, seed: int = 0, n_train: int = CRITEO_TRAIN, n_test: int = CRITEO_TEST,
                        **kw) -> CriteoDataset:
    """Train and test logs of the same hidden model: generated together and split, so they share it."""
    if name not in CRITEO_DATASETS:
        raise ValueError(f"unknown click dataset {name!r}: choose one of {', '.join(CRITEO_DATASETS)}")
    log = make_criteo_synth(n_train + n_test, seed=seed, **kw)
    train, test = log[slice(0, n_train)], log[slice(n_train, n_train + n_test)]
    return CriteoDataset(name, train, train.labels, test, test.labels, num_classes=0,
                         cardinalities=log.cardinalities)


class CriteoNet(nn.Module):
    """A click model fed CriteoLog batches: the one input the training loop hands every model."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: CriteoLog) -> torch.Tensor:
        return self.net(x.dense, x.ids)

    def objective(self, x: CriteoLog, labels: torch.Tensor, l2: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(what is minimised, what is reported): both the log-loss (no row regulariser: ``l2`` is not used)."""
        loss = nn.functional.binary_cross_entropy_with_logits(self(x), labels)
        return loss, loss

    @torch.no_grad()
    def score(self, x: CriteoLog, labels: torch.Tensor, batch_size: int = 8192) -> tuple[float, float]:
        """(test log-loss, test loss): the same number, each batch's rows pulled once and nothing kept."""
        self.eval()
        total = 0.0
        for start in range(0, len(labels), batch_size):
            rows = slice(start, start + batch_size)
            total += float(nn.functional.binary_cross_entropy_with_logits(self(x[rows]), labels[rows],
                                                                          reduction="sum"))
        self.train()
        return total / len(labels), total / len(labels)


def build_criteo_model(data: CriteoDataset, dim: int, seed: int, **factories) -> CriteoNet:
    """DLRM over ``data``'s tables; ``factories`` as recmodels.sharded_factories gives (``embedding`` used)."""
    from trainer.workloads.recmodels import DLRM

    torch.manual_seed(seed)  # the dense towers: the same on every trainer
    return CriteoNet(DLRM(data.cardinalities, dim=dim, embedding=factories["embedding"]))
