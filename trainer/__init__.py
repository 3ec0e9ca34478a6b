"""psgrpc trainers: the Python API (`connect`), the training loop, the CLIs."""

__all__ = ["connect", "make_job", "ParameterServerTrainer"]


def __getattr__(name: str):
    """The API's names on first use, not at import: the CLIs must parse their flags before torch loads."""
    if name in __all__:
        from trainer import api

        return getattr(api, name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
