"""deploy/: the compose file and Kubernetes manifests validate and agree with each other."""

import os

import pytest

from tests.deploy_config import compose_cli, k8s_documents, resolved_compose

needs_compose = pytest.mark.skipif(
    compose_cli() is None and not os.environ.get("CI"),
    reason="docker-compose is not installed (CI installs Debian's package; see .ci/run)",
)


@needs_compose
def test_compose_file_validates_and_has_2_shards_rank_0_and_a_scalable_service_of_2_joiners():
    cfg = resolved_compose()
    services = cfg["services"]
    shards = sorted(s for s in services if s.startswith("ps-shard-"))
    trainers = sorted(s for s in services if s.startswith("ps-trainer"))
    assert shards == ["ps-shard-0", "ps-shard-1"] and trainers == ["ps-trainer", "ps-trainer-0"]
    rank0, joiners = services["ps-trainer-0"], services["ps-trainer"]
    assert rank0["environment"]["PS_TRAINER_RANK"] == "0" and "PS_TRAINER_JOIN" not in rank0["environment"]
    assert joiners["environment"]["PS_TRAINER_JOIN"] == "1" and "PS_TRAINER_RANK" not in joiners["environment"]
    assert joiners.get("scale") == 2 and "container_name" not in joiners  # a fixed name could not be scaled
    for name in trainers:
        env = services[name]["environment"]
        assert env["PS_TRAINER_PS"] == "ps-shard-0:7000,ps-shard-1:7000"
        assert env["PS_TRAINER_NUM_TRAINERS"] == "1"  # rank 0 starts the job; the joiners come in as they start
        assert int(env["PS_TRAINER_MAX_TRAINERS"]) >= 1 + joiners["scale"]
        assert env["PS_TRAINER_MODE"] == "sync"  # the default mode
        assert {d: c["condition"] for d, c in services[name]["depends_on"].items()} == {
            s: "service_healthy" for s in shards}
    job_flags = {k: v for k, v in rank0["environment"].items() if k not in (
        "PS_TRAINER_RANK", "PS_TRAINER_OUTPUT", "PS_TRAINER_STEP_DELAY")}
    assert job_flags == {k: v for k, v in joiners["environment"].items() if k != "PS_TRAINER_JOIN"}
    for i, name in enumerate(shards):
        assert int(services[name]["environment"]["PS_SERVER_SHARD"]) == i
        assert services[name]["healthcheck"]["test"][:3] == ["CMD", "ps-server", "health"]
        assert any(v.startswith("checkpoints:") for v in services[name]["volumes"])
    assert "checkpoints" in cfg["volumes"]


@needs_compose
def test_compose_mode_straggler_and_max_trainers_come_from_one_environment_variable_each():
    services = resolved_compose({"PS_MODE": "stale-timeout", "PS_STRAGGLER_DELAY": "0.3",
                                 "PS_MAX_TRAINERS": "12"})["services"]
    trainers = [t for t in services if t.startswith("ps-trainer")]
    assert {services[t]["environment"]["PS_TRAINER_MODE"] for t in trainers} == {"stale-timeout"}
    assert {services[t]["environment"]["PS_TRAINER_MAX_TRAINERS"] for t in trainers} == {"12"}
    assert services["ps-trainer-0"]["environment"]["PS_TRAINER_STEP_DELAY"] == "0.3"


def test_kubernetes_manifests_validate_against_the_schema():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = k8s_documents()
    assert {d["kind"] for _, d in docs} == {"Service", "StatefulSet", "Job", "Deployment"}
    for name, doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


def _env(doc: dict) -> dict:
    return {e["name"]: e for e in doc["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_kubernetes_shards_and_trainers_agree():
    docs = {d["kind"]: d for _, d in k8s_documents()}
    sts, job, svc = docs["StatefulSet"], docs["Job"], docs["Service"]
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    for trainers in (job, docs["Deployment"]):
        addresses = _env(trainers)["PS_TRAINER_PS"]["value"].split(",")
        assert addresses == [f"ps-shard-{i}.ps-shard:7000" for i in range(sts["spec"]["replicas"])]
    shard_env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "pod-index" in shard_env["PS_SERVER_SHARD"]["valueFrom"]["fieldRef"]["fieldPath"]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    health_port = int(env["PS_SERVER_HEALTH_PORT"])  # probes go to the shard's own health port, not the data port
    assert container["readinessProbe"]["grpc"]["port"] == health_port
    assert container["livenessProbe"]["grpc"]["port"] == health_port
    assert health_port in {p["containerPort"] for p in container["ports"]}
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "checkpoints"


def test_kubernetes_rank_0_is_one_job_pod_and_the_joiners_a_scalable_deployment_of_the_same_job():
    docs = {d["kind"]: d for _, d in k8s_documents()}
    job, deployment = docs["Job"], docs["Deployment"]
    rank0, joiner = _env(job), _env(deployment)
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 1 and "completionMode" not in job["spec"]
    assert rank0["PS_TRAINER_RANK"]["value"] == "0" and rank0["PS_TRAINER_NUM_TRAINERS"]["value"] == "1"
    assert "PS_TRAINER_JOIN" not in rank0
    assert joiner["PS_TRAINER_JOIN"]["value"] == "1" and "PS_TRAINER_RANK" not in joiner  # the job ranks it
    assert deployment["metadata"]["name"] == "ps-trainer"  # kubectl scale deployment/ps-trainer (docs/elastic.md)
    assert int(rank0["PS_TRAINER_MAX_TRAINERS"]["value"]) >= 1 + deployment["spec"]["replicas"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert not job["spec"]["template"]["metadata"]["labels"].items() >= deployment["spec"]["selector"][
        "matchLabels"].items()  # the Deployment does not adopt rank 0's pod
    job_flags = {k: v for k, v in rank0.items() if k != "PS_TRAINER_RANK"}
    assert job_flags == {k: v for k, v in joiner.items() if k != "PS_TRAINER_JOIN"}


def flag_variables(prog: str) -> set[str]:
    """The environment variables a CLI reads: one per flag, named after the CLI."""
    from psserver.cli import build_parser as server_parser
    from psserver.common.cli_support import env_prefix
    from trainer.running.cli import build_parser as trainer_parser

    parser = {"ps-server": server_parser, "ps-trainer": trainer_parser}[prog]()
    return {env_prefix(prog) + a.dest.upper() for a in parser._actions if a.option_strings and a.dest != "help"}


@needs_compose
def test_every_variable_the_compose_file_sets_names_a_flag_of_the_cli_it_runs():
    for name, service in resolved_compose()["services"].items():
        prog = "ps-server" if name.startswith("ps-shard-") else "ps-trainer"
        unknown = set(service["environment"]) - flag_variables(prog)
        assert not unknown, f"{name} sets {sorted(unknown)}, which {prog} does not read"


def test_every_variable_the_kubernetes_manifests_set_names_a_flag_of_the_cli_they_run():
    docs = {d["kind"]: d for _, d in k8s_documents()}
    for kind, prog in (("StatefulSet", "ps-server"), ("Job", "ps-trainer"), ("Deployment", "ps-trainer")):
        env = {e["name"] for e in docs[kind]["spec"]["template"]["spec"]["containers"][0]["env"]}
        unknown = {n for n in env if n.startswith("PS_")} - flag_variables(prog)
        assert not unknown, f"the {kind} sets {sorted(unknown)}, which {prog} does not read"


def _starts_beyond_loopback(env: dict) -> bool:
    """Whether a shard with these variables passes ps-server's check for a host beyond loopback
    (ServerSecurity.check_exposed): loopback, a token, mutual TLS or --insecure."""
    from psserver.protocol.security import ServerSecurity

    security = ServerSecurity(token="t" if env.get("PS_SERVER_AUTH_TOKEN_FILE") else "",
                              tls_cert=env.get("PS_SERVER_TLS_CERT", ""), tls_key=env.get("PS_SERVER_TLS_KEY", ""),
                              tls_client_ca=env.get("PS_SERVER_TLS_CLIENT_CA", ""))
    try:
        security.check_exposed(env.get("PS_SERVER_HOST", "127.0.0.1"), env.get("PS_SERVER_INSECURE") == "1")
    except ValueError:
        return False
    return True


def test_kubernetes_shards_start_beyond_loopback():
    docs = {d["kind"]: d for _, d in k8s_documents()}
    env = {e["name"]: e.get("value") for e in docs["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert _starts_beyond_loopback(env)


@needs_compose
def test_compose_shards_start_beyond_loopback():
    for name, service in resolved_compose()["services"].items():
        if name.startswith("ps-shard-"):
            assert _starts_beyond_loopback(service["environment"]), name
