"""psserver.common.tboard: the TensorBoard writer both sides use (files on disk, no network)."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from psserver.common.tboard import Sampler, ScalarLog


def events(directory) -> dict:
    """tag -> [(step, value), ...] as TensorBoard reads them back."""
    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalar_log_without_a_directory_writes_nothing_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # SummaryWriter's own default would be ./runs/...
    log = ScalarLog("")
    log.add(1, loss=0.5)
    log.close()
    assert not log.enabled and list(tmp_path.iterdir()) == []


def test_scalar_log_writes_mapping_and_keyword_tags_and_skips_none(tmp_path):
    log = ScalarLog(tmp_path)
    log.add(3, {"pushes/applied": 2}, loss=0.5, accuracy=None)
    log.add(4, loss=0.25)
    log.close()
    assert events(tmp_path) == {"pushes/applied": [(3, 2.0)], "loss": [(3, 0.5), (4, 0.25)]}


def test_sampler_stop_writes_the_last_sample_and_skips_a_repeat(tmp_path):
    samples = iter([(1, {"version": 5.0}), (2, {"version": 5.0})])
    sampler = Sampler(ScalarLog(tmp_path), lambda: next(samples), every=3600)  # the timer never fires here
    sampler._write()
    sampler.stop()  # the same values again: not written twice
    assert events(tmp_path) == {"version": [(1, 5.0)]}
