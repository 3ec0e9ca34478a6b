"""The shard process on the wire: the gRPC server and its servicer (its RPCs' rooms), the step engine, the
runtime that runs state work off the event loop, replies and requests held, health and metrics."""
