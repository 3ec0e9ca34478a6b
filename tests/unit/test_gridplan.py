"""The sparse grid's plan and arithmetic (trainer.tools.gridplan): which cells and rows run, how many steps, how a
row's ratio and its transport floor are figured (no network, no torch)."""

import pytest

from trainer.tools import gridplan


def test_targets_are_issue_21s_three_cells_on_two_shards_and_one_trainer():
    assert gridplan.parse_grid_cells("targets") == (("click", 512, 2, 1), ("click", 8192, 2, 1),
                                                    ("criteo", 2048, 2, 1))


def test_all_is_every_workload_and_batch_on_1_and_2_shards_by_1_and_2_trainers():
    cells = gridplan.parse_grid_cells("all")
    assert len(cells) == 3 * 2 * 2 and set(cells) >= set(gridplan.TARGET_CELLS)
    assert {(w, b) for w, b, _, _ in cells} == set(gridplan.TIMED_STEPS)


def test_cells_can_be_named_one_by_one():
    assert gridplan.parse_grid_cells(" click:512:2x1, criteo:2048:1x2 ") == (("click", 512, 2, 1),
                                                                           ("criteo", 2048, 1, 2))


@pytest.mark.parametrize("text", ["click:512", "click:512:2", "movielens:512:2x1", "click:0:2x1", "click:512:2x0",
                                  "click:512:twox1", "", "click:512:2x1,"])
def test_a_bad_cell_is_refused_naming_the_flag_the_value_and_the_form(text):
    with pytest.raises(ValueError, match=r"--grid-cells \(.*\).*WORKLOAD:BATCH:SHARDSxTRAINERS"):
        gridplan.parse_grid_cells(text)


def test_a_click_cell_runs_sync_async_tables_a_push_window_and_a_row_cache():
    rows = gridplan.cell_rows("click", 512, 2, 1, 200)
    assert [(r.embedding_mode, r.push_window, r.cache_rows) for r in rows] == [
        ("", 1, 0), ("async", 1, 0), ("async", gridplan.PUSH_WINDOW, 0), ("async", 1, gridplan.CACHE_ROWS)]
    assert rows[0].system == "psgrpc sync" and rows[1].system == "psgrpc sync dense, async tables"
    assert rows[3].cache_staleness == gridplan.CACHE_STALENESS
    assert all((r.workload, r.batch, r.shards, r.trainers, r.steps) == ("click", 512, 2, 1, 200) for r in rows)


def test_a_criteo_cell_has_no_row_cache_row():
    assert [r.cache_rows for r in gridplan.cell_rows("criteo", 2048, 2, 1, 30)] == [0, 0, 0]


def test_the_plan_keeps_the_cells_order_and_gives_each_its_steps_or_the_quick_count():
    plan = gridplan.plan(gridplan.TARGET_CELLS)
    assert [(rows[0].workload, rows[0].batch, rows[0].steps) for rows in plan] == [
        ("click", 512, 200), ("click", 8192, 30), ("criteo", 2048, 30)]
    assert {r.steps for rows in gridplan.plan(gridplan.TARGET_CELLS, quick=True) for r in rows} == {
        gridplan.QUICK_TIMED}


def test_a_batch_outside_the_grid_gets_200_steps_when_small_and_30_otherwise():
    assert gridplan.timed_steps("click", 256) == 200 and gridplan.timed_steps("click", 4096) == 30
    assert gridplan.timed_steps("criteo", 512) == 30


def test_the_ratio_is_the_sharded_ids_per_second_over_one_process():
    assert gridplan.ratio(50_000.0, 200_000.0) == pytest.approx(0.25)


def test_the_floor_is_one_process_compute_then_the_transport_and_its_ratio_is_against_that_one_process():
    f = gridplan.floor_figures(one_step_seconds=0.002, transport_seconds=0.003, one_steps_per_s=500.0)
    assert f["steps_per_s"] == pytest.approx(200.0) and f["ratio"] == pytest.approx(0.4)
    assert f["transport_ms"] == pytest.approx(3.0)
