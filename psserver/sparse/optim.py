"""Moved: the per-row optimizers are part of the contract now, in ``psserver.protocol.rows.optim``.

This module only re-exports them (README showed this path before 2026-11-24) and warns once on import.
"""

import warnings

from psserver.protocol.rows.optim import *  # noqa: F401,F403
from psserver.protocol.rows.optim import SPARSE_OPTIMIZERS, SparseOptimizerConfig  # noqa: F401

warnings.warn("psserver.sparse.optim moved to psserver.protocol.rows.optim; import it from there",
              DeprecationWarning, stacklevel=2)
