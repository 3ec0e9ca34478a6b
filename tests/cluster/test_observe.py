"""Observability of a real run: Prometheus metrics match the trainers' own counts; stats table; plots."""

import re
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_until
from trainer.local.procs import start_shard, start_trainer, wait_all

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "shard")))
            values[key] = s.value
    return values


def metric(values: dict, name: str, **labels) -> float:
    return values[(name, tuple(sorted(labels.items())))]


def test_metrics_scraped_during_and_after_a_run_match_the_trainers(tmp_path):
    shards = [start_shard(i, tmp_path / f"shard{i}.log", extra_args=["--metrics-port", "0"]) for i in range(2)]
    ports = [int(re.search(r"Prometheus metrics on http://127.0.0.1:(\d+)/metrics", s.log_path.read_text()).group(1))
             for s in shards]
    steps = 60
    try:
        ps = ",".join(s.address for s in shards)

        def trainer(r):
            return start_trainer(r, ps, tmp_path / f"t{r}.log",
                                 ["--num-trainers", "2", "--model", "mlp", "--dataset", "synthetic", "--steps",
                                  str(steps), "--metrics-file", str(tmp_path / f"t{r}.jsonl"), "--no-progress",
                                  "--threads", "1"])

        # During the run, at a point the test holds: rank 0 is in the job and waits for rank 1, which has not
        # started -- so the scrape must show one live trainer and nothing pushed, however loaded the machine.
        trainers = [trainer(0)]
        wait_until(lambda: all(metric(scrape(p), "psgrpc_live_trainers") == 1 for p in ports),
                   "rank 0 to register with both shards")
        for p in ports:
            during = scrape(p)
            assert metric(during, "psgrpc_live_trainers") == 1 and metric(during, "psgrpc_version") == 0
            assert metric(during, "psgrpc_pushes_total", outcome="applied") == 0
        trainers.append(trainer(1))
        assert wait_all(trainers, 300) == {"trainer0": 0, "trainer1": 0}
        import json

        done = [json.loads((tmp_path / f"t{r}.jsonl").read_text().splitlines()[-1]) for r in range(2)]
        after = [scrape(p) for p in ports]
        for values in after:
            assert metric(values, "psgrpc_version") == steps
            assert metric(values, "psgrpc_rounds_closed_total", reason="all_arrived") == steps
            assert metric(values, "psgrpc_pushes_total", outcome="applied") == sum(d["steps"] for d in done)
            assert metric(values, "psgrpc_pushes_total", outcome="stale_dropped") == sum(d["stale_pushes"] for d in done)
            assert metric(values, "psgrpc_live_trainers") == 0
            assert metric(values, "psgrpc_push_staleness_count") == 2 * steps
            assert metric(values, "psgrpc_apply_seconds_count") == steps
        assert sum(metric(v, "psgrpc_bytes_total", direction="in") for v in after) == sum(d["bytes_out"] for d in done)
        assert sum(metric(v, "psgrpc_bytes_total", direction="out") for v in after) == sum(d["bytes_in"] for d in done)

        table = subprocess.run([sys.executable, "-c", "from psserver.cli import entrypoint; entrypoint()", "stats",
                                "--ps", ps], capture_output=True, text=True, timeout=60)
        assert table.returncode == 0, table.stderr
        row = next(line for line in table.stdout.splitlines() if line.startswith("pushes applied"))
        assert row.split()[-2:] == [str(2 * steps), str(2 * steps)]
        assert f"shard 1 ({shards[1].address})" in table.stdout
    finally:
        for s in shards:
            s.kill()


def test_ps_plot_overlays_runs_into_a_png(tmp_path):
    runs = []
    for mode in ("sync", "async"):
        run = tmp_path / mode
        proc = subprocess.run([sys.executable, "-c", "from trainer.local.cluster import entrypoint; entrypoint()",
                               "--mode", mode, "--model", "mlp", "--dataset", "synthetic", "--steps", "30",
                               "--eval-every", "10", "--run-dir", str(run)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert (run / "plot.png").read_bytes()[:8] == PNG_MAGIC
        runs.append(str(run))
    out = tmp_path / "comparison.png"
    proc = subprocess.run([sys.executable, "-c", "from trainer.local.plots import entrypoint; entrypoint()", *runs,
                           "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert out.read_bytes()[:8] == PNG_MAGIC and image.shape[0] > 300 and image.shape[1] > 500


def test_ps_plot_names_a_folder_that_is_not_a_run(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "from trainer.local.plots import entrypoint; entrypoint()", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"no trainer metrics (*.jsonl files that a trainer started) in {tmp_path}" in proc.stderr
    assert "a ps-cluster run folder?" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 2
