"""psgrpc trainers: the Python API (`connect`), the training loop, the CLIs.

What a user's script needs is importable from here (``from trainer import connect, ShardedEmbeddingBag,
SparseOptimizerConfig``): the connection, the tables and how their rows are optimised and initialised, and the
errors a step raises -- no path into the server's package.
"""

__all__ = ["connect", "make_job", "ParameterServerTrainer", "StepFailed", "ShardedEmbedding", "ShardedEmbeddingBag",
           "SparseOptimizerConfig", "Initializer"]

_HOMES = {"connect": "trainer.stepping.api", "make_job": "trainer.stepping.api", "ParameterServerTrainer": "trainer.stepping.api",
          "StepFailed": "trainer.stepping.attempt", "ShardedEmbedding": "trainer.tables.embedding",
          "ShardedEmbeddingBag": "trainer.tables.embedding", "SparseOptimizerConfig": "psserver.protocol.rows.optim",
          "Initializer": "psserver.protocol.rows.init"}


def __getattr__(name: str):
    """The API's names on first use, not at import: the CLIs must parse their flags before torch loads."""
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
