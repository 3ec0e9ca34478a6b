"""A shard's partition: ``Shard`` (a slice of the job's parameters and its tables) composed of its rooms, one per
family of calls -- register and join, pulls, pushes, rounds, row calls, checkpoints, stats -- and the host of the
partitions one process serves."""
