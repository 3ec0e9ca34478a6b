"""The health prober, in a process of its own (on the client's busy loop it would measure the client)."""

from __future__ import annotations

import logging
import signal
import time

import grpc
import grpc.aio

from trainer.tools.loadgen.config import LoadConfig
from trainer.tools.loadgen.records import Probe

log = logging.getLogger("ps-loadgen")


def prober_main(conn, interval: float, timeout: float) -> None:
    """Health.Check every ``interval`` s while told to probe; (sent at, seconds, code) per probe."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    request = health_pb2.HealthCheckRequest(service="")
    while True:
        command = conn.recv()
        if command[0] != "probe":
            return
        records = []
        with grpc.insecure_channel(command[1], options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            try:
                # The first probe should not pay for connecting.
                grpc.channel_ready_future(channel).result(timeout=timeout)
            except grpc.FutureTimeoutError:
                pass
            next_at = time.monotonic()
            while True:
                t0 = time.monotonic()
                try:
                    reply = check(request, timeout=timeout)
                    code = "OK" if reply.status == health_pb2.HealthCheckResponse.SERVING else "NOT_SERVING"
                except grpc.RpcError as e:
                    code = e.code().name
                t1 = time.monotonic()
                records.append(Probe(t0, t1 - t0, code))
                next_at = max(next_at + interval, t1)  # no catch-up burst after a slow probe
                if conn.poll(max(0.0, next_at - time.monotonic())):
                    conn.recv()  # "stop"
                    break
        conn.send(records)


class Prober:
    """A long-lived probing process, pointed at one shard per measurement."""

    def __init__(self, ctx, cfg: LoadConfig, name: str = "loadgen-prober"):
        self.cfg = cfg
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prober_main, args=(child, cfg.health_interval, cfg.health_timeout),
                                name=name, daemon=True)
        self.proc.start()
        child.close()
        self.probing = False

    def start(self, address: str) -> None:
        self.conn.send(("probe", address))
        self.probing = True

    def stop(self) -> list[Probe]:
        if not self.probing:
            return []
        self.probing = False
        try:
            self.conn.send(("stop",))
            if self.conn.poll(self.cfg.health_timeout + 30):
                return self.conn.recv()
        except (OSError, EOFError):
            pass
        log.warning("%s did not answer; its probes are lost", self.proc.name)
        return []

    def close(self) -> None:
        try:
            self.conn.send(("quit",))
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()
