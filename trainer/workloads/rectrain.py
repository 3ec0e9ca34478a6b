"""Single-process baseline for the recommender models: what the sharded tables must match.

Tables (sparse gradients) go to a sparse optimizer, the other parameters to Adam.
The sample order is the project's data-order contract (``trainer.workloads.data.epoch_order``),
so a later run with N trainers of batch b sees the same batches as this one with N*b.

    python -m trainer.workloads.rectrain --model mf --epochs 5
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

from trainer.workloads.criteo import CRITEO_DATASETS, CRITEO_DIM, build_criteo_model, load_criteo_dataset
from trainer.workloads.data import Dataset, epoch_order, local_batch_indices, steps_per_epoch
from trainer.workloads.recdata import Ratings, RatingsSplit, load_movielens100k
from trainer.workloads.recmodels import make_rec_model, split_parameters

SPARSE_OPTIMIZERS = ("sparse_adam", "adagrad", "sgd")
RATINGS_MODELS = ("mf", "ncf")  # what this baseline trains (recmodels.REC_MODELS also has dlrm: trainer.workloads.criteo)


@dataclass(frozen=True)
class RecTrainConfig:
    model: str = "mf"
    epochs: int = 5
    batch_size: int = 1024
    dim: int = 32
    sparse_optimizer: str = "sparse_adam"
    sparse_lr: float = 0.01  # tables
    dense_lr: float = 0.001  # the global mean and the MLP: Adam
    # L2 on the rows a batch touches (times the batch's mean): the usual MF regulariser, and sparse-friendly,
    # because rows the batch does not touch get no gradient (torch's sparse optimizers have no weight decay).
    l2: float = 0.1
    seed: int = 0  # model initialisation and sample order

    def __post_init__(self) -> None:
        if self.model not in RATINGS_MODELS:
            raise ValueError(f"model is {self.model!r}, expected one of {', '.join(RATINGS_MODELS)}")
        if self.sparse_optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"sparse_optimizer is {self.sparse_optimizer!r}, expected one of "
                             f"{', '.join(SPARSE_OPTIMIZERS)}")
        for name in ("epochs", "batch_size", "dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} is {getattr(self, name)}, expected at least 1")
        for name in ("sparse_lr", "dense_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} is {getattr(self, name)}, expected above 0")
        if not self.l2 >= 0:
            raise ValueError(f"l2 is {self.l2}, expected at least 0")


def make_optimizers(model: nn.Module, cfg: RecTrainConfig) -> list[torch.optim.Optimizer]:
    tables, dense = split_parameters(model)
    if cfg.sparse_optimizer == "sparse_adam":
        sparse: torch.optim.Optimizer = torch.optim.SparseAdam(tables, lr=cfg.sparse_lr)
    elif cfg.sparse_optimizer == "adagrad":
        sparse = torch.optim.Adagrad(tables, lr=cfg.sparse_lr)
    else:
        sparse = torch.optim.SGD(tables, lr=cfg.sparse_lr)
    return [sparse, torch.optim.Adam(dense, lr=cfg.dense_lr)]


def touched_rows_l2(model: nn.Module, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """Mean squared norm of the looked-up rows (embeddings and biases) of this batch."""
    total = torch.zeros(())
    for name, ids in (("user", users), ("item", items), ("user_bias", users), ("item_bias", items)):
        table = getattr(model, name, None)
        if table is not None:
            total = total + table(ids).pow(2).sum(-1).mean()
    return total


@torch.no_grad()
def rmse(model: nn.Module, data: Ratings, batch_size: int = 8192) -> float:
    model.eval()
    se = 0.0
    for start in range(0, len(data), batch_size):
        sl = slice(start, start + batch_size)
        se += float((model(data.users[sl], data.items[sl]) - data.ratings[sl]).pow(2).sum())
    model.train()
    return math.sqrt(se / len(data))


def train_epoch(model: nn.Module, optimizers: list[torch.optim.Optimizer], train: Ratings, cfg: RecTrainConfig,
                epoch: int) -> float:
    """One pass in the contract's order; returns the mean training MSE (without the L2 term)."""
    order = epoch_order(len(train), cfg.seed, epoch)
    steps = steps_per_epoch(len(train), 1, cfg.batch_size)
    total = 0.0
    for step in range(steps):
        idx = local_batch_indices(order, step, 0, 1, cfg.batch_size)
        users, items, target = train.users[idx], train.items[idx], train.ratings[idx]
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        mse = (model(users, items) - target).pow(2).mean()
        loss = mse + cfg.l2 * touched_rows_l2(model, users, items) if cfg.l2 else mse
        loss.backward()
        for opt in optimizers:
            opt.step()
        total += mse.item()
    return total / max(steps, 1)


def train_ratings(split: RatingsSplit, cfg: RecTrainConfig) -> list[float]:
    """Train ``cfg.model`` on the split's training side; the test RMSE after each epoch."""
    torch.manual_seed(cfg.seed)
    model = make_rec_model(cfg.model, split.num_users, split.num_items, cfg.dim, mean=split.train_mean)
    optimizers = make_optimizers(model, cfg)
    return [(train_epoch(model, optimizers, split.train, cfg, e), rmse(model, split.test))[1]
            for e in range(cfg.epochs)]


# -- the recommender workload inside ps-trainer / ps-cluster (trainer.running.loop) ---------------------------------------

RATINGS_DATASETS = ("movielens100k",)
REC_DATASETS = RATINGS_DATASETS + CRITEO_DATASETS
# Each recommender dataset's models, the first its default (trainer.running.choices.DATASET_MODELS is a torch-free copy).
DATASET_MODELS = {"movielens100k": ("mf", "ncf"), "criteo-synth": ("dlrm",)}
REC_L2 = RecTrainConfig.l2  # the loop trains with the baseline's regulariser, so the two are comparable
REC_BATCH = 1024  # the global batch the baseline's defaults reach RMSE 0.91 with: N trainers take 1024 // N each


@dataclass
class RatingsDataset(Dataset):
    """MovieLens as the loop's Dataset: x holds (user, item) pairs (n, 2) int64, y the float32 ratings."""

    num_users: int = 0
    num_items: int = 0
    train_mean: float = 0.0


def load_rec_dataset(name: str, seed: int = 0):
    """A recommender dataset of the loop: MovieLens ratings, or the Criteo-shaped log generated from ``seed``."""
    return load_criteo_dataset(name, seed) if name in CRITEO_DATASETS else load_ratings_dataset(name)


def build_rec_model(name: str, data, dim: int | None, seed: int, **factories) -> nn.Module:
    """The loop's recommender model (``dim`` None: the dataset's default width)."""
    if name in DATASET_MODELS["criteo-synth"]:
        return build_criteo_model(data, dim or CRITEO_DIM, seed, **factories)
    return build_ratings_model(name, data, dim or 32, seed, **factories)


def load_ratings_dataset(name: str) -> RatingsDataset:
    if name not in RATINGS_DATASETS:
        raise ValueError(f"unknown ratings dataset {name!r}: choose one of {', '.join(RATINGS_DATASETS)}")
    split = load_movielens100k()

    def pairs(side: Ratings) -> torch.Tensor:
        return torch.stack([side.users, side.items], dim=1)

    return RatingsDataset(split.name, pairs(split.train), split.train.ratings, pairs(split.test), split.test.ratings,
                          num_classes=0, num_users=split.num_users, num_items=split.num_items,
                          train_mean=split.train_mean)


class RatingsNet(nn.Module):
    """A ratings model fed (b, 2) [user, item] pairs: the one input the training loop hands every model."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        return self.net(pairs[:, 0], pairs[:, 1])

    def objective(self, pairs: torch.Tensor, ratings: torch.Tensor, l2: float = REC_L2) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
        """(what is minimised: MSE plus L2 on the touched rows, the MSE alone: the loss reported)."""
        mse = (self(pairs) - ratings).pow(2).mean()
        if not l2:
            return mse, mse
        return mse + l2 * touched_rows_l2(self.net, pairs[:, 0], pairs[:, 1]), mse

    def score(self, pairs: torch.Tensor, ratings: torch.Tensor) -> tuple[float, float]:
        """(test RMSE, test MSE): what the loop's evaluation reports."""
        rmse_ = pairs_rmse(self, pairs, ratings)
        return rmse_, rmse_ ** 2


def build_ratings_model(name: str, data: RatingsDataset, dim: int, seed: int, **factories) -> RatingsNet:
    """``name`` (mf or ncf) over ``data``'s users and items; ``factories`` as recmodels.sharded_factories gives."""
    torch.manual_seed(seed)  # the dense layers (NCF's MLP): the same on every trainer
    factories.pop("embedding_bag", None)
    return RatingsNet(make_rec_model(name, data.num_users, data.num_items, dim, mean=data.train_mean, **factories))


@torch.no_grad()
def pairs_rmse(model: nn.Module, pairs: torch.Tensor, ratings: torch.Tensor, batch_size: int = 8192) -> float:
    """Test RMSE of a RatingsNet (each batch's rows pulled once, nothing kept)."""
    model.eval()
    se = 0.0
    for start in range(0, len(ratings), batch_size):
        sl = slice(start, start + batch_size)
        se += float((model(pairs[sl]) - ratings[sl]).pow(2).sum())
    model.train()
    return math.sqrt(se / len(ratings))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.workloads.rectrain", description=__doc__.splitlines()[0])
    defaults = RecTrainConfig()
    p.add_argument("--model", default=defaults.model, choices=RATINGS_MODELS)
    p.add_argument("--epochs", type=int, default=defaults.epochs)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--dim", type=int, default=defaults.dim)
    p.add_argument("--sparse-optimizer", default=defaults.sparse_optimizer, choices=SPARSE_OPTIMIZERS)
    p.add_argument("--sparse-lr", type=float, default=defaults.sparse_lr)
    p.add_argument("--dense-lr", type=float, default=defaults.dense_lr)
    p.add_argument("--l2", type=float, default=defaults.l2)
    p.add_argument("--seed", type=int, default=defaults.seed)
    # One thread is often faster on a small, shared machine: two threads on two busy cores wait on each other.
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = vars(p.parse_args(argv))
    threads = args.pop("torch_threads")
    try:
        if threads < 0:
            raise ValueError(f"--torch-threads is {threads}, expected 0 (torch's default) or more")
        cfg = RecTrainConfig(**args)
        split = load_movielens100k()
    except (ValueError, RuntimeError) as e:
        print(f"error: {e} (see --help)", file=sys.stderr)
        return 2
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    curve = train_ratings(split, cfg)
    seconds = time.perf_counter() - t0
    for epoch, value in enumerate(curve, 1):
        print(f"epoch {epoch}: test RMSE {value:.4f}")
    print(f"{cfg.model}: best test RMSE {min(curve):.4f} in {seconds:.1f} s of training "
          f"(torch threads: {torch.get_num_threads()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
