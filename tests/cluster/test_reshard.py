"""Re-shard on restore with real ps-server processes: a sync job with dense partitions and a sparse table,
checkpointed on 2 shards, continued on 3 (``--restore-from``), then on 2 again -- the parameters, optimizer
state and table rows equal, bit for bit, those of the same job continued on 2 shards without a re-shard."""

import shutil
import subprocess

import torch
from torch import nn

from psserver.resharding.reshard_files import load_pieces
from tests.helpers import run_ranks
from trainer import connect
from trainer.tables.embedding import ShardedEmbedding
from trainer.local.procs import cli, start_shard

RANKS, B, STEPS = 2, 8, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = ShardedEmbedding("emb", 4)
        self.head = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids, x):
        return self.head(torch.cat([self.emb(ids), x], dim=1)).squeeze(-1)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 10**9, (B,), generator=g), torch.randn(B, 8, generator=g), torch.randn(B, generator=g)


def train(addresses: list[str], first: int) -> None:
    """STEPS sync steps from ``first`` by two trainers (threads), each connecting with the shards' list."""
    def trainer(rank: int) -> None:
        model = Net()
        with connect(",".join(addresses), model, rank=rank, num_trainers=RANKS, partitions=2, job_id="reshard",
                     optimizer={"name": "adam", "lr": 0.01}, round_timeout=120, connect_timeout=120) as ps:
            for k in range(first, first + STEPS):
                ids, x, y = batch(k, rank)
                nn.functional.mse_loss(model(ids, x), y).backward()
                ps.step(num_samples=B)
                ps.zero_grad()

    run_ranks(trainer, RANKS, timeout=300)


def phase(tmp_path, name: str, count: int, first: int, extra) -> list[str]:
    """``count`` shards started with ``extra(j)``, trained, stopped with SIGTERM (a final checkpoint each)."""
    procs = []
    try:
        for j in range(count):
            procs.append(start_shard(j, tmp_path / f"{name}{j}.log", extra_args=extra(j)))
        train([p.address for p in procs], first)
    finally:
        codes = [p.terminate() for p in procs]
    assert codes == [0] * count
    return [str(tmp_path / f"{name}{j}") for j in range(count)]


def state(dirs: list[str]) -> dict:
    """The job's whole state from its newest checkpoints: the flat vector, optimizer tensors, table rows."""
    pieces = [s for parts in load_pieces(dirs) for s in parts]
    out = {"params": torch.cat([s.params for s in pieces]), "version": {s.version for s in pieces}}
    for key, value in pieces[0].optimizer["state"][0].items():
        out[key] = torch.cat([s.optimizer["state"][0][key].reshape(-1) for s in pieces]) if value.dim() else value
    tables = [s.tables["emb"] for s in pieces if s.tables]
    ids = torch.cat([t["rows"]["ids"] for t in tables])
    order = torch.argsort(ids)
    out["row ids"] = ids[order]
    for key in ("rows", "optimizer_state"):
        out[f"table {key}"] = torch.cat([t["rows"][key] for t in tables])[order]
    out["table version"] = {t["version"] for t in tables}
    return out


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        same = torch.equal(got[key], want[key]) if torch.is_tensor(want[key]) else got[key] == want[key]
        assert same, f"{key} differs after the re-shard"


def restored_copy(tmp_path, dirs: list[str], name: str) -> list[str]:
    copies = [str(tmp_path / f"{name}{j}") for j in range(len(dirs))]
    for d, c in zip(dirs, copies):
        shutil.copytree(d, c)
    return copies


def test_a_job_resharded_2_to_3_to_2_continues_bit_for_bit_as_without_the_reshard(tmp_path):
    old = phase(tmp_path, "a", 2, 0, lambda j: ["--checkpoint-dir", str(tmp_path / f"a{j}")])
    # Without a re-shard: the same job continued on 2 shards by plain --restore (of copies), twice.
    ref1 = restored_copy(tmp_path, old, "r")
    phase(tmp_path, "r", 2, STEPS, lambda j: ["--checkpoint-dir", ref1[j], "--restore"])
    want_after_6 = state(ref1)
    phase(tmp_path, "r", 2, 2 * STEPS, lambda j: ["--checkpoint-dir", ref1[j], "--restore"])
    want_after_9 = state(ref1)
    assert want_after_9["version"] == {3 * STEPS} and len(want_after_9["row ids"]) > 2 * B

    three = phase(tmp_path, "b", 3, STEPS, lambda j: ["--restore-from", ",".join(old), "--num-shards", "3",
                                                     "--checkpoint-dir", str(tmp_path / f"b{j}")])
    assert_same(state(three), want_after_6)
    two = phase(tmp_path, "c", 2, 2 * STEPS, lambda j: ["--restore-from", ",".join(three), "--num-shards", "2",
                                                       "--checkpoint-dir", str(tmp_path / f"c{j}")])
    assert_same(state(two), want_after_9)
    assert "restored version 3 from" in (tmp_path / "b2.log").read_text()


def test_restoring_from_an_incomplete_set_of_old_shards_exits_1_with_one_line_naming_the_missing_shard(tmp_path):
    old = phase(tmp_path, "a", 2, 0, lambda j: ["--checkpoint-dir", str(tmp_path / f"a{j}")])
    run = subprocess.run(cli("psserver.cli") + ["--shard", "0", "--restore-from", old[0], "--num-shards", "3",
                                                "--checkpoint-dir", str(tmp_path / "new0")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert lines[-2].startswith("ps-server: error: cannot re-shard: the job had 2 shards but no checkpoint of shard 1")
    assert lines[-1].startswith("hint: re-shard from the checkpoints of one moment")
