"""Sparse embedding tables on the shards (issue 12): the network-free core.

``placement`` says which shard holds an id, ``init`` creates a row from (seed, id)
alone, ``optim`` holds the per-row optimizers, ``admission`` counts ids not yet
stored, and ``table`` keeps the live rows of one table on one shard.  Nothing here
touches gRPC; the servicer maps ``errors`` to status codes like every other refusal.
"""
