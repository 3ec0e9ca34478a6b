"""The contract between trainers and shards: what both sides must agree on, in one place.

The wire (``proto/`` generated from ``protos/``, ``codec``, ``fastwire``), the job a trainer registers (``job``:
spec, optimizer and mode names), how parameters are cut into shard slices and partitions (``layout``), the
learning-rate schedules and optimizers both sides build (``schedules``, ``optim``), refusals and their limits
(``errors``, ``limits``), channels and credentials (``security``), and the sparse row core (``rows``: table
spec, placement, row init, row optimizers, the row store).

Rule of this room: it imports nothing from the rest of ``psserver`` but ``psserver.common``, and nothing from
``trainer``; ``trainer`` imports ``psserver`` only through here and ``psserver.common``
(tests/unit/test_boundaries.py).
"""
