"""The live re-shard's hand-off: its pure machines (``machine``, ``source``, ``dest``, ``termination``, the sync
tables' ``rows``, the dense ``forward_log``) and the shards' side of them (``shard_ops``, ``plan``, ``inbox``,
``decision``, ``shard_source``, ``shard_dest``, ``shard_rows``, ``shard_async``, the streams' ``wire``, the moved
``moved_books``)."""
