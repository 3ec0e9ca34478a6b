"""Sparse tables on the trainer's side: the embedding modules, the row calls fanned out to the shards, their lanes, windows, caches and the rows fetched a batch ahead."""
