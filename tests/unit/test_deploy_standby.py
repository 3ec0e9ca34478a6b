"""deploy/k8s-standby/: the Kubernetes manifests of a job whose shards each run as a primary and a hot standby
(docs/standby.md) validate, and their parts agree: every replica names the etcd its Service serves, both replica
sets run the same container, every replica pod has a Service of its own, and the trainer names each shard's two."""

from __future__ import annotations

import yaml

from psserver.codegen import REPO_ROOT
from tests.unit.test_deploy_manifests import _starts_beyond_loopback, flag_variables

MANIFEST = REPO_ROOT / "deploy" / "k8s-standby" / "standby.yaml"


def documents() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def env_of(doc: dict) -> dict:
    return {e["name"]: e for e in doc["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_the_standby_manifests_validate_against_the_schema():
    import pytest

    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in documents():
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_each_shard_is_two_replicas_with_a_service_each_and_the_trainer_names_both():
    docs = documents()
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    [job] = [d for d in docs if d["kind"] == "Job"]
    a, b = sets["ps-shard-a"], sets["ps-shard-b"]
    shards = a["spec"]["replicas"]
    assert b["spec"]["replicas"] == shards
    assert a["spec"]["template"]["spec"] == b["spec"]["template"]["spec"]  # either may be primary
    env = env_of(a)
    assert env["PS_SERVER_REPLICA"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "pod-index" in env["PS_SERVER_SHARD"]["valueFrom"]["fieldRef"]["fieldPath"]
    etcd_host, _, etcd_port = env["PS_SERVER_ETCD"]["value"].partition(":")
    assert int(etcd_port) in {p["port"] for p in services[etcd_host]["spec"]["ports"]}
    assert "--election-timeout" in sets[etcd_host]["spec"]["template"]["spec"]["containers"][0]["command"]
    container = a["spec"]["template"]["spec"]["containers"][0]
    assert "livenessProbe" not in container  # a standby has no health port: it must not be restarted for it
    assert container["readinessProbe"]["grpc"]["port"] == int(env["PS_SERVER_HEALTH_PORT"]["value"])
    port = int(env["PS_SERVER_PORT"]["value"])
    for i in range(shards):
        for replica in "ab":
            svc = services[f"ps-shard-{replica}-{i}"]["spec"]
            assert svc["selector"] == {"statefulset.kubernetes.io/pod-name": f"ps-shard-{replica}-{i}"}
            assert svc["ports"][0]["port"] == port
    assert env_of(job)["PS_TRAINER_PS"]["value"].split(",") == [
        f"ps-shard-a-{i}:{port}|ps-shard-b-{i}:{port}" for i in range(shards)]


def test_every_variable_the_standby_manifests_set_names_a_flag_and_the_replicas_start_beyond_loopback():
    docs = documents()
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Job") and doc["metadata"]["name"] != "etcd":
            prog = "ps-trainer" if doc["kind"] == "Job" else "ps-server"
            env = env_of(doc)
            unknown = {n for n in env if n.startswith("PS_")} - flag_variables(prog)
            assert not unknown, f"{doc['metadata']['name']} sets {sorted(unknown)}, which {prog} does not read"
            if prog == "ps-server":
                assert _starts_beyond_loopback({k: e.get("value") for k, e in env.items()})


def test_the_standby_compose_file_runs_two_replicas_a_shard_against_its_etcd_and_the_trainers_name_both():
    """deploy/docker-compose.standby.yml (resolved by docker-compose): etcd, shards 0 and 1 as replicas a and b
    naming that etcd and one job, the same settings on both replicas of a shard, and each trainer naming each
    shard's replicas as PRIMARY|STANDBY; every variable names a flag of the CLI it runs."""
    import pytest

    from tests.deploy_config import compose_cli, resolved_compose

    if compose_cli() is None:
        pytest.skip("docker-compose is not installed (CI installs Debian's package; see .ci/run)")
    services = resolved_compose(path=REPO_ROOT / "deploy" / "docker-compose.standby.yml")["services"]
    replicas = sorted(s for s in services if s.startswith("ps-shard-"))
    assert replicas == ["ps-shard-0a", "ps-shard-0b", "ps-shard-1a", "ps-shard-1b"] and "etcd" in services
    assert services["etcd"]["command"][0] == "etcd"
    for name in replicas:
        env = services[name]["environment"]
        assert env["PS_SERVER_ETCD"] == "etcd:2379" and env["PS_SERVER_JOB_NAME"] == "demo"
        assert env["PS_SERVER_SHARD"] == name[-2] and env["PS_SERVER_REPLICA"] == name[-1]
        assert env["PS_ADMIN_TOKEN"] and services[name]["restart"] == "on-failure"
        assert set(env) - {"PS_ADMIN_TOKEN"} <= flag_variables("ps-server")
        twin = services[name[:-1] + ("b" if name.endswith("a") else "a")]["environment"]
        assert {k: v for k, v in env.items() if k != "PS_SERVER_REPLICA"} == \
            {k: v for k, v in twin.items() if k != "PS_SERVER_REPLICA"}
    trainers = sorted(s for s in services if s.startswith("ps-trainer"))
    assert trainers == ["ps-trainer-0", "ps-trainer-1"]
    for name in trainers:
        env = services[name]["environment"]
        assert env["PS_TRAINER_PS"] == "ps-shard-0a:7000|ps-shard-0b:7000,ps-shard-1a:7000|ps-shard-1b:7000"
        assert set(env) <= flag_variables("ps-trainer")
