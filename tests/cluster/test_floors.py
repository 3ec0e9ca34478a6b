"""The transport floors (trainer.tools.floors) over real server and driver processes on loopback: every setup measured,
the bytes split exactly, and no process left behind when a driver fails."""

import pytest

from trainer.tools import floors

SIZES = {"odd": 3 * floors.CHUNK + 1, "tiny": 7}  # a partial last message; fewer bytes than connections



def test_every_setup_is_measured_for_every_byte_count_and_every_process_exits(tmp_path, children):
    rows = floors.measure(SIZES, [1, 2], [2], 1, tmp_path)
    assert [(r["model"], r["connections"], r["transport"], r["processes"]) for r in rows] == [
        (model, m, t, p) for m, t, p in floors.setups([1, 2], [2]) for model in SIZES]
    for r in rows:
        assert r["bytes"] == SIZES[r["model"]] and r["step_seconds"] > 0 and r["gb_per_sec"] > 0
    assert len(children) == 2 + 6 and all(c.popen.poll() is not None for c in children)  # 2 servers, 6 drivers


def test_a_failing_driver_is_reported_with_its_log_and_every_process_exits(tmp_path, children):
    with pytest.raises(RuntimeError, match=r"a floor process \(drive tcp \d+\) exited: .*struct.error"):
        floors.measure({"negative": -1}, [1], [], 1, tmp_path)
    assert children and all(c.popen.poll() is not None for c in children)
