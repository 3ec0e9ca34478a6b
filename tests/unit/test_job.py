"""The job spec: validation, wire round trip, and naming the difference."""

import dataclasses

import pytest

from psserver.job import JobSpec, OptimizerConfig

BASE = JobSpec(mode="sync", num_trainers=2, num_shards=2, total_params=30, fingerprint="abc",
               optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9),
               tensors=(("w", (5, 5), "float32"), ("b", (5,), "float32")))


def test_proto_round_trip_is_lossless():
    for spec in (BASE, dataclasses.replace(BASE, mode="async", max_staleness=3),
                 dataclasses.replace(BASE, mode="stale-timeout", sync_timeout=0.25, replicas_to_aggregate=1,
                                     stale_policy="scale", wire_dtype="bfloat16")):
        assert JobSpec.from_proto(spec.to_proto()) == spec


def test_difference_names_the_field_and_both_values():
    assert BASE.difference(BASE) is None
    other = dataclasses.replace(BASE, optimizer=OptimizerConfig("sgd", lr=0.2, momentum=0.9))
    assert BASE.difference(other) == "optimizer.lr is 0.2 but the job has 0.1"
    assert BASE.difference(dataclasses.replace(BASE, mode="async")) == "mode is 'async' but the job has 'sync'"
    model = dataclasses.replace(BASE, tensors=(("w", (5, 4), "float32"), ("b", (5,), "float32")), fingerprint="x")
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
