"""Write the shared inputs of the C++-PS comparison as .npy files (psgrpc's own generators, run once).

    PYTHONPATH=. .venv/bin/python docs/bench/cpp/make_data.py [--out docs/bench/cpp/data]

click_*.npy: trainer.workloads.recdata.make_click_log(300*512*4, seed=0) -- ids (raw, over 10^9), ids_compact (the same
ids renumbered 0..u-1, ClickLog.compact(), for TensorFlow's fixed-size variable), offsets, weights, labels.
mnist_x.npy / mnist_y.npy: trainer.workloads.data.load_mnist5k()'s 4,000 training digits, normalised, flattened to 784,
in a fixed shuffled order (numpy default_rng(0).permutation; the loader returns them sorted by class).
"""
import argparse
import json
from pathlib import Path

import numpy as np

from trainer.workloads.data import load_mnist5k
from trainer.workloads.recdata import make_click_log


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(Path(__file__).parent / "data"))
    p.add_argument("--samples", type=int, default=300 * 512 * 4)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = make_click_log(a.samples, seed=0)
    compact = log.compact()
    for name, t in (("ids", log.ids), ("ids_compact", compact.ids), ("offsets", log.offsets),
                    ("weights", log.weights), ("labels", log.labels)):
        np.save(out / f"click_{name}.npy", t.numpy())
    ds = load_mnist5k()
    order = np.random.default_rng(0).permutation(len(ds.y_train))  # the digits come sorted by class
    np.save(out / "mnist_x.npy", ds.x_train.reshape(len(ds.x_train), -1).numpy().astype(np.float32)[order])
    np.save(out / "mnist_y.npy", ds.y_train.numpy().astype(np.int64)[order])
    meta = {"click_samples": len(log), "click_ids": len(log.ids), "click_unique_ids": compact.id_space,
            "mnist_train": len(ds.y_train)}
    (out / "meta.json").write_text(json.dumps(meta) + "\n")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
