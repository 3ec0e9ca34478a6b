"""One ps-bench training row (CNN on mnist5k, 2 trainers x 2 shards, sync, CPU) from the code on PYTHONPATH;
prints its steady samples/s (the same row ps-bench's table shows)."""
import sys, tempfile
from pathlib import Path
import os
if os.path.isdir(os.path.join(os.environ["PYTHONPATH"], "trainer", "tools")):
    from trainer.tools import bench
else:
    from trainer import bench
mode = sys.argv[1] if len(sys.argv) > 1 else "sync"
r = bench.train_run(f"ab-{mode}", Path(tempfile.mkdtemp()), bench.WORKLOADS["cnn-mnist5k"], "ps", mode, 2, 2, 120,
                    device="cpu")
print(f"{r['samples_per_sec']:.1f}")
