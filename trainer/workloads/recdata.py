"""Recommender workloads: MovieLens-100k ratings and a synthetic Zipf click log.

movielens100k: the 100,000 ratings (943 users, 1,682 items) that ship inside
recbole 1.2.1's wheel as ``recbole/dataset_example/ml-100k/ml-100k.inter``.
The file is read directly; recbole itself is never imported (its import pulls
in a large dependency tree that ``pip install --no-deps`` leaves out).

Ids: the raw user and item tokens are integers (1..943, 1..1682); each is
mapped to a contiguous int64 in 0..n-1 by the rank of its raw value, so raw
user 1 is 0 and raw user 943 is 942. The same holds for items.

Split: by rating rows, not by user: ``numpy.random.default_rng(seed)``
permutes the 100,000 row numbers (file order) and the first 20% of the
permutation is the test set. The default seed is ``SPLIT_SEED`` (0); with it
the split is the same on every machine. Some test items (a few dozen) are never
rated in training: the models then predict from the global mean and biases.

clicklog: samples are bags of ids drawn from a Zipf law over 10^9 possible
ids, labelled by a hidden model, so that a model has something to learn and
memory can be watched following the rows that are actually touched.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ML100K_INTER = ("dataset_example", "ml-100k", "ml-100k.inter")
ML100K_HEADER = ["user_id:token", "item_id:token", "rating:float", "timestamp:float"]
ML100K_COUNTS = {"ratings": 100_000, "users": 943, "items": 1_682}
RECBOLE_INSTALL = "pip install --no-deps recbole==1.2.1"
SPLIT_SEED = 0
TEST_FRACTION = 0.2


@dataclass
class Ratings:
    """One side of the split: parallel int64 user and item ids and float32 ratings."""

    users: torch.Tensor
    items: torch.Tensor
    ratings: torch.Tensor

    def __len__(self) -> int:
        return len(self.ratings)


@dataclass
class RatingsSplit:
    name: str
    train: Ratings
    test: Ratings
    num_users: int
    num_items: int

    @property
    def train_mean(self) -> float:
        """The global mean the models start from: of the training ratings only, so the test set does not leak."""
        return float(self.train.ratings.mean())


def movielens100k_path() -> Path:
    """Where recbole's wheel put ml-100k.inter, found without importing recbole.

    ``find_spec`` of a top-level package only searches sys.path; it does not run
    the package's ``__init__`` (a test checks ``sys.modules``).
    """
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the movielens100k dataset comes with the recbole wheel: {RECBOLE_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*ML100K_INTER)
    if not path.exists():
        raise RuntimeError(f"recbole is installed but {path} is missing: {RECBOLE_INSTALL} --force-reinstall")
    return path


def read_ml100k_inter(path: Path) -> np.ndarray:
    """The file's rows as an (n, 4) int64 array: raw user, raw item, rating, timestamp (all integral)."""
    with open(path, encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        if header != ML100K_HEADER:
            raise RuntimeError(f"{path}: header is {header}, expected {ML100K_HEADER}")
        values = np.array(f.read().split(), dtype=np.int64)
    if values.size % 4:
        raise RuntimeError(f"{path}: {values.size} values do not make rows of 4 columns")
    return values.reshape(-1, 4)


def contiguous_ids(raw: np.ndarray) -> tuple[np.ndarray, int]:
    """Raw ids mapped to 0..n-1 in the order of their values; returns (ids, n)."""
    uniq, ids = np.unique(raw, return_inverse=True)
    return ids.astype(np.int64), len(uniq)


def split_rows(n: int, seed: int = SPLIT_SEED, test_fraction: float = TEST_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, test rows), each sorted: a fixed-seed random split of row numbers 0..n-1."""
    perm = np.random.default_rng(seed).permutation(n)
    n_test = int(round(n * test_fraction))
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def load_movielens100k(seed: int = SPLIT_SEED, test_fraction: float = TEST_FRACTION) -> RatingsSplit:
    rows = read_ml100k_inter(movielens100k_path())
    users, num_users = contiguous_ids(rows[:, 0])
    items, num_items = contiguous_ids(rows[:, 1])
    got = {"ratings": len(rows), "users": num_users, "items": num_items}
    if got != ML100K_COUNTS:
        raise RuntimeError(f"ml-100k.inter has {got}, expected {ML100K_COUNTS}: {RECBOLE_INSTALL} --force-reinstall")
    ratings = rows[:, 2].astype(np.float32)

    def side(idx: np.ndarray) -> Ratings:
        return Ratings(torch.from_numpy(users[idx]), torch.from_numpy(items[idx]), torch.from_numpy(ratings[idx]))

    train, test = split_rows(len(rows), seed, test_fraction)
    return RatingsSplit("movielens100k", side(train), side(test), num_users, num_items)


# --- synthetic click log -----------------------------------------------------------------------------------------

CLICK_ID_SPACE = 10**9
# Multiplying by a number coprime to 10^9 (odd, not a multiple of 5) permutes 0..10^9-1, so the hot ids are
# spread over the whole id space like hashed feature ids, instead of being 1, 2, 3, ... in order of heat.
_SCRAMBLE = 2_654_435_761


@dataclass
class ClickLog:
    """Variable-length bags of ids in ``nn.EmbeddingBag``'s flat form.

    Sample i's ids are ``ids[offsets[i]:offsets[i+1]]`` (the last runs to the end),
    each with a weight in ``weights``; ``labels`` are 0/1 floats.
    """

    ids: torch.Tensor  # int64, in [0, id_space)
    offsets: torch.Tensor  # int64, one per sample, starting at 0
    weights: torch.Tensor  # float32, one per id
    labels: torch.Tensor  # float32, one per sample
    id_space: int

    def __len__(self) -> int:
        return len(self.offsets)

    def compact(self) -> "ClickLog":
        """The same log with ids renumbered 0..u-1 (u distinct ids, now ``id_space``), for a local
        ``nn.EmbeddingBag`` of u rows; a 10^9-row table would not fit one process."""
        uniq, inverse = torch.unique(self.ids, return_inverse=True)
        return ClickLog(inverse, self.offsets, self.weights, self.labels, len(uniq))

    def take(self, rows: torch.Tensor) -> "ClickLog":
        """The samples ``rows`` (in that order), re-packed into a log of their own: a batch, or a held-out part."""
        ends = torch.cat([self.offsets[1:], torch.tensor([len(self.ids)])])
        starts, lengths = self.offsets[rows], ends[rows] - self.offsets[rows]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)[:-1]])
        # Where each output id comes from: its sample's start plus its position inside the bag.
        within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(offsets, lengths)
        flat = torch.repeat_interleave(starts, lengths) + within
        return ClickLog(self.ids[flat], offsets, self.weights[flat], self.labels[rows], self.id_space)


def zipf_ranks(n: int, a: float, id_space: int, rng: np.random.Generator) -> np.ndarray:
    """n ranks in 1..id_space with P(rank >= k) falling as k^(1-a): a bounded Zipf law, by inverse CDF.

    The continuous bounded power law on [1, id_space+1) is sampled exactly and floored,
    which keeps the tail exponent of Zipf(a) without a per-rank table of 10^9 entries.
    """
    if a <= 1.0:
        raise ValueError(f"zipf exponent a={a} must be above 1")
    u = rng.random(n)
    top = float(id_space + 1) ** (1.0 - a)
    x = (1.0 - u * (1.0 - top)) ** (1.0 / (1.0 - a))
    return np.minimum(np.floor(x).astype(np.int64), id_space)


def hidden_weight(ids: np.ndarray, seed: int) -> np.ndarray:
    """A fixed pseudo-random weight in [-1, 1) per id, from a 64-bit mix of (seed, id): the model to recover."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) / float(1 << 53) * 2.0 - 1.0).astype(np.float32)


def make_click_log(n_samples: int, seed: int = 0, max_bag: int = 8, a: float = 1.1,
                   id_space: int = CLICK_ID_SPACE, scale: float = 3.0) -> ClickLog:
    """A learnable, seeded click log: bag lengths uniform in 1..max_bag, ids Zipf(a) over id_space.

    Label of a sample: Bernoulli(sigmoid(scale * sum_j w_j * hidden(id_j))), where w_j are the
    per-id weights (uniform in [0.5, 1.5)); so a weighted ``EmbeddingBag(mode="sum")`` can fit it.
    """
    if max_bag < 1 or n_samples < 1:
        raise ValueError(f"n_samples={n_samples} and max_bag={max_bag} must both be at least 1")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_bag + 1, size=n_samples)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    ranks = zipf_ranks(int(lengths.sum()), a, id_space, rng)
    ids = ((ranks - 1) * _SCRAMBLE) % id_space
    weights = rng.uniform(0.5, 1.5, size=ids.size).astype(np.float32)
    logit = scale * np.add.reduceat(weights * hidden_weight(ids, seed), offsets)
    labels = (rng.random(n_samples) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return ClickLog(torch.from_numpy(ids), torch.from_numpy(offsets), torch.from_numpy(weights),
                    torch.from_numpy(labels), id_space)


# --- synthetic Criteo-shaped log ---------------------------------------------------------------------------------

# The 26 categorical cardinalities of Criteo's Kaggle display-advertising log, the largest (over 10^6) taken up to
# 10^9: a hashed id space as production pipelines have, most of it never touched.
CRITEO_CARDINALITIES = (1460, 583, 10**9, 10**8, 305, 24, 12517, 633, 3, 93145, 5683, 10**9, 3194, 27, 14992,
                        10**8, 10, 5652, 2173, 4, 10**9, 18, 15, 286181, 105, 142572)
CRITEO_DENSE = 13


@dataclass
class CriteoLog:
    """Criteo-shaped samples: 13 dense features, one id per categorical table (26), a 0/1 label."""

    dense: torch.Tensor  # float32 (n, 13)
    ids: torch.Tensor  # int64 (n, tables): column t in [0, cardinalities[t])
    labels: torch.Tensor  # float32 (n,)
    cardinalities: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, rows) -> "CriteoLog":
        """The samples ``rows`` (an index tensor or a slice), as a log of their own: a batch."""
        return CriteoLog(self.dense[rows], self.ids[rows], self.labels[rows], self.cardinalities)

    def to(self, device) -> "CriteoLog":
        return CriteoLog(self.dense.to(device), self.ids.to(device), self.labels.to(device), self.cardinalities)

    def compact(self) -> "CriteoLog":
        """Ids renumbered 0..u_t-1 per table (u_t distinct in column t), for local ``nn.Embedding`` tables of u_t
        rows; a 10^9-row table would not fit one process."""
        columns, sizes = [], []
        for t in range(self.ids.shape[1]):
            uniq, inverse = torch.unique(self.ids[:, t], return_inverse=True)
            columns.append(inverse)
            sizes.append(len(uniq))
        return CriteoLog(self.dense, torch.stack(columns, dim=1), self.labels, tuple(sizes))


def hashed_ids(ranks: np.ndarray, table: int, cardinality: int) -> np.ndarray:
    """Zipf ranks as ids of table ``table``: a 64-bit mix of (table, rank) modulo the cardinality -- the hashing
    trick, so hot ids are spread over the id space and a few ranks may share an id, as in a hashed log."""
    return (hidden_bits(ranks, 0x51ED + table) % np.uint64(cardinality)).astype(np.int64)


def hidden_bits(values: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64's mix of (seed, value) as uint64 (the bits behind ``hidden_weight``)."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def make_criteo_synth(n_samples: int, seed: int = 0, a: float = 1.05,
                      cardinalities: tuple[int, ...] = CRITEO_CARDINALITIES, scale: float = 4.0,
                      base_logit: float = -1.2) -> CriteoLog:
    """A learnable, seeded Criteo-shaped log, generated here (nothing is downloaded).

    Dense features: ``log1p`` of exponential counts (Criteo's integer features, as DLRM's preprocessing takes
    them).  Ids: Zipf(a) ranks per table, hashed into the table's id space.  Label: Bernoulli(sigmoid(logit)),
    logit = base_logit + scale * (mean over tables of hidden(id) + a hidden linear map of the dense features):
    a hidden model of the kind a DLRM tower can recover, with a click rate near Criteo's ~25%.
    """
    if n_samples < 1 or not cardinalities:
        raise ValueError(f"n_samples={n_samples} and {len(cardinalities)} tables must both be at least 1")
    rng = np.random.default_rng(seed)
    counts = rng.exponential(np.geomspace(0.5, 200.0, CRITEO_DENSE), size=(n_samples, CRITEO_DENSE))
    dense = np.log1p(np.floor(counts)).astype(np.float32)
    ids = np.stack([hashed_ids(zipf_ranks(n_samples, a, card, rng), t, card)
                    for t, card in enumerate(cardinalities)], axis=1)
    id_part = np.mean([hidden_weight(ids[:, t], seed * 131 + t) for t in range(len(cardinalities))], axis=0)
    w_dense = hidden_weight(np.arange(CRITEO_DENSE), seed + 7) / CRITEO_DENSE
    centred = dense - dense.mean(axis=0)
    logit = base_logit + scale * (2.0 * id_part + centred @ w_dense)
    labels = (rng.random(n_samples) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return CriteoLog(torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(labels), tuple(cardinalities))
