"""Changing a running job's layout: the live re-shard's hand-off (pure machines and the shards' side of it), the
forward log, the coordinator (``ps-server reshard``), re-shard on restore, and the layouts a process serves."""
