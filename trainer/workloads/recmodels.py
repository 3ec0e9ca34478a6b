"""Recommender models over embedding tables: mf and ncf for ratings, a bag model for the click log, DLRM for the
Criteo-shaped log.

Every table is built by one factory argument (``embedding`` / ``bias`` /
``embedding_bag``) called with the table's name, size and width: plain
``nn.Embedding(sparse=True)`` by default (the name unused), or the shard-backed
drop-in of trainer.tables.embedding (``sharded_factories``), without touching the models. The
tables are the only modules with sparse gradients; everything else (biases of
the MLPs, the global mean) is dense and goes through a dense optimizer.
"""

from __future__ import annotations

import zlib
from typing import Callable

import torch
from torch import nn

from psserver.protocol.rows.init import Initializer
from psserver.protocol.rows.optim import SparseOptimizerConfig

REC_MODELS = ("mf", "ncf", "dlrm")
EMBED_STD = 0.1  # small initial rows: N(0, 1) rows make the first dot products swamp the 1..5 ratings

EmbeddingFactory = Callable[[str, int, int], nn.Module]  # (table name, rows, dim)


def sparse_embedding(name: str, num: int, dim: int) -> nn.Embedding:
    """A table with sparse gradients, rows N(0, EMBED_STD^2)."""
    table = nn.Embedding(num, dim, sparse=True)
    nn.init.normal_(table.weight, std=EMBED_STD)
    return table


def zero_embedding(name: str, num: int, dim: int) -> nn.Embedding:
    """A bias table (dim 1) with sparse gradients, starting at zero so the first prediction is the global mean."""
    table = nn.Embedding(num, dim, sparse=True)
    nn.init.zeros_(table.weight)
    return table


class MF(nn.Module):
    """Biased matrix factorisation: r(u, i) = mean + b_u + b_i + <p_u, q_i>."""

    def __init__(self, num_users: int, num_items: int, dim: int = 32, mean: float = 0.0,
                 embedding: EmbeddingFactory = sparse_embedding, bias: EmbeddingFactory = zero_embedding):
        super().__init__()
        self.user = embedding("user", num_users, dim)
        self.item = embedding("item", num_items, dim)
        self.user_bias = bias("user_bias", num_users, 1)
        self.item_bias = bias("item_bias", num_items, 1)
        self.mean = nn.Parameter(torch.tensor(float(mean)))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        p, q = self.user(users), self.item(items)
        return self.mean + self.user_bias(users).squeeze(-1) + self.item_bias(items).squeeze(-1) + (p * q).sum(-1)


class NCF(nn.Module):
    """Neural collaborative filtering (He et al. 2017, the MLP part): an MLP over [p_u, q_i], plus the mean."""

    def __init__(self, num_users: int, num_items: int, dim: int = 32, hidden: tuple[int, ...] = (64, 32),
                 mean: float = 0.0, embedding: EmbeddingFactory = sparse_embedding):
        super().__init__()
        self.user = embedding("user", num_users, dim)
        self.item = embedding("item", num_items, dim)
        layers: list[nn.Module] = []
        width = 2 * dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)
        self.mean = nn.Parameter(torch.tensor(float(mean)))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.user(users), self.item(items)], dim=-1)
        return self.mean + self.mlp(x).squeeze(-1)


def make_rec_model(name: str, num_users: int, num_items: int, dim: int = 32, mean: float = 0.0, **kw) -> nn.Module:
    """``kw``: the factories (``embedding``, and ``bias`` for mf: NCF has no bias tables) and NCF's ``hidden``."""
    if name == "mf":
        kw.pop("hidden", None)
        return MF(num_users, num_items, dim, mean, **kw)
    if name == "ncf":
        kw.pop("bias", None)
        return NCF(num_users, num_items, dim, mean=mean, **kw)
    raise ValueError(f"unknown recommender model {name!r}: choose one of {', '.join(REC_MODELS)}")


def sparse_embedding_bag(name: str, num: int, dim: int, mode: str) -> nn.EmbeddingBag:
    table = nn.EmbeddingBag(num, dim, mode=mode, sparse=True)
    nn.init.normal_(table.weight, std=EMBED_STD)
    return table


class ClickModel(nn.Module):
    """Pooled bag of ids -> small MLP -> one click logit.

    ``mode`` is "sum" or "mean"; per-sample weights are torch's rule: only with "sum".
    """

    def __init__(self, num_embeddings: int, dim: int = 16, mode: str = "sum", hidden: int = 16,
                 embedding_bag: Callable[[str, int, int, str], nn.Module] = sparse_embedding_bag):
        super().__init__()
        if mode not in ("sum", "mean"):
            raise ValueError(f"pooling mode {mode!r} is not one of sum, mean")
        self.mode = mode
        self.bag = embedding_bag("bag", num_embeddings, dim, mode)
        self.head = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        if weights is not None and self.mode != "sum":
            raise ValueError(f"per-sample weights need mode 'sum', this model pools with {self.mode!r}")
        return self.head(self.bag(ids, offsets, per_sample_weights=weights)).squeeze(-1)


def mlp(widths: tuple[int, ...], last_relu: bool) -> nn.Sequential:
    """Linear layers through ``widths`` with ReLUs between them (and after the last if ``last_relu``)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM (Naumov et al. 2019): a bottom MLP takes the dense features to a ``dim`` vector; one table per
    categorical feature looks up a ``dim`` row; the interaction is every pairwise dot product of those vectors
    (``"dot"``) or their concatenation (``"cat"``); a top MLP over [bottom, interaction] gives one click logit.

    Tables are named ``c0``..``c25`` and made by the ``embedding`` factory (sharded ones via sharded_factories).
    """

    def __init__(self, cardinalities: tuple[int, ...], num_dense: int = 13, dim: int = 16,
                 bottom: tuple[int, ...] = (64,), top: tuple[int, ...] = (64, 32), interaction: str = "dot",
                 embedding: EmbeddingFactory = sparse_embedding):
        super().__init__()
        if interaction not in ("dot", "cat"):
            raise ValueError(f"interaction {interaction!r} is not one of dot, cat")
        self.interaction = interaction
        self.bottom = mlp((num_dense, *bottom, dim), last_relu=True)
        self.tables = nn.ModuleList(embedding(f"c{t}", n, dim) for t, n in enumerate(cardinalities))
        vectors = len(cardinalities) + 1
        width = dim + (vectors * (vectors - 1) // 2 if interaction == "dot" else (vectors - 1) * dim)
        self.top = mlp((width, *top, 1), last_relu=False)
        self._pairs = torch.triu_indices(vectors, vectors, offset=1)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        rows = [table(ids[:, t]) for t, table in enumerate(self.tables)]
        if self.interaction == "cat":
            z = torch.cat([x, *rows], dim=1)
        else:
            v = torch.stack([x, *rows], dim=1)  # (b, vectors, dim)
            dots = torch.bmm(v, v.transpose(1, 2))
            z = torch.cat([x, dots[:, self._pairs[0], self._pairs[1]]], dim=1)
        return self.top(z).squeeze(-1)


def table_seed(seed: int, name: str) -> int:
    """A seed per table, so that user k and item k do not start from the same row."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)


def sharded_factories(optimizer: SparseOptimizerConfig, seed: int = 0, **table_kw) -> dict:
    """``embedding``, ``bias`` and ``embedding_bag`` factories of shard-backed tables (trainer.tables.embedding) that
    start as the defaults above do: rows N(0, EMBED_STD^2) -- drawn from (seed, id), not torch's generator --
    and bias rows at zero.  ``table_kw``: the other ShardedEmbedding settings (admit_after, max_rows, mode...)."""
    from trainer.tables.embedding import ShardedEmbedding, ShardedEmbeddingBag

    def table(init: Initializer):
        def make(name: str, num: int, dim: int) -> nn.Module:
            return ShardedEmbedding(name, dim, num_embeddings=num, optimizer=optimizer, initializer=init,
                                    seed=table_seed(seed, name), **table_kw)
        return make

    def bag(name: str, num: int, dim: int, mode: str) -> nn.Module:
        return ShardedEmbeddingBag(name, dim, mode=mode, num_embeddings=num, optimizer=optimizer,
                                   initializer=Initializer("normal", EMBED_STD), seed=table_seed(seed, name),
                                   **table_kw)

    return {"embedding": table(Initializer("normal", EMBED_STD)), "bias": table(Initializer("uniform", 0.0)),
            "embedding_bag": bag}


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(table weights, everything else): the first go to a sparse optimizer, the rest to a dense one."""
    tables = [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    ids = {id(p) for p in tables}
    return tables, [p for p in model.parameters() if id(p) not in ids]
