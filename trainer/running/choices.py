"""The names ps-trainer and ps-cluster offer as flag choices, importable without torch, and the one rule for a
knob of another mode.

The job's names come from where they are owned (psserver.protocol.rules, torch-free).  The trainer's own
(datasets, models) are owned by modules that import torch, which takes seconds (half a minute on a loaded
machine): the CLIs parse and refuse their flags from the copies here first, and
tests/unit/test_cli_imports.py checks that each copy equals its owner's.
"""

from psserver.protocol.rules import MODES, OPTIMIZERS, SPARSE_OPTIMIZERS, STALE_POLICIES, Mode  # noqa: F401
from psserver.protocol.rules import WIRE_DTYPE_CHOICES as WIRE_DTYPE_NAMES  # noqa: F401

DATASETS = ("mnist5k", "synthetic")  # trainer.workloads.data
MODELS = ("mlp", "cnn", "resnet18", "widemlp")  # trainer.workloads.models
REC_MODELS = ("mf", "ncf", "dlrm")  # trainer.workloads.recmodels
REC_DATASETS = ("movielens100k", "criteo-synth")  # trainer.workloads.rectrain
REC_BATCH = 1024  # trainer.workloads.rectrain
CRITEO_BATCH = 2048  # trainer.workloads.criteo
LOOPBACK_REFUSED_SECONDS = 60.0  # --refused-timeout's default (trainer.channels.registering)
# The help of the flags ps-trainer and ps-cluster both take, said once.
FLAG_HELP = {
    "--mode": "how the shards combine the trainers' gradients: sync rounds, async, or sync with a deadline "
              "(docs/modes.md)",
    "--replicas-to-aggregate": "stale-timeout: close a round after this many gradients (0: all live trainers)",
    "--stale-policy": "stale-timeout: drop late gradients, or scale them by 1/(1+staleness)",
}
# Each recommender dataset's models, the first its default (trainer.workloads.rectrain.DATASET_MODELS).
DATASET_MODELS = {"movielens100k": ("mf", "ncf"), "criteo-synth": ("dlrm",)}


def rec_defaults(dataset: str, num_trainers: int) -> tuple[str, int]:
    """(default model, default per-trainer batch) of a recommender dataset: its global batch over the trainers."""
    batch = CRITEO_BATCH if dataset == "criteo-synth" else REC_BATCH
    return DATASET_MODELS[dataset][0], max(1, batch // max(num_trainers, 1))

# A mode's own knobs: (flag, the config's / the parsed flags' attribute, the mode it belongs to).
MODE_KNOBS = (("--sync-timeout", "sync_timeout", Mode.STALE_TIMEOUT),
              ("--replicas-to-aggregate", "replicas_to_aggregate", Mode.STALE_TIMEOUT),
              ("--stale-policy", "stale_policy", Mode.STALE_TIMEOUT),
              ("--max-staleness", "max_staleness", Mode.ASYNC))
KNOB_DEFAULTS = {"sync_timeout": 0.0, "replicas_to_aggregate": 0, "stale_policy": "drop", "max_staleness": None}


def knobs_of_other_modes(settings, defaults: dict = KNOB_DEFAULTS) -> list[str]:
    """Each knob of another mode that ``settings`` (a TrainConfig or ps-cluster's flags) gives, as a warning:
    warned about and left out of the job, not refused -- deployments set them once for every mode (the compose
    file's PS_TRAINER_SYNC_TIMEOUT) and switch only the mode."""
    return [f"{flag} ({getattr(settings, attr)}) applies to --mode {owner} only, not {settings.mode}: ignored"
            for flag, attr, owner in MODE_KNOBS
            if settings.mode != owner and getattr(settings, attr) != defaults[attr]]
