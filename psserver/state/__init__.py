"""A shard's state and the rules that change it: the dense slice and its optimizer, rounds and the modes' pure
decisions, the one executor, push books, pull snapshots, checkpoints on disk, the memory budget, and the metrics
that report them."""
