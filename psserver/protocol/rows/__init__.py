"""The sparse row core both sides use, network-free (issue 12).

``placement`` says which shard holds an id, ``init`` creates a row from (seed, id) alone, ``optim`` holds the
per-row optimizers, ``admission`` counts ids not yet stored, ``index`` maps ids to slots and ``table`` keeps the
live rows of one table (the shard's tables and the trainer's local baseline alike).  Nothing here touches
gRPC; the servicer maps ``errors`` to status codes like every other refusal.
"""
