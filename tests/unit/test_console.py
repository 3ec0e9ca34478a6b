"""ps-cluster's console (trainer.local.console, trainer.local.cluster.Console): one status line per trainer, redrawn in place on
a terminal, a compact line every few seconds otherwise; formatting and timing decided without a network or a clock."""

import io
import json
import logging

from trainer.local import cluster

from trainer.local import console


def test_a_trainer_without_metrics_yet_reads_starting():
    assert console.trainer_status(1, {}, 0) == "trainer 1  starting"


def test_the_status_line_shows_step_of_total_epoch_loss_and_rate_but_no_accuracy_before_an_evaluation():
    line = console.trainer_status(0, {"event": "step", "step": 120, "epoch": 1, "loss": 0.1234,
                                      "samples_per_sec": 1402.6}, 186)
    assert line == "trainer 0  step 120/186  epoch 1  loss 0.123  1403 samples/s"
    assert "acc" not in line and "nan" not in line


def test_the_status_line_keeps_the_latest_evaluated_accuracy_and_counts_stale_steps():
    latest = {"event": "step", "step": 60, "epoch": 0, "loss": 0.5, "test_accuracy": 0.9512, "stale_steps": 3}
    assert console.trainer_status(2, latest, 100) == "trainer 2  step 60/100  epoch 0  loss 0.500  acc 0.951  3 stale steps"


def test_a_finished_trainer_reads_done_with_its_step_count_and_a_ratings_run_shows_rmse():
    latest = {"event": "done", "steps": 390, "step": 385, "epoch": 4, "loss": 0.8, "test_rmse": 0.91234}
    assert console.trainer_status(0, latest, 390) == "trainer 0  done 390/390  loss 0.800  rmse 0.912"


def test_the_compact_line_holds_every_trainer_after_the_elapsed_seconds():
    assert console.compact_line(12.4, ["trainer 0  step 1/2", "trainer 1  starting"]) == \
        "[12 s] trainer 0  step 1/2 | trainer 1  starting"


def test_only_an_end_of_epoch_evaluation_gets_a_line_of_its_own():
    assert console.epoch_line({"event": "step", "rank": 0, "step": 5, "loss": 1.0}) is None
    assert console.epoch_line({"event": "eval", "rank": 0, "step": 5, "epoch": 0, "end_of_epoch": False,
                               "test_accuracy": 0.5}) is None
    assert console.epoch_line({"event": "eval", "rank": 1, "step": 62, "epoch": 0, "end_of_epoch": True,
                               "test_accuracy": 0.93125}) == "trainer 1: epoch 0 done at step 62: test accuracy 0.9313"


def test_a_compact_line_is_due_at_once_then_not_again_within_the_interval_nor_when_nothing_changed():
    periodic = console.Periodic(5.0, now=100.0)
    assert periodic.due(100.0, "a")
    assert not periodic.due(104.9, "b")  # changed, but too soon
    assert periodic.due(105.0, "b")
    assert not periodic.due(200.0, "b")  # long after, but nothing new to say


def test_the_live_block_redraws_its_lines_in_place_and_writes_a_log_line_above_them():
    out = io.StringIO()
    block = console.LiveBlock(out, width=lambda: 80)
    block.update(["trainer 0  starting", "trainer 1  starting"])
    assert out.getvalue() == "trainer 0  starting\ntrainer 1  starting\n"
    out.truncate(0), out.seek(0)
    block.update(["trainer 0  step 1/9", "trainer 1  starting"])
    assert out.getvalue() == "\x1b[2F\x1b[J" "trainer 0  step 1/9\ntrainer 1  starting\n"  # up 2 lines, clear, redraw
    out.truncate(0), out.seek(0)
    block.update(["trainer 0  step 1/9", "trainer 1  starting"])
    assert out.getvalue() == ""  # nothing changed: nothing written
    block.above("a warning")
    assert out.getvalue() == "\x1b[2F\x1b[J" "a warning\ntrainer 0  step 1/9\ntrainer 1  starting\n"


def test_the_live_block_cuts_lines_to_the_terminal_width_so_none_wraps():
    out = io.StringIO()
    console.LiveBlock(out, width=lambda: 20).update(["x" * 50])
    assert out.getvalue() == "x" * 19 + "\n"


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def write(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def test_off_a_terminal_ps_cluster_logs_a_compact_line_every_few_seconds_not_a_line_per_step(tmp_path, caplog):
    paths = [tmp_path / "trainer0.jsonl", tmp_path / "trainer1.jsonl"]
    progress, clock = cluster.Progress(paths), FakeClock()
    for p in paths:
        write(p, {"event": "start", "rank": int(p.stem[-1]), "total_steps": 40})
    caplog.set_level(logging.INFO, logger="ps-cluster")
    with cluster.Console(progress, tty=False, clock=clock, every=5.0) as view:
        for step in range(1, 41):  # 40 steps of both trainers over 10 fake seconds
            clock.now = step * 0.25
            for rank, p in enumerate(paths):
                write(p, {"event": "step", "rank": rank, "step": step, "epoch": 0, "loss": 1.0 / step})
            for rec in progress.poll():
                view.record(rec)
            view.refresh()
        write(paths[1], {"event": "eval", "rank": 1, "step": 40, "epoch": 0, "end_of_epoch": True,
                         "test_accuracy": 0.9})
        for rec in progress.poll():
            view.record(rec)
    lines = [r.getMessage() for r in caplog.records]  # steps 1 and 21 (5 s later); step 40 came 4.75 s after that
    assert lines == ["[0 s] trainer 0  step 1/40  epoch 0  loss 1.000 | trainer 1  step 1/40  epoch 0  loss 1.000",
                     "[5 s] trainer 0  step 21/40  epoch 0  loss 0.048 | trainer 1  step 21/40  epoch 0  loss 0.048",
                     "trainer 1: epoch 0 done at step 40: test accuracy 0.9000"]


def test_on_a_terminal_log_records_are_written_above_the_block_and_the_handlers_are_restored(tmp_path):
    out = io.StringIO()
    root = logging.getLogger()
    mine = logging.StreamHandler(out)
    root.addHandler(mine)
    try:
        progress = cluster.Progress([tmp_path / "trainer0.jsonl"])
        view = cluster.Console(progress, tty=True, stream=out)
        view.block.width = lambda: 80
        with view:
            assert mine not in root.handlers
            view.refresh()
            logging.getLogger("ps-cluster").warning("shard 1 is slow")
        assert mine in root.handlers
    finally:
        root.removeHandler(mine)
    assert out.getvalue() == "trainer 0  starting\n" "\x1b[1F\x1b[J" "shard 1 is slow\ntrainer 0  starting\n"


def test_the_status_line_keeps_the_latest_loss_and_shows_accuracy_only_once_evaluated(tmp_path):
    path = tmp_path / "trainer0.jsonl"
    records = [{"event": "start", "rank": 0, "total_steps": 10},
               {"event": "step", "rank": 0, "step": 5, "epoch": 0, "loss": 0.953},
               {"event": "eval", "rank": 0, "step": 5, "epoch": 0, "test_accuracy": 0.659, "test_loss": 1.2},
               {"event": "step", "rank": 0, "step": 10, "epoch": 0, "loss": 0.5}]
    progress, shown = cluster.Progress([path]), []
    for record in records:  # as the trainer writes them, one at a time
        write(path, record)
        progress.poll()
        shown += console.status_lines(progress.latest, progress.total_steps)
    assert shown == ["trainer 0  starting",
                     "trainer 0  step 5/10  epoch 0  loss 0.953",  # no accuracy before the first evaluation
                     "trainer 0  step 5/10  epoch 0  loss 0.953  acc 0.659",  # an evaluation keeps the latest loss
                     "trainer 0  step 10/10  epoch 0  loss 0.500  acc 0.659"]
