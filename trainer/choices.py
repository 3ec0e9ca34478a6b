"""The names ps-trainer and ps-cluster offer as flag choices, importable without torch.

The modules that own these names (psserver.protocol.job, trainer.models, ...) import
torch, which takes seconds (half a minute on a loaded machine): the CLIs parse
and refuse their flags from this module first.  tests/unit/test_cli_imports.py
checks that every name here equals its owner's.
"""

from psserver.protocol.rules import MODES  # noqa: F401 (torch-free where it is owned)

OPTIMIZERS = ("sgd", "adam", "adamw")  # psserver.protocol.job
STALE_POLICIES = ("drop", "scale")  # psserver.protocol.job
WIRE_DTYPE_NAMES = ("float32", "float16", "bfloat16")  # psserver.protocol.job.WIRE_DTYPES
SPARSE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")  # psserver.protocol.rows.optim
DATASETS = ("mnist5k", "synthetic")  # trainer.data
MODELS = ("mlp", "cnn", "resnet18", "widemlp")  # trainer.models
REC_MODELS = ("mf", "ncf")  # trainer.recmodels
REC_DATASETS = ("movielens100k",)  # trainer.rectrain
REC_BATCH = 1024  # trainer.rectrain
