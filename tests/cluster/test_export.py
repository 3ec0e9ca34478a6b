"""`ps-server export` after a real run: the state dict assembled from the shards' checkpoints is the trained model."""

import subprocess

import torch

from trainer.local.procs import cli, start_shard, start_trainer, wait_all


def test_export_from_the_shards_checkpoints_equals_the_trainers_model(tmp_path):
    ckpt = tmp_path / "ckpt"  # both shards write into one directory; their files are named by shard
    shards = [start_shard(i, tmp_path / f"shard{i}.log",
                          extra_args=["--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", "--exit-when-done"])
              for i in range(2)]
    procs = list(shards)
    try:
        ps = ",".join(s.address for s in shards)
        common = ["--num-trainers", "2", "--model", "mlp", "--dataset", "synthetic", "--steps", "12",
                  "--job-id", "export-test", "--no-progress", "--threads", "1"]
        procs += [start_trainer(r, ps, tmp_path / f"t{r}.log",
                                common + (["--output", str(tmp_path / "model.pt")] if r == 0 else []))
                  for r in range(2)]
        codes = wait_all(procs, 300)  # the shards exit once both trainers left, after their final checkpoint
    finally:
        for p in procs:
            p.kill()
    assert codes == {"shard0": 0, "shard1": 0, "trainer0": 0, "trainer1": 0}, procs[2].log_tail()
    out = tmp_path / "exported.pt"
    proc = subprocess.run(cli("psserver.cli") + ["export", "--checkpoint-dir", str(ckpt), "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "of job 'export-test' from 2 shards at version 12" in proc.stdout
    exported = torch.load(out, weights_only=True)
    trained = torch.load(tmp_path / "model.pt", weights_only=True)
    assert list(exported) == list(trained)  # the MLP has no buffers: every entry is a trained parameter
    for name, tensor in trained.items():
        assert exported[name].shape == tensor.shape and torch.equal(exported[name], tensor), name
