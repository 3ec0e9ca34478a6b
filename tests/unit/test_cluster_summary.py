"""ps-cluster's run folder (trainer.local.cluster), without processes: a reused folder's metrics are set aside."""

from trainer.local.cluster import set_aside_old_metrics


def test_a_reused_run_folders_metrics_are_set_aside_so_the_new_run_reads_only_its_own(tmp_path):
    (tmp_path / "trainer0.jsonl").write_text('{"step": 186}\n')
    (tmp_path / "trainer1.jsonl").write_text('{"step": 186}\n')
    (tmp_path / "trainer0.previous.jsonl").write_text("older\n")
    (tmp_path / "trainer0.log").write_text("log\n")
    moved = set_aside_old_metrics(tmp_path)
    assert [p.name for p in moved] == ["trainer0.previous.jsonl", "trainer1.previous.jsonl"]
    assert not (tmp_path / "trainer0.jsonl").exists() and not (tmp_path / "trainer1.jsonl").exists()
    assert (tmp_path / "trainer0.previous.jsonl").read_text() == '{"step": 186}\n'  # the last run's, not older
    assert (tmp_path / "trainer0.log").exists()


def test_a_fresh_run_folder_sets_nothing_aside(tmp_path):
    assert set_aside_old_metrics(tmp_path) == []
