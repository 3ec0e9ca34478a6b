"""This trainer's rank and the job's trainers from ``RANK`` and ``WORLD_SIZE``, as torchrun sets them.

``ps-trainer`` (without --rank / --num-trainers) and ``connect()`` (without
``rank`` / ``num_trainers``) read them, so a script started by
``torchrun --nproc-per-node 2`` needs no flags of its own; a value given
explicitly wins over the environment.  Torch-free: ps-trainer checks them
before it imports torch.
"""

from __future__ import annotations

import os
from typing import Mapping

HINT = "as torchrun sets them: RANK in 0..WORLD_SIZE-1"


def rank_and_world(rank: int | None, num_trainers: int | None, names: tuple[str, str] = ("rank", "num_trainers"),
                   env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, num_trainers): each given value, else ``RANK`` / ``WORLD_SIZE`` from ``env``, else 0 / 1.

    ``names``: how the caller's own two settings are called in messages (``--rank``, ``--num-trainers`` for
    ps-trainer).  A malformed variable, or a rank outside the job's trainers where either came from the
    environment, raises ValueError naming where each came from and its value (given values alone are checked
    by the caller's own rules)."""
    env = os.environ if env is None else env
    rank_from = names[0] if rank is not None else "RANK"
    world_from = names[1] if num_trainers is not None else "WORLD_SIZE"
    if num_trainers is None:
        num_trainers = env_count(env, "WORLD_SIZE", minimum=1, default=1)
    if rank is None:
        rank = env_count(env, "RANK", minimum=0, default=0)
    from_env = {rank_from, world_from} & {name for name in ("RANK", "WORLD_SIZE") if name in env}
    if from_env and not 0 <= rank < num_trainers:
        raise ValueError(f"{rank_from} ({rank}) must be below {world_from} ({num_trainers}), {HINT}; pass "
                         f"{' and '.join(names)} to override the environment")
    return rank, num_trainers


def env_count(env: Mapping[str, str], name: str, minimum: int, default: int) -> int:
    """The whole number in ``env[name]`` (``default`` when unset); ValueError naming it and its value if it is
    not one of at least ``minimum``."""
    raw = env.get(name)
    if raw is None:
        return default
    if not raw.strip().isdigit() or int(raw) < minimum:
        raise ValueError(f"{name} ({raw!r}) must be a whole number of at least {minimum}, {HINT}; unset it or "
                         f"fix the launcher that sets it")
    return int(raw)
