"""psgrpc trainers: the Python API (`connect`), the training loop, the CLIs."""

from trainer.api import ParameterServerTrainer, connect, make_job

__all__ = ["connect", "make_job", "ParameterServerTrainer"]
