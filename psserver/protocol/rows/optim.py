"""Per-row optimizers for sparse tables: each update touches only the rows of one push.

A shard keeps, next to each live row, the optimizer state of that row alone, and
updates rows of one push with the unique ids and the gradient rows summed over
repeats (what ``grad.coalesce()`` gives torch's sparse optimizers).  With g the
summed gradient row, w the row, lr the rate (elementwise unless said otherwise):

- ``sgd``:             w -= lr * g                                  (torch.optim.SGD, sparse)
- ``adagrad``:         a += g*g;  w -= lr * g / (sqrt(a) + eps)     (torch.optim.Adagrad, sparse;
                       a per element, starts at initial_accumulator_value)
- ``rowwise_adagrad``: a += mean_j(g_j*g_j);  m = lr / (sqrt(a) + eps);  w -= m * g
                       (one scalar a per row: FBGEMM's EXACT_ROWWISE_ADAGRAD, TorchRec's
                       row-wise Adagrad, without weight decay -- dim times less state)
- ``adam``:            m += (g - m)(1 - b1);  v += (g*g - v)(1 - b2);
                       w -= lr * sqrt(1 - b2**t) / (1 - b1**t) * m / (sqrt(v) + eps)
                       (torch.optim.SparseAdam: moments move only for touched rows -- "lazy" --
                       and t counts the table's steps, i.e. every push to the table, including
                       those that touch none of this row: SparseAdam's step is per tensor.)

The arithmetic follows torch's own order of operations (see the parity tests), so
a table on the shards equals a single-process ``nn.Embedding(sparse=True)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from psserver.protocol.rules import SPARSE_OPTIMIZERS  # noqa: F401 (the names, owned by the contract's rules)

# torch's defaults for Adagrad and SparseAdam; FBGEMM's for row-wise Adagrad.
DEFAULT_EPS = {"sgd": 0.0, "adagrad": 1e-10, "rowwise_adagrad": 1e-8, "adam": 1e-8}


def _finite(name: str, value) -> float:
    """``value`` as a float if it is a finite real number; a ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"optimizer {name} ({value!r}) must be a finite number")
    return float(value)


@dataclass(frozen=True)
class SparseOptimizerConfig:
    """A table's optimizer and its hyper-parameters (same meaning as in torch.optim)."""

    name: str = "sgd"
    lr: float = 0.01
    eps: float | None = None  # None: the default of DEFAULT_EPS for ``name``
    beta1: float = 0.9
    beta2: float = 0.999
    initial_accumulator_value: float = 0.0  # adagrad and rowwise_adagrad

    def __post_init__(self) -> None:
        if self.name not in SPARSE_OPTIMIZERS:
            raise ValueError(f"optimizer name ({self.name!r}) must be one of {', '.join(SPARSE_OPTIMIZERS)}")
        if self.eps is None:
            object.__setattr__(self, "eps", DEFAULT_EPS[self.name])
        if not _finite("lr", self.lr) > 0:
            raise ValueError(f"optimizer lr ({self.lr!r}) must be greater than zero")
        for name in ("eps", "initial_accumulator_value"):
            if _finite(name, getattr(self, name)) < 0:
                raise ValueError(f"optimizer {name} ({getattr(self, name)!r}) must be zero or more")
        for name in ("beta1", "beta2"):
            if not 0 <= _finite(name, getattr(self, name)) < 1:
                raise ValueError(f"optimizer {name} ({getattr(self, name)!r}) must be at least 0 and less than 1")


def state_width(cfg: SparseOptimizerConfig, dim: int) -> int:
    """float32 values of optimizer state per row: what a row costs besides its ``dim`` weights."""
    return {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 1, "adam": 2 * dim}[cfg.name]


def initial_value(cfg: SparseOptimizerConfig) -> float:
    """Every element of a new row's state: accumulators at their initial value, Adam's moments at zero."""
    return cfg.initial_accumulator_value if cfg.name in ("adagrad", "rowwise_adagrad") else 0.0


def initial_state(cfg: SparseOptimizerConfig, n: int, dim: int) -> torch.Tensor:
    """State of ``n`` new rows (``initial_value``)."""
    return torch.full((n, state_width(cfg, dim)), initial_value(cfg), dtype=torch.float32)


def update_rows(cfg: SparseOptimizerConfig, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor,
                step: int) -> None:
    """Apply one update in place to ``rows`` (n, dim) and their ``state`` (n, width).

    ``grads`` holds one summed gradient row per (unique) row; ``step`` is the table's step
    count including this one (only Adam's bias correction reads it).
    """
    if cfg.name == "sgd":
        rows.add_(grads, alpha=-cfg.lr)
    elif cfg.name == "adagrad":
        _adagrad(cfg, rows, state, grads)
    elif cfg.name == "rowwise_adagrad":
        _rowwise_adagrad(cfg, rows, state, grads)
    else:
        _adam(cfg, rows, state, grads, step)


def _adagrad(cfg: SparseOptimizerConfig, rows: torch.Tensor, acc: torch.Tensor, g: torch.Tensor) -> None:
    """torch's sparse Adagrad branch: acc += g**2; w -= lr * g / (sqrt(acc) + eps)."""
    acc.add_(g.pow(2))
    rows.add_(g / acc.sqrt().add_(cfg.eps), alpha=-cfg.lr)


def _rowwise_adagrad(cfg: SparseOptimizerConfig, rows: torch.Tensor, acc: torch.Tensor, g: torch.Tensor) -> None:
    """FBGEMM's exact row-wise Adagrad: one accumulator per row, grown by the row's mean square."""
    acc.add_(g.pow(2).mean(dim=1, keepdim=True))
    multiplier = cfg.lr / (acc.sqrt() + cfg.eps)
    rows.sub_(multiplier * g)


def _adam(cfg: SparseOptimizerConfig, rows: torch.Tensor, state: torch.Tensor, g: torch.Tensor, step: int) -> None:
    """torch.optim.SparseAdam's update, operation for operation, on the touched rows."""
    dim = rows.shape[1]
    m, v = state[:, :dim], state[:, dim:]
    m_update = g.sub(m).mul_(1 - cfg.beta1)
    v_update = g.pow(2).sub_(v).mul_(1 - cfg.beta2)
    m.add_(m_update)
    v.add_(v_update)
    denom = v.sqrt().add_(cfg.eps)
    step_size = cfg.lr * math.sqrt(1 - cfg.beta2**step) / (1 - cfg.beta1**step)
    rows.add_(-step_size * m.div(denom))
