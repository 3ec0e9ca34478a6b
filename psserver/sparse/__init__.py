"""Sparse embedding tables served on a shard (``serving``: a job's tables, their rounds and pulls).

The network-free row core (placement, init, row optimizers, the row store) is part of the contract, in
``psserver.protocol.rows``: trainers use it too.
"""
