"""Start and stop a shard's gRPC server (with the standard health service)."""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from psserver.checkpoint import Checkpointer
from psserver.codec import DEFAULT_CHUNK_BYTES
from psserver.security import ServerSecurity
from psserver.service import ParameterServerService, add_service
from psserver.shard import Shard

log = logging.getLogger(__name__)

SERVICE_NAME = "psgrpc.v1.ParameterServer"


@dataclass(frozen=True)
class ServerConfig:
    shard: int
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 0  # 0: pick a free port
    max_workers: int = 32  # concurrent RPCs served; pulls that wait for a round hold one each
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_message_bytes: int = 16 << 20  # per gRPC message; larger ones get RESOURCE_EXHAUSTED from gRPC
    max_push_bytes: int = 4 << 30  # whole Init/Push stream
    lease_timeout: float = 5.0  # seconds of silence after which a trainer leaves the live set
    checkpoint_dir: str = ""  # where checkpoints go ("" : none)
    checkpoint_every: int = 100  # versions between checkpoints
    restore: bool = False  # resume from the newest valid checkpoint in checkpoint_dir
    shutdown_grace: float = 5.0  # seconds in-flight calls get to finish on stop
    security: ServerSecurity = ServerSecurity()
    nonfinite: str = "refuse"  # NaN/Inf in a gradient: "refuse" (INVALID_ARGUMENT) or "skip" (counted, not applied)

    def __post_init__(self) -> None:
        if self.shard < 0:
            raise ValueError(f"The shard index ({self.shard}) must be zero or more.")
        if not 0 <= self.port < 65536:
            raise ValueError(f"The port ({self.port}) must be between 0 and 65535.")
        if self.restore and not self.checkpoint_dir:
            raise ValueError("--restore needs --checkpoint-dir: where should the checkpoint come from?")
        if self.chunk_bytes < 16 or self.chunk_bytes > self.max_message_bytes // 2:
            raise ValueError(
                f"The chunk size ({self.chunk_bytes} bytes) must be between 16 and half the message limit "
                f"({self.max_message_bytes // 2})."
            )


class ShardServer:
    """A running shard: ``ShardServer(cfg).start()`` then ``.port``, ``.stop()``."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        checkpointer = (Checkpointer(cfg.checkpoint_dir, cfg.shard, cfg.checkpoint_every)
                        if cfg.checkpoint_dir else None)
        self.shard = Shard(cfg.shard, lease_timeout=cfg.lease_timeout, checkpointer=checkpointer)
        if cfg.restore:
            self.shard.restore()
        self.health = health.HealthServicer()
        opts = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        # Calls beyond max_workers are refused with RESOURCE_EXHAUSTED at once rather than queued behind
        # pulls that wait for a round.
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.max_workers), options=opts,
            maximum_concurrent_rpcs=cfg.max_workers,
            interceptors=cfg.security.interceptors(lambda method: self.shard.count("refused_UNAUTHENTICATED")),
        )
        add_service(ParameterServerService(self.shard, cfg.max_push_bytes, cfg.chunk_bytes, nonfinite=cfg.nonfinite),
                    self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0

    def start(self) -> "ShardServer":
        address = f"{self.cfg.host}:{self.cfg.port}"
        self.cfg.security.warn_if_exposed(self.cfg.host)
        creds = self.cfg.security.credentials()
        try:
            if creds is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, creds)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address}: {e}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {address}: the address is in use or not local")
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("shard %d serving on %s:%d", self.cfg.shard, self.cfg.host, self.port)
        return self

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING at once, in-flight calls drain within ``grace``, then a final checkpoint."""
        self.health.enter_graceful_shutdown()
        self.shard.stop()  # pulls waiting for a round return UNAVAILABLE: their trainers retry elsewhere/later
        self.server.stop(self.cfg.shutdown_grace if grace is None else grace).wait()
        self.shard.final_checkpoint()
