"""psgrpc parameter-server shards: layout, modes, optimizer, gRPC service."""
