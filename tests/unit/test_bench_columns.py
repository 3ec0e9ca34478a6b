"""ps-bench's own arithmetic and tables: overlap efficiency, extra rows, floor layouts, the Markdown (no network)."""

import pytest

from trainer.tools import bench
from trainer.tools.floors import setups, split


def test_overlap_efficiency_is_2_when_exchange_and_compute_run_one_after_the_other():
    assert bench.overlap_efficiency(20.0, compute=10.0, push=4.0, pull=4.0, wait=2.0) == pytest.approx(2.0)


def test_overlap_efficiency_is_1_when_the_exchange_hides_behind_compute():
    assert bench.overlap_efficiency(10.0, compute=10.0, push=3.0, pull=3.0, wait=0.0) == pytest.approx(1.0)


def test_overlap_efficiency_of_compute_alone_is_step_over_compute():
    assert bench.overlap_efficiency(12.0, compute=10.0, push=0.0, pull=0.0, wait=0.0) == pytest.approx(1.2)


def test_an_extra_row_is_a_mode_and_its_flags():
    assert bench.parse_extra_row("sync:--wire-dtype bfloat16") == ("sync", ["--wire-dtype", "bfloat16"])
    assert bench.parse_extra_row("async+overlap:") == ("async+overlap", [])


@pytest.mark.parametrize("spec", ["--wire-dtype bfloat16", "fast:--wire-dtype bfloat16", "sync+turbo:"])
def test_an_extra_row_without_a_known_mode_is_refused_naming_it(spec):
    with pytest.raises(ValueError, match=rf"--extra-row \({spec.replace('+', '[+]')}\) must be MODE:FLAGS"):
        bench.parse_extra_row(spec)


def test_an_extra_row_with_a_flag_ps_trainer_lacks_is_skipped_with_the_reason():
    assert bench.extra_row_skip_reason("sync:--no-such-flag 1", ["--no-such-flag", "1"]) == \
        "ps-trainer has no --no-such-flag flag yet"
    assert bench.extra_row_skip_reason("sync:--no-such-flag=1", ["--no-such-flag=1"]) == \
        "ps-trainer has no --no-such-flag flag yet"


def test_an_extra_row_with_flags_ps_trainer_has_runs():
    assert bench.extra_row_skip_reason("sync:--wire-dtype bfloat16", ["--wire-dtype", "bfloat16"]) == ""


def test_every_default_extra_row_passes_ps_trainers_checks_under_its_own_mode():
    """An async-only flag (--push-window 4) must be checked as the async row runs it, not as a sync job."""
    for spec in bench.DEFAULT_EXTRA_ROWS:
        mode, flags = bench.parse_extra_row(spec)
        assert bench.extra_row_skip_reason(spec, flags, mode) == "", spec


def test_an_extra_row_with_a_bad_value_is_an_error_not_a_skip():
    with pytest.raises(ValueError, match=r"--extra-row \(sync:--wire-dtype int3\): ps-trainer says: .*int3"):
        bench.extra_row_skip_reason("sync:--wire-dtype int3", ["--wire-dtype", "int3"])


def test_bytes_split_over_connections_add_up_with_the_remainder_first():
    assert split(10, 3) == [4, 3, 3] and split(5, 1) == [5] and sum(split(44_700_001, 4)) == 44_700_001


def test_floor_setups_drive_grpc_from_every_process_count_that_divides_m():
    assert setups([1, 2, 4], [2, 4, 3]) == [
        (1, "tcp", 1), (1, "grpc", 1), (2, "tcp", 1), (2, "grpc", 1), (2, "grpc", 2),
        (4, "tcp", 1), (4, "grpc", 1), (4, "grpc", 2), (4, "grpc", 4)]


@pytest.mark.parametrize("text", ["", "1,,2", "0", "1,-2", "two"])
def test_a_bad_count_list_is_refused_naming_the_flag_and_value(text):
    with pytest.raises(ValueError, match=rf"--floor-connections \({text}\) must be positive integers"):
        bench.int_list("--floor-connections", text)


def floor(model, nbytes, m, transport, p, ms):
    return dict(model=model, bytes=nbytes, connections=m, transport=transport, processes=p, step_seconds=ms / 1000,
                gb_per_sec=2 * nbytes / (ms / 1000) / 1e9)


FLOORS = [floor("resnet18", 44_700_000, 1, "tcp", 1, 23.0), floor("resnet18", 44_700_000, 1, "grpc", 1, 52.0),
          floor("resnet18", 44_700_000, 2, "tcp", 1, 12.0), floor("resnet18", 44_700_000, 2, "grpc", 1, 45.0),
          floor("resnet18", 44_700_000, 2, "grpc", 2, 30.0)]
COMM = [dict(model="resnet18", optimizer="sgd", wire_dtype="float32", step_seconds=0.0575, params=11_175_370,
             apply_seconds=0.01, tcp_floor_seconds=0.02, ratio_to_tcp_floor=2.9, shard_peak_extra_bytes=1e8,
             shard_memory_ratio=1.2, shard_memory_ratio_marginal=1.0)]


def test_the_resnet18_step_is_compared_with_both_one_connection_floors():
    c = bench.comm_against_floors(COMM, FLOORS)
    assert c["ratio_to_tcp_floor"] == pytest.approx(57.5 / 23.0) and c["ratio_to_grpc_floor"] == pytest.approx(57.5 / 52)


def test_without_resnet18_or_its_floors_there_is_no_comparison():
    assert bench.comm_against_floors(COMM, FLOORS[2:]) is None
    assert bench.comm_against_floors([dict(COMM[0], model="cnn")], FLOORS) is None


def test_the_floors_table_has_a_column_per_transport_and_a_dash_where_p_does_not_divide_m():
    lines = bench.floors_markdown(FLOORS)
    assert "| model | MB each way | M | raw TCP, 1 process | raw gRPC, 1 process | raw gRPC, 2 processes |" in lines
    assert "| resnet18 | 44.7 | 1 | 23.0 (3.89) | 52.0 (1.72) | - |" in lines
    assert "| resnet18 | 44.7 | 2 | 12.0 (7.45) | 45.0 (1.99) | 30.0 (2.98) |" in lines


def test_the_markdown_shows_device_overlap_efficiency_variant_and_skipped_rows():
    row = dict(workload="cnn-mnist5k", backend="ps", mode="sync", variant="--wire-dtype bfloat16", device="cuda:0,cuda:1",
               samples_per_sec=1000.0, ratio_to_ddp=0.9, step_ms=20.0, compute_ms=10.0, push_ms=4.0, pull_ms=4.0,
               wait_ms=2.0, overlap_efficiency=2.0, wire_bytes_per_sec=5e8)
    results = dict(machine=dict(cpus=2, python="3.11", torch="2"), trainers=2, shards=2, quick=True, comm=COMM,
                   floors=FLOORS, resnet18_comm=bench.comm_against_floors(COMM, FLOORS), throughput=[row],
                   skipped_rows=[dict(workload="cnn-mnist5k", extra_row="sync:--compress topk:0.01",
                                      reason="ps-trainer has no --compress flag yet")])
    md = bench.to_markdown(results)
    assert "| cnn-mnist5k | psgrpc sync --wire-dtype bfloat16 | cuda:0,cuda:1 | 1000 | 0.90 | 20.0 | 10.0 | 4.0 | " \
           "4.0 | 2.0 | 2.00 | 500 |" in md
    assert "57.5 ms = 2.50x the raw TCP floor (23.0 ms) and 1.11x the raw gRPC floor (52.0 ms)" in md
    assert "Skipped on cnn-mnist5k: `--extra-row sync:--compress topk:0.01` (ps-trainer has no --compress flag yet)" in md


def test_a_bad_extra_row_fails_the_bench_before_anything_runs(tmp_path, monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a measurement started")

    monkeypatch.setattr(bench, "comm_section", started)
    monkeypatch.setattr(bench.tempfile, "mkdtemp", started)
    with pytest.raises(ValueError, match=r"--extra-row \(sync:--wire-dtype int3\)"):
        bench.run_bench(tmp_path, bench.BenchOptions(extra_rows=("sync:--wire-dtype bfloat16", "sync:--wire-dtype int3")))


def test_ddp_nccl_is_left_out_naming_the_duplicate_gpu_when_trainers_outnumber_the_gpus():
    assert bench.nccl_problem(trainers=2, gpus=2) == ""
    reason = bench.nccl_problem(trainers=2, gpus=1)
    assert "2 trainers, 1 GPU visible" in reason and "Duplicate GPU detected" in reason


def test_a_failed_nccl_run_is_reported_by_its_error_line_not_torchs_shutdown_warning():
    log = ("[rank0]:[W1124 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was not called\n"
           "ps-trainer: error: NCCL error in: NCCLUtils.cpp:93, invalid usage\n"
           "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60\n")
    assert bench.nccl_reason(log).startswith("ps-trainer: error: NCCL error")


def test_a_skipped_baseline_is_named_in_the_markdown():
    results = dict(machine=dict(cpus=16, python="3.12", torch="2", gpu="NVIDIA H100"), trainers=2, shards=2,
                   quick=False, comm=[], throughput=[],
                   skipped_rows=[dict(workload="resnet18-synthetic", baseline="DDP NCCL", reason="two ranks, one GPU")])
    md = bench.to_markdown(results)
    assert "ps-bench on 16 CPUs, NVIDIA H100," in md
    assert "Skipped on resnet18-synthetic: DDP NCCL (two ranks, one GPU)." in md
    assert "**One PS step" not in md and "**Training throughput**" not in md  # sections not run print nothing


@pytest.mark.parametrize("flag,text", [("--sections", "comm,bogus"), ("--workloads", ""), ("--workloads", "vgg")])
def test_an_unknown_section_or_workload_is_refused_naming_the_flag_and_the_choices(flag, text):
    with pytest.raises(ValueError, match=rf"{flag} \({text}\) must be names separated by commas, of "):
        bench.main([flag, text])


def test_the_rows_section_prints_pull_and_push_milliseconds_with_their_cpu_time():
    md = "\n".join(bench.rows_markdown([{"mode": "sync", "optimizer": "adagrad", "rows": 2048, "pull_ms": 1.5,
                                          "pull_cpu_ms": 1.25, "push_ms": 0.75, "push_cpu_ms": 0.5,
                                          "new_rows_per_pull": 1221.0}]))
    assert "| sync | adagrad | 2,048 | 1,221 | 1.50 (1.25) | 0.75 (0.50) |" in md


def test_the_sparse_grid_prints_each_row_beside_its_own_one_process_run_its_floor_and_its_load():
    row = {"workload": "click", "batch": 512, "system": "psgrpc sync", "shards": 2, "trainers": 1, "steps": 200,
           "steps_per_s": 62.5, "ids_per_s": 143_750.0, "ratio": 0.125, "one_process": {"steps_per_s": 500.0},
           "floor": {"steps_per_s": 250.0, "ratio": 0.5, "transport_ms": 2.0}, "row_bytes_per_step": 174_776.0,
           "unique_bytes_per_step": 170_249.0, "prefetch_hit_rate": 1.0, "cache_hit_rate": None,
           "load_1m": [0.5, 1.25]}
    two = dict(row, trainers=2, floor=None, cache_hit_rate=0.197, prefetch_hit_rate=None)
    md = "\n".join(bench.sparse_grid_markdown([row, two]))
    assert ("| click | 512 | psgrpc sync | 2 x 1 | 200 | 62.5 | 500.0 | 0.12 | 250.0 | 0.50 | 2.00 | 174,776 | "
            "170,249 | 100% | - | 0.5-1.2 |") in md
    assert ("| click | 512 | psgrpc sync | 2 x 2 | 200 | 62.5 | 500.0 | 0.12 | - | - | - | 174,776 | 170,249 | - | "
            "20% |") in md


def test_a_failed_grid_row_is_printed_with_its_reason_in_a_row_of_its_own():
    from trainer.tools.gridplan import cell_rows
    from trainer.tools.sparsegrid import failed_row
    row = cell_rows("criteo", 2048, 2, 1, 30)[2]
    failed = failed_row(row, RuntimeError("RESOURCE_EXHAUSTED: rank 0 | 8 calls\nsecond line"))
    assert failed["error"] == "RuntimeError: RESOURCE_EXHAUSTED: rank 0 | 8 calls" and failed["push_window"] == 4
    md = bench.sparse_grid_markdown([failed])
    assert md[-1] == ("| criteo | 2,048 | psgrpc sync dense, async tables, push window 4 | 2 x 1 | failed: RuntimeError: "
                      "RESOURCE_EXHAUSTED: rank 0 / 8 calls |" + " - |" * 11)
    assert md[-1].count("|") == md[-2].count("|")  # as many columns as the header


def test_grid_cells_reach_the_bench_options_and_a_bad_one_is_refused(monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "run_bench", lambda out, opts: seen.setdefault("opts", opts) and {})
    monkeypatch.setattr(bench, "to_markdown", lambda r: "")
    bench.main(["--sections", "sparse-grid", "--grid-cells", "targets"])
    assert seen["opts"].grid_cells == (("click", 512, 2, 1), ("click", 8192, 2, 1), ("criteo", 2048, 2, 1))
    with pytest.raises(ValueError, match=r"--grid-cells \(click:512\)"):
        bench.main(["--grid-cells", "click:512"])


def test_sections_rows_and_sparse_grid_are_known_to_ps_bench():
    assert bench.names_from("--sections", "rows,sparse-grid", bench.SECTIONS) == ("rows", "sparse-grid")
