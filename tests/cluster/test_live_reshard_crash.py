"""A job re-sharded live survives a shard crash (issue 24 item 4; docs/design/handoff-io.md#checkpoints-of-a-later-layout).

Two sync ``ps-trainer`` processes train on two ``ps-server`` processes that checkpoint every version; ``ps-server
reshard`` moves the job to three while they train (as tests/cluster/test_live_reshard.py does).  A few rounds into
layout 1, shard 1 -- a source, whose folder holds layout 0's files and layout 1's -- is killed (SIGKILL) and
started again with ``--restore`` on its port.  It comes back in layout 1 from its ``L1-shard1-v…`` files, the
trainers finish, and rank 0's final pull equals bit for bit the job that never re-sharded nor crashed; each of the
three shards applied each layout-1 round once (``pushes_applied``).

No timing decides the outcome.  The trainers reach shard 1 through a switchable proxy (its address is shard 1's in
both layouts): the proxy refuses every connection before the kill, so no answer of the dying process reaches a
trainer after that; the kill waits until shard 1's newest checkpoint is of the version it is at.  Whatever it did
after that checkpoint was never answered, so the trainers send it again to the restored process (a push it holds
already is answered DUPLICATE from its restored book).
"""


import torch

from psserver.protocol.stubs import fetch_stat
from psserver.state.checkpoint import list_checkpoints, parse_name
from tests.cluster.helpers import live_reshard, reshard_shards, restart_on_its_port
from tests.cluster.test_live_reshard import STEPS, done_line, reference, run_trainers
from tests.helpers import wait_until
from tests.integration.switchproxy import SwitchProxy
from trainer.local.procs import wait_all

VICTIM = 1
PACE = ["--step-delay", "0.05"]  # the run lasts long enough for a switch, two rounds in layout 1 and the kill


def newest_checkpoint(directory, shard: int, layout: int) -> int:
    files = list_checkpoints(directory, shard, layout) if directory.is_dir() else []
    return parse_name(files[0].name)[2] if files else -1


def test_a_shard_killed_after_a_live_2_to_3_reshard_restores_in_layout_1_and_the_job_ends_bit_for_bit(
        tmp_path, capsys):
    ckpt = [tmp_path / f"ckpt{i}" for i in range(3)]
    args = [["--checkpoint-dir", str(ckpt[i]), "--checkpoint-every", "1"] for i in range(3)]
    shards = reshard_shards(tmp_path, args)
    proxy = SwitchProxy(shards[VICTIM].address)
    seen = [shards[0].address, proxy.address, shards[2].address]  # what trainers and the coordinator call
    procs = list(shards)
    try:
        procs += run_trainers(tmp_path, "live", ",".join(seen[:2]), PACE)
        wait_until(lambda: all(fetch_stat(s.address).version >= 2 for s in shards[:2]), "round 2", timeout=120)
        R, _ = live_reshard(capsys, seen[:2], seen)
        assert R + 2 < STEPS, f"the switch fell at round {R}: too late to crash a shard in layout 1"
        wait_until(lambda: fetch_stat(shards[VICTIM].address).version >= R + 2, "two rounds in layout 1", timeout=120)
        proxy.refuse()  # from here no answer of shard 1 reaches a trainer
        wait_until(lambda: newest_checkpoint(ckpt[VICTIM], VICTIM, 1) == fetch_stat(shards[VICTIM].address).version,
                   "shard 1's checkpoint of the version it is at")
        killed_at = newest_checkpoint(ckpt[VICTIM], VICTIM, 1)
        shards[VICTIM].kill()  # SIGKILL: no final checkpoint
        restarted = restart_on_its_port(shards[VICTIM], VICTIM, tmp_path / "shard1-restarted.log", args[VICTIM])
        procs.append(restarted)
        proxy.forward()
        codes = wait_all(procs[3:5], 300)
        assert codes == {"trainer0": 0, "trainer1": 0}, procs[3].log_tail(40) + procs[4].log_tail(40)
        stats = [fetch_stat(a) for a in (shards[0].address, restarted.address, shards[2].address)]
    finally:
        proxy.close()
        for p in procs:
            p.kill()
    assert R < killed_at < STEPS
    log = (tmp_path / "shard1-restarted.log").read_text()
    assert "restored in layout 1" in log and f"restored version {killed_at}" in log, log[-2000:]
    for s in stats:  # layout 1's job on each of the three: from R to the end, each round applied once
        c = s.counters
        assert (s.version, c["layouts_switched"], c["steps"], c["pushes_applied"]) == (
            STEPS, 1, STEPS - R, 2 * (STEPS - R)), dict(c)
    assert stats[VICTIM].counters["restored_version"] == killed_at
    for r in range(2):
        done = done_line(tmp_path / f"live{r}.log")
        assert (done["layouts_followed"], done["steps"], done["steps_failed"], done["steps_lost"]) == (
            1, STEPS, 0, 0), done
    got, want = torch.load(tmp_path / "live.pt"), reference(tmp_path)  # rank 0's final pull, in layout 1
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the job that never re-sharded nor crashed"
