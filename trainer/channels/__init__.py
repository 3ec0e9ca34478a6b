"""The channels to the shards: a shard's client with its retries and what a restart is, Register against the connect timeout, the dense slice's calls, a push's number and its encoded payload."""
