"""ps-plot reads every trainer's metrics file in a run folder, whatever the files are called (no network)."""

import json

from trainer.local.plots import load_curves, plot_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_trainer(path, rank, t0, losses, evals=(), mode="async"):
    recs = [dict(event="start", rank=rank, time=t0, config=dict(mode=mode))]
    recs += [dict(event="step", rank=rank, time=t0 + 1 + i, step=i + 1, loss=loss) for i, loss in enumerate(losses)]
    recs += [dict(event="eval", rank=rank, time=t0 + 10, step=len(losses), test_accuracy=a) for a in evals]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_every_trainer_file_is_found_without_a_trainer0_file(tmp_path):
    write_trainer(tmp_path / "trainer3.jsonl", 3, 100.0, [2.0, 1.5], evals=[0.4])
    write_trainer(tmp_path / "rank1-metrics.jsonl", 1, 98.0, [2.5])
    (tmp_path / "events.jsonl").write_text('{"event": "something else"}\n')  # not a trainer's file
    c = load_curves(tmp_path)
    assert c["label"] == "async, 2 trainers"
    assert list(c["ranks"]) == [1, 3]
    # One clock for the run: seconds since the first trainer (rank 1, at t=98) started.
    assert c["ranks"][1]["loss_t"] == [1.0] and c["ranks"][3]["loss_t"] == [3.0, 4.0]
    assert c["ranks"][3]["acc"] == [0.4] and c["ranks"][1]["acc"] == []


def test_an_appended_file_is_read_from_its_last_start(tmp_path):
    path = tmp_path / "trainer0.jsonl"
    write_trainer(path, 0, 0.0, [9.0, 9.0], mode="sync")
    first = path.read_text()
    write_trainer(path, 0, 50.0, [1.0])
    path.write_text(first + path.read_text())
    c = load_curves(tmp_path)
    assert c["label"] == "async, 1 trainer" and c["ranks"][0]["loss"] == [1.0]


def test_plot_of_a_run_without_trainer0_is_a_png(tmp_path):
    write_trainer(tmp_path / "trainer1.jsonl", 1, 0.0, [2.0, 1.0], evals=[0.5])
    write_trainer(tmp_path / "trainer2.jsonl", 2, 0.5, [2.1, 1.1])
    out = plot_runs([tmp_path], tmp_path / "plot.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
