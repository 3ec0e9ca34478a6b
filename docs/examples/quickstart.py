"""README's Python API example, whole: a small CNN trained on 5,000 MNIST digits through two shards.

    python docs/examples/quickstart.py                     # starts two shards on loopback, stops them at the end
    python docs/examples/quickstart.py --ps HOST:PORT,HOST:PORT --steps 300

It prints its progress every 10 steps and, last, the model's test accuracy.
"""

import argparse
import tempfile
from pathlib import Path

import torch
from torch.nn import functional as F

from trainer import connect  # pip install -e .  (this repository)
from trainer.workloads.data import load_mnist5k
from trainer.workloads.models import build_model
from trainer.local.procs import start_shard


def train(ps_addresses: str, steps: int) -> float:
    """Train for ``steps`` steps against the shards at ``ps_addresses``; returns the test accuracy."""
    data = load_mnist5k()
    model = build_model("cnn", data.shape)
    with connect(ps_addresses, model, mode="sync", optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9},
                 rank=0, num_trainers=1) as ps:  # the optimizer runs on the shards; leaving the block leaves the job
        batches = torch.randperm(len(data.x_train)).split(64)
        for step in range(1, steps + 1):
            idx = batches[(step - 1) % len(batches)]
            loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            loss.backward()
            ps.step(num_samples=len(idx))  # push the gradients, pull the new weights, zero the gradients
            if step % 10 == 0 or step == steps:
                print(f"step {step}/{steps}  loss {loss.item():.3f}", flush=True)
    with torch.no_grad():
        return (model(data.x_test).argmax(1) == data.y_test).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ps", default="", help="the shards' HOST:PORT list; none: start two on 127.0.0.1")
    parser.add_argument("--steps", type=int, default=60, help="training steps of 64 digits (default 60)")
    args = parser.parse_args()
    shards = []
    with tempfile.TemporaryDirectory(prefix="quickstart-") as logs:
        try:
            if not args.ps:
                print("starting 2 shards on 127.0.0.1 ...", flush=True)
                shards = [start_shard(i, Path(logs) / f"shard{i}.log") for i in range(2)]
                args.ps = ",".join(s.address for s in shards)
            print(f"training for {args.steps} steps with the shards at {args.ps}", flush=True)
            accuracy = train(args.ps, args.steps)
            print(f"test accuracy {accuracy:.4f} after {args.steps} steps", flush=True)
        except BaseException:
            for s in shards:  # their logs go with the temporary folder: show how each ended
                print(f"--- {s.name} ({s.log_path.name}):\n{s.log_tail()}", flush=True)
            raise
        finally:
            for s in shards:
                s.terminate()  # SIGTERM, then SIGKILL if a shard does not stop within 10 s


if __name__ == "__main__":
    main()
