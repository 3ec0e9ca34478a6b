"""`ps-loadgen`: drive one real shard with N simulated trainers and measure how it scales.

ps-bench measures training; this measures serving: what one shard does when many
trainers wait on it at once.  Per N it records pushes/s, rounds/s, step latency,
health-check latency, the shard's CPU and RSS, and errors by status code.

* A simulated trainer is an asyncio coroutine on grpc.aio with its own channel
  and its own TCP connection (``grpc.use_local_subchannel_pool``: otherwise gRPC
  shares one connection among channels to one target), many per process
  (``--client-procs`` spreads them over processes).  It registers, rank 0 sends
  Init, then each loops PushPull (a tiny gradient; the model is P=1000 floats,
  so this measures serving, not bandwidth) and finally Leave.
* The health prober runs in a process of its own: on the client's busy event
  loop it would measure the client.  With ``--health-port`` each shard started
  here also answers Health on a free loopback port from a process of its own
  (ps-server ``--health-port``); a second prober, same interval, probes that port
  over the same windows, so both latencies are in every row.
* Every N has a hard deadline: a shard that stops serving yields a row saying so
  (rounds closed, errors by code), never a hang.
* ``ps-loadgen stall --streams K``: a stranger opens K Push streams that never
  send a byte; how much do health checks and a legitimate job suffer?

Processes share a small board of doubles (one writer per cell; see ``_Board``).
The orchestrator only reads it, polls it, and samples /proc around the window.
"""

from trainer.tools.loadgen.cli import entrypoint, main  # noqa: F401 (ps-loadgen)
