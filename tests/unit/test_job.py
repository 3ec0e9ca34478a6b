"""The job spec: validation, wire round trip, and naming the difference."""

import dataclasses
import math

import pytest
import torch

from psserver.protocol import limits
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.optim import build_optimizer

BASE = JobSpec(mode="sync", num_trainers=2, num_shards=2, total_params=30, fingerprint="abc",
               optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9),
               tensors=(("w", (5, 5), "float32"), ("b", (5,), "float32")))


def test_proto_round_trip_is_lossless():
    for spec in (BASE, dataclasses.replace(BASE, mode="async", max_staleness=3, job_id="run-7"),
                 dataclasses.replace(BASE, mode="stale-timeout", sync_timeout=0.25, replicas_to_aggregate=1,
                                     stale_policy="scale", wire_dtype="bfloat16")):
        assert JobSpec.from_proto(spec.to_proto()) == spec


def test_difference_names_the_field_and_both_values():
    assert BASE.difference(BASE) is None
    other = dataclasses.replace(BASE, optimizer=OptimizerConfig("sgd", lr=0.2, momentum=0.9))
    assert BASE.difference(other) == "optimizer.lr is 0.2 but the job has 0.1"
    assert BASE.difference(dataclasses.replace(BASE, mode="async")) == "mode is 'async' but the job has 'sync'"
    model = dataclasses.replace(BASE, tensors=(("w", (5, 4), "float32"), ("b", (10,), "float32")), fingerprint="x")
    assert BASE.difference(model) == "parameter #0 is 'w' [5, 4] float32 but the job has 'w' [5, 5] float32"


@pytest.mark.parametrize("change,message", [
    (dict(mode="bsp"), "mode ('bsp')"),
    (dict(num_trainers=0), "trainers (0)"),
    (dict(mode="stale-timeout", sync_timeout=0.0), "sync timeout > 0 seconds (got 0.0)"),
    (dict(replicas_to_aggregate=3), "replicas to aggregate (3)"),
    (dict(stale_policy="keep"), "stale policy ('keep')"),
    (dict(max_staleness=-2), "maximum staleness (-2)"),
    (dict(wire_dtype="int8"), "wire dtype ('int8')"),
])
def test_invalid_settings_quote_the_bad_value(change, message):
    with pytest.raises(ValueError) as e:
        dataclasses.replace(BASE, **change)
    assert message in str(e.value)


def test_a_different_job_id_is_reported_before_any_other_field():
    job = dataclasses.replace(BASE, job_id="a")
    other = dataclasses.replace(BASE, job_id="b", mode="async", num_trainers=3, fingerprint="zzz")
    assert job.difference(other) == "job_id is 'b' but the job has 'a'"
    assert job.difference(dataclasses.replace(job, mode="async")) == "mode is 'async' but the job has 'sync'"


def test_job_id_defaults_to_empty_and_crosses_the_wire():
    assert BASE.job_id == ""
    assert BASE.to_proto().job_id == ""
    assert JobSpec.from_proto(dataclasses.replace(BASE, job_id="run-7").to_proto()).job_id == "run-7"


def test_difference_shows_valid_ids_whole_and_escapes_non_ascii():
    longest = dataclasses.replace(BASE, job_id="x" * 128)
    assert BASE.difference(longest) == f"job_id is '{'x' * 128}' but the job has ''"
    unicode = dataclasses.replace(BASE, job_id="r\u00e9")
    assert BASE.difference(unicode) == "job_id is 'r\\xe9' but the job has ''"


@pytest.mark.parametrize("change,message", [
    (dict(momentum=-1.0), "The momentum (-1.0) must be zero or more."),
    (dict(momentum=math.nan), "The momentum (nan) must be a finite number."),
    (dict(momentum=math.inf), "The momentum (inf) must be a finite number."),
    (dict(weight_decay=-1.0), "The weight_decay (-1.0) must be zero or more."),
    (dict(weight_decay=math.inf), "The weight_decay (inf) must be a finite number."),
    (dict(dampening=-0.1), "The dampening (-0.1) must be between 0 and 1."),
    (dict(dampening=1.5), "The dampening (1.5) must be between 0 and 1."),
    (dict(dampening=math.nan), "The dampening (nan) must be a finite number."),
    (dict(beta1=2.0), "The beta1 (2.0) must be at least 0 and less than 1."),
    (dict(beta1=1.0), "The beta1 (1.0) must be at least 0 and less than 1."),
    (dict(beta1=-0.1), "The beta1 (-0.1) must be at least 0 and less than 1."),
    (dict(beta2=1.0), "The beta2 (1.0) must be at least 0 and less than 1."),
    (dict(beta2=math.nan), "The beta2 (nan) must be a finite number."),
    (dict(eps=-1.0), "The eps (-1.0) must be zero or more."),
    (dict(eps=math.inf), "The eps (inf) must be a finite number."),
    (dict(lr=math.inf), "The learning rate (inf) must be a finite number."),
    (dict(lr=math.nan), "The learning rate (nan) must be a finite number."),
    (dict(lr=-0.5), "The learning rate (-0.5) must be greater than zero."),
    (dict(lr="0.1"), "The learning rate ('0.1') must be a number."),
    (dict(momentum=0.0, nesterov=True), "Nesterov momentum needs momentum > 0"),
])
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_invalid_optimizer_settings_are_refused_naming_the_field_and_value(name, change, message):
    with pytest.raises(ValueError) as e:
        OptimizerConfig(name, **change)
    assert message in str(e.value)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("edge", [
    dict(momentum=0.0), dict(weight_decay=0.0), dict(dampening=0.0), dict(dampening=1.0), dict(beta1=0.0),
    dict(beta2=0.0), dict(eps=0.0), dict(beta1=0.999999, beta2=0.999999), dict(lr=1e-12), dict(momentum=0),
])
def test_edge_values_torch_optim_accepts_pass_and_build(name, edge):
    cfg = OptimizerConfig(name, **edge)
    param = torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer(cfg, [param])  # the shard's own construction: it must not raise either
    param.grad = torch.ones(4)
    opt.step()


@pytest.mark.parametrize("name,bad", [
    ("sgd", dict(momentum=-1.0)), ("sgd", dict(weight_decay=-1.0)),
    ("adam", dict(beta1=2.0)), ("adam", dict(beta2=1.5)), ("adam", dict(eps=-1.0)), ("adam", dict(weight_decay=-1.0)),
    ("adamw", dict(beta1=-0.5)), ("adamw", dict(eps=-1.0)),
])
def test_every_value_torch_optim_refuses_is_refused_at_construction(name, bad):
    """The measured crashes: these reached torch.optim at Init and left the shard broken."""
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    kwargs = dict(bad)
    if "beta1" in kwargs or "beta2" in kwargs:
        kwargs = {"betas": (kwargs.pop("beta1", 0.9), kwargs.pop("beta2", 0.999)), **kwargs}
    with pytest.raises(ValueError):
        cls([torch.nn.Parameter(torch.ones(2))], lr=0.1, **kwargs)  # torch refuses it ...
    with pytest.raises(ValueError):
        OptimizerConfig(name, **bad)  # ... and so does the spec, before any shard state exists


def test_optimizer_refusal_reaches_register_as_a_job_spec_error():
    msg = BASE.to_proto()
    msg.optimizer.momentum = -1.0
    with pytest.raises(ValueError, match=r"The momentum \(-1\.0\) must be zero or more\."):
        JobSpec.from_proto(msg)


@pytest.mark.parametrize("change,message", [
    (dict(num_trainers=30_000_000), "The number of trainers (30000000) must be between 1 and 4096."),
    (dict(num_trainers=limits.MAX_TRAINERS + 1), "trainers (4097)"),
    (dict(num_shards=0), "The number of shards (0) must be between 1 and 1024."),
    (dict(num_shards=limits.MAX_SHARDS + 1), "shards (1025)"),
    (dict(total_params=limits.MAX_TOTAL_PARAMS + 1, tensors=()), f"parameters ({(1 << 36) + 1})"),
    (dict(total_params=-1, tensors=()), "parameters (-1)"),
    (dict(mode="async", max_staleness=(1 << 31) + 1), f"The maximum staleness ({(1 << 31) + 1}) must be between"),
    (dict(sync_timeout=1e10), "The sync timeout (10000000000.0 s) must be between 0 and 86400.0 seconds."),
    (dict(sync_timeout=-1.0), "The sync timeout (-1.0 s)"),
    (dict(mode="stale-timeout", sync_timeout=math.inf), "The sync timeout (inf) must be a finite number."),
    (dict(mode="stale-timeout", sync_timeout=math.nan), "The sync timeout (nan) must be a finite number."),
    (dict(fingerprint="f" * 129), "fingerprint is 129 characters long, over the limit of 128."),
    (dict(job_id="j" * 4_000_000), "job_id is 4000000 characters long, over the limit of 128."),
    (dict(job_id="run\nforged"), "job_id contains a control character at position 3: 'run\\nforged'"),
    (dict(job_id="run\u202e"), "job_id contains a non-printable character at position 3: 'run\\u202e'"),
    (dict(fingerprint="ab\x1b[2J"), "fingerprint contains a control character at position 2: 'ab\\x1b[2J'"),
    (dict(mode="x" * 20_000), "The mode ('xxxx"),
    (dict(tensors=(("w", (5, 5), "float32"), ("b", (4,), "float32"))),
     "The tensors hold 29 elements but total_params is 30."),
    (dict(tensors=(("w", (5, 5), "float32"), ("b", (6,), "float32"))),
     "The tensors hold 31 elements but total_params is 30."),
    (dict(tensors=(("w", (-5, -6), "float32"),)), "Tensor #0 ('w') has a negative dimension in its shape [-5, -6]."),
    (dict(tensors=(("w", (1,) * 9 + (30,), "float32"),)), "Tensor #0 ('w') has 10 dimensions, over the limit of 8."),
    (dict(tensors=(("w" * 257, (30,), "float32"),)), "tensor #0 name is 257 characters long, over the limit of 256."),
    (dict(tensors=(("w\r", (30,), "float32"),)), "tensor #0 name contains a control character at position 1"),
    (dict(tensors=(("w", (30,), "float32\n"),)), "tensor #0 dtype contains a control character at position 7"),
    (dict(tensors=(("w", (1,), "float32"),) * (limits.MAX_TENSORS + 1), total_params=limits.MAX_TENSORS + 1),
     "The job lists 65537 tensors, over the limit of 65536."),
])
def test_oversized_or_inconsistent_specs_are_refused_quoting_the_value(change, message):
    with pytest.raises(ValueError) as e:
        dataclasses.replace(BASE, **change)
    assert message in str(e.value)
    assert len(str(e.value)) < 300  # the bad value is shown cut, never whole


def test_a_refused_string_is_shown_cut_and_escaped():
    with pytest.raises(ValueError) as e:
        dataclasses.replace(BASE, mode="\n" * 20_000)
    assert "\n" not in str(e.value) and "…(+" in str(e.value)


def test_from_proto_refuses_too_many_tensors_before_copying_them():
    msg = BASE.to_proto()
    del msg.tensors[:]
    for _ in range(limits.MAX_TENSORS + 1):
        msg.tensors.add(name="w", shape=[1], dtype="float32")
    with pytest.raises(ValueError, match="65537 tensors, over the limit of 65536"):
        JobSpec.from_proto(msg)


@pytest.mark.parametrize("change", [
    dict(num_trainers=limits.MAX_TRAINERS, replicas_to_aggregate=limits.MAX_TRAINERS),
    dict(num_shards=limits.MAX_SHARDS),
    dict(mode="async", max_staleness=limits.MAX_STALENESS),
    dict(mode="async", max_staleness=0),
    dict(mode="stale-timeout", sync_timeout=limits.MAX_SYNC_TIMEOUT),
    dict(sync_timeout=0.0),
    dict(total_params=0, tensors=()),
    dict(total_params=limits.MAX_TOTAL_PARAMS, tensors=(("w", (1 << 18, 1 << 18), "float32"),)),
    dict(total_params=7, tensors=(("a", (7,), "float32"), ("empty", (0, 3), "float32"))),
    dict(total_params=1, tensors=(("scalar", (), "float32"),)),
    dict(total_params=123, tensors=()),  # no layout given: nothing to add up
    dict(tensors=(("w", (1,) * 7 + (30,), "float32"),)),
    dict(fingerprint="f" * 128, job_id="j" * 128),
    dict(job_id="run 2024-11-22 19:09 (café)"),
    dict(tensors=(("w" * 256, (30,), "float32"),)),
])
def test_values_at_the_caps_are_accepted_and_cross_the_wire(change):
    spec = dataclasses.replace(BASE, **change)
    assert JobSpec.from_proto(spec.to_proto()) == spec


# -- sparse tables in the job spec -------------------------------------------------------------
def _tabled_job(*tables, **kw):
    from psserver.protocol.job import JobSpec
    return JobSpec(mode=kw.pop("mode", "sync"), num_trainers=2, num_shards=2, total_params=0, fingerprint="f",
                   tables=tables, **kw)


def test_job_tables_survive_the_wire_and_a_changed_table_is_named():
    import dataclasses

    from psserver.protocol.job import JobSpec
    from psserver.protocol.rows.optim import SparseOptimizerConfig
    from psserver.protocol.rows.table import TableSpec
    users = TableSpec("users", 8, optimizer=SparseOptimizerConfig("adam", lr=0.01), num_embeddings=943,
                      max_rows=1000, mode="async", max_staleness=3)
    items = TableSpec("items", 8, admit_after=2, evict_after=50)
    job = _tabled_job(users, items)
    assert JobSpec.from_proto(job.to_proto()) == job
    other = dataclasses.replace(job, tables=(users, dataclasses.replace(items, dim=16)))
    assert job.difference(other) == "table 'items' dim is 16 but the job has 8"
    assert job.difference(dataclasses.replace(job, tables=(users,))) == "the model lacks table 'items' (it has 1 of 2)"


def test_job_refuses_two_tables_of_one_name_and_stale_timeout_tables_without_a_timeout():
    import pytest

    from psserver.protocol.rows.table import TableSpec
    with pytest.raises(ValueError, match="repeats the name 'users'"):
        _tabled_job(TableSpec("users", 4), TableSpec("users", 8))
    with pytest.raises(ValueError, match="needs a sync timeout"):
        _tabled_job(TableSpec("users", 4, mode="stale-timeout"))
    with pytest.raises(ValueError, match="table mode"):
        TableSpec("users", 4, mode="later")
