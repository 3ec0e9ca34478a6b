"""``--restore`` of a shard that had switched layouts (docs/design/handoff-io.md#checkpoints-of-a-later-layout).

A sync job on two shards switches offline at round R (tests/integration/test_relayout.py's helper: layout 1 is one
shard, the first process, of two partitions); from then on that process checkpoints layout 1's pieces as
``L1-shard0-v…`` with the timeline.  It then dies between two steps (stopped without its final checkpoint) and a
real ``ps-server --restore`` process takes its port: it serves layout 1 from its checkpoints, so the trainer goes on
and ends bit for bit as the job that neither switched nor crashed.  An old-layout call to the restored process is
``layout-moved``, changing nothing, and it still serves.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import grpc
import torch
from torch.nn import functional as F

from psserver.protocol.rules import refused_layout_moved
from psserver.protocol.stubs import fetch_stat
from psserver.serving.server import ServerConfig, ShardServer
from psserver.serving.service import ServiceLimits
from psserver.state.checkpoint import file_name
from tests.conftest import RawShard
from tests.helpers import refused, wait_until
from tests.integration.test_layout_refusals import NEW, OLD, P, R as SWITCHED_AT, init, push
from tests.integration.test_relayout import OPTIMIZER, R, STEPS, Net, batches, switch_to_one_shard
from tests.offline_switch import switch_layout_offline
from tests.unit.test_layout_checkpoints import write_both_layouts
from trainer import connect
from trainer.local.procs import cli, start_shard

CRASH = R + 1  # the trainer's step that finds the restored process (layout 1 checkpointed at R and R + 1)


def crash(server: ShardServer) -> None:
    """Stop ``server`` as a kill would leave it: no final checkpoint (its writers have written what was due)."""
    server.layouts.final_checkpoint = lambda: None
    server.stop(grace=0)


def train(servers, ckpt=None, tmp_path=None, restarted=None):
    """STEPS sync steps of one trainer (switching at R when ``ckpt`` is given, then the crash at CRASH)."""
    model = Net()
    with connect(",".join(s.address for s in servers), model, mode="sync", rank=0, num_trainers=1,
                 optimizer=OPTIMIZER, connect_timeout=30) as ps:
        for i, (x, y) in enumerate(batches()):
            if ckpt is not None and i == R:
                switch_to_one_shard(servers)
            if ckpt is not None and i == CRASH:
                for where in (ckpt, ckpt / "partition-1"):
                    wait_until(lambda w=where: (w / file_name(0, CRASH, 1)).exists(), f"{where}'s layout-1 file")
                port = servers[0].port
                crash(servers[0])
                restarted.append(start_shard(0, tmp_path / "restored.log", port=port, extra_args=[
                    "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--restore"]))
            ps.prepare_step(len(x))
            F.cross_entropy(model(x), y).backward()
            ps.step(num_samples=len(x))
        ps.flush()
        return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]), dict(ps.client.counters)


def test_a_shard_switched_offline_and_killed_is_restored_in_layout_1_and_the_trainer_ends_bit_for_bit(
        shard_server, tmp_path):
    reference, _ = train([shard_server(shard=i).server for i in range(2)])
    ckpt = tmp_path / "ckpt0"
    servers = [shard_server(shard=0, checkpoint_dir=str(ckpt), checkpoint_every=1).server,
               shard_server(shard=1).server]
    restarted = []
    try:
        params, counters = train(servers, ckpt, tmp_path, restarted)
        stats = fetch_stat(restarted[0].address)
        log = restarted[0].log_path.read_text()
        # it checkpoints on in layout 1 (written behind the steps: waited for, not timed)
        wait_until(lambda: (ckpt / file_name(0, STEPS, 1)).exists(), "the restored process's layout-1 checkpoint")
    finally:
        for p in restarted:
            p.kill()
    assert torch.equal(params, reference)
    assert (counters.get("reconnects", 0), counters.get("steps_lost", 0), counters.get("steps_failed", 0)) == (0, 0, 0)
    assert (counters["layouts_followed"], counters["pushes_rerouted"]) == (1, 2)  # the switch, not the crash
    assert (stats.version, stats.counters["restored_version"]) == (STEPS, CRASH)
    assert "restored in layout 1" in log, log


def test_a_restored_shard_answers_an_old_layout_push_layout_moved_changing_nothing_and_still_serves(
        shard_server, tmp_path):
    ckpt = tmp_path / "ckpt"
    shard = shard_server(checkpoint_dir=str(ckpt), checkpoint_every=1)
    shard.register(spec=OLD)
    init(shard)
    for base in range(SWITCHED_AT):
        push(shard, 0, base, OLD.fingerprint, P, sequence=base + 1)
    switch_layout_offline(shard.server, 2, 0)
    wait_until(lambda: (ckpt / file_name(0, SWITCHED_AT, 1)).exists(), "layout 1's checkpoint at the switch")
    port = shard.server.port
    crash(shard.server)
    server = ShardServer(ServerConfig(shard=0, port=port, checkpoint_dir=str(ckpt), restore=True,
                                      limits=ServiceLimits(min_chunk_bytes=256))).start()
    try:
        with RawShard(server) as again:
            assert [(e.number, e.round) for e in server.layouts.timeline()] == [(0, 0), (1, SWITCHED_AT)]
            e = refused(lambda: push(again, 0, SWITCHED_AT - 1, OLD.fingerprint, P, sequence=9),
                        grpc.StatusCode.FAILED_PRECONDITION, "layout_epoch is 0", "layout 1", "holds nothing",
                        unchanged=SimpleNamespace(digest=lambda: again.digest(fingerprint=NEW.fingerprint)))
            assert refused_layout_moved(e) == 1
            reply = push(again, 1, SWITCHED_AT, NEW.fingerprint, P // 2)
            assert (reply.version, reply.layout_epoch) == (SWITCHED_AT + 1, 1)  # still serves, in layout 1
    finally:
        server.stop(grace=0)


def refused_cli(*args: str) -> list[str]:
    """``ps-server ARGS`` exits 1 before serving; its last two stderr lines (the cause, the hint)."""
    run = subprocess.run(cli("psserver.cli") + ["--shard", "0", *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    return run.stderr.strip().splitlines()[-2:]


def test_restore_of_a_folder_with_two_shards_of_one_later_layout_exits_1_with_one_line_and_a_hint(tmp_path):
    dirs = write_both_layouts(tmp_path)
    for f in Path(dirs[1]).glob("L1-*"):  # shard 1's layout-1 files beside shard 0's
        (Path(dirs[0]) / f.name).write_bytes(f.read_bytes())
    cause, hint = refused_cli("--checkpoint-dir", dirs[0], "--restore")
    assert cause == "ps-server: error: cannot restore: layout 1 has checkpoints of shards [0, 1] in one folder: a " \
                    "folder holds one process's checkpoints"
    assert hint.startswith("hint: restore each shard from its own --checkpoint-dir")


def test_restore_from_folders_that_mix_layouts_exits_1_naming_the_layout_and_the_missing_shard(tmp_path):
    dirs = write_both_layouts(tmp_path)
    cause, hint = refused_cli("--restore-from", ",".join(dirs[:2]), "--num-shards", "2", "--checkpoint-dir",
                              str(tmp_path / "new0"))
    assert cause.startswith("ps-server: error: cannot re-shard: the job's layout 1 has 3 shards but no layout-1 "
                            "checkpoint of shard 2 is in")
    assert hint.startswith("hint: re-shard from the checkpoints of one moment")
