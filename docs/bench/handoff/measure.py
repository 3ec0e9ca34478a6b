"""Ad hoc (not ps-bench yet): a 2 -> 3 live re-shard of an 11,176,970-parameter sync job (ResNet-18's size), SGD
momentum, one pusher thread driving rounds on both old shards (both pushes of a round in flight at once: round
R-1's replies wait for DECIDE) while `ps-server reshard` runs in-process, unpaced.  Prints the hand-off, the
block (the coordinator's COMMIT line -> its DECIDE line), the rounds before/during and the sources' counters
(rounds throttled, replies held, copies again).
Run: PYTHONPATH=$PWD python docs/bench/handoff/measure.py (docs/handoff-io.md, "Measured")."""
import contextlib, dataclasses, io, sys, threading, time
import grpc, torch
from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.layout import Layout, shard_range
from psserver.protocol.proto import ps_pb2 as pb, ps_pb2_grpc as pbg
from psserver.resharding.reshard_cmd import reshard_main
from psserver.serving.server import ServerConfig, ShardServer

P = 11_176_970
job = JobSpec(mode="sync", num_trainers=1, num_shards=2, total_params=P, fingerprint="x",
              optimizer=OptimizerConfig("sgd", lr=0.01, momentum=0.9), tensors=(("w", (P,), "float32"),))
job = dataclasses.replace(job, fingerprint=Layout.from_shapes(job.tensors, 2).fingerprint())
servers = [ShardServer(ServerConfig(shard=i, host="127.0.0.1", port=0, lease_timeout=0)).start() for i in range(3)]
stubs = [pbg.ParameterServerStub(grpc.insecure_channel(s.address, options=[("grpc.max_receive_message_length", -1)])) for s in servers]
seq = [0, 0]
def hdr(i, n, v):
    seq[i] += 1
    return pb.ChunkHeader(rank=0, trainer_id="t0", fingerprint=job.fingerprint, dtype=pb.FLOAT32, length=n, version=v, num_samples=4, sequence=seq[i])
for i in range(2):
    a, b = shard_range(P, 2, i)
    stubs[i].Register(pb.RegisterRequest(rank=0, trainer_id="t0", expected_shard=i, job=job.to_proto()), timeout=30)
    h = pb.ChunkHeader(rank=0, trainer_id="t0", fingerprint=job.fingerprint, dtype=pb.FLOAT32, length=b - a)
    stubs[i].Init(encode(wire_tensor(torch.randn(b - a), pb.FLOAT32), h, 1 << 20), timeout=60)
grads = [torch.randn(b - a) for a, b in (shard_range(P, 2, i) for i in range(2))]
stop = threading.Event(); rounds = []
def pusher():
    while not stop.is_set():
        t0 = time.monotonic(); pushed = 0; calls = []
        for i in range(2):
            R = stubs[i].Reshard(pb.ReshardRequest(op=pb.ReshardRequest.STATUS), timeout=30).round
            v = stubs[i].GetStats(pb.StatsRequest(), timeout=30).version
            if not R or v < R:
                calls.append(stubs[i].Push.future(encode(wire_tensor(grads[i], pb.FLOAT32), hdr(i, grads[i].numel(), v),
                                                         1 << 20), timeout=60))
                pushed += 1
        for c in calls:
            c.result()
        if pushed == 2:
            rounds.append((t0, time.monotonic()))
        else:
            time.sleep(0.01)  # held at R until DECIDE: not a round
t = threading.Thread(target=pusher); t.start()
time.sleep(3)
t0 = time.monotonic()
class Stamped(io.StringIO):  # the coordinator's lines, each with the time it was printed
    lines = []
    def write(self, text):
        if text.strip():
            self.lines.append((time.monotonic(), text.strip()))
        return len(text)
with contextlib.redirect_stdout(Stamped()):
    rc = reshard_main(["--ps", ",".join(s.address for s in servers[:2]), "--to", ",".join(s.address for s in servers), "--wait", "300",
                      "--retire-wait", "0"])  # the pusher pushes only below R: round R never closes in layout 1
t1 = time.monotonic(); stop.set(); t.join()
at = {text.split(":")[0].split(" ")[0]: when for when, text in Stamped.lines}
for _, text in Stamped.lines:
    print(text)
print(f"block (COMMIT -> DECIDE done) {at['switched'] - at['committed']:.3f}s")
before = [b - a for a, b in rounds if b < t0]; during = [b - a for a, b in rounds if a >= t0 and b <= t1]
print(f"rc={rc} wall={t1-t0:.2f}s rounds before={len(before)} mean={sum(before)/max(len(before),1)*1000:.0f}ms "
      f"during={len(during)} mean={sum(during)/max(len(during),1)*1000:.0f}ms")
for s in servers[:2]:
    c = s.layouts.host(0).head.counters
    print({k: v for k, v in c.items() if k.startswith("handoff")})
for s in servers: s.stop(grace=0)
