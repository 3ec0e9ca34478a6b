"""The hot standby's command-line mistakes (ps-server --etcd, ps-cluster --standbys / --kill-primary, a trainer's
PRIMARY|STANDBY address): a one-line cause naming the flag, before anything starts."""

from types import SimpleNamespace

import pytest

from psserver import cli as server_cli
from psserver.protocol.security import channel_target, parse_addresses
from trainer.local import standby_cluster


@pytest.mark.parametrize("argv, message", [
    (["--shard", "0", "--etcd", "127.0.0.1:2379"], "--etcd needs --port"),
    (["--shard", "0", "--port", "7000", "--etcd", "127.0.0.1:2379", "--lease-seconds", "0"], "--lease-seconds"),
    (["--shard", "0", "--port", "7000", "--etcd", "127.0.0.1:2379", "--ship-timeout", "0"], "--ship-timeout"),
    (["--shard", "0", "--port", "7000", "--etcd", "nowhere"], "give HOST:PORT"),
    (["--shard", "0", "--port", "7000", "--etcd", "127.0.0.1:2379", "--tls-cert", "c.pem", "--tls-key", "k.pem"],
     "--etcd with --tls-cert needs --tls-client-ca"),
])
def test_ps_server_refuses_a_replica_it_cannot_run_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        server_cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_ps_server_refuses_a_replica_without_the_operators_admin_token(monkeypatch, capsys):
    monkeypatch.delenv("PS_ADMIN_TOKEN", raising=False)
    with pytest.raises(SystemExit) as e:
        server_cli.main(["--shard", "0", "--port", "7000", "--etcd", "127.0.0.1:2379"])
    assert e.value.code == 2
    assert "--etcd needs the operator's admin token" in capsys.readouterr().err


def cluster_args(**kw):
    return SimpleNamespace(**{"standbys": 1, "kill_primary": "", "shards": 2, "reshard": "", "elastic": False,
                              "elastic_schedule": "", **kw})


@pytest.mark.parametrize("kw, message", [
    (dict(standbys=2), "0 or 1 standby"),
    (dict(standbys=0, kill_primary="0@5"), "needs --standbys 1"),
    (dict(reshard="3@5"), "does not go with --reshard"),
    (dict(kill_primary="2@5"), "shards 0..1"),
    (dict(kill_primary="0@x"), "SHARD@ROUND"),
    (dict(kill_primary="0@0"), "SHARD@ROUND"),
    (dict(kill_primary="0@9,0@5"), "must increase"),
])
def test_ps_cluster_refuses_a_standby_scenario_it_cannot_run(kw, message):
    with pytest.raises(ValueError, match=message):
        standby_cluster.check(cluster_args(**kw))


def test_ps_cluster_kills_are_read_in_order():
    assert standby_cluster.check(cluster_args(kill_primary="0@5, 1@7,0@9")) == [(0, 5), (1, 7), (0, 9)]


def test_a_shard_with_a_standby_is_one_address_entry_and_one_pick_first_channel_target():
    assert parse_addresses("127.0.0.1:1|127.0.0.1:2,127.0.0.1:3") == ["127.0.0.1:1|127.0.0.1:2", "127.0.0.1:3"]
    assert channel_target("127.0.0.1:1|localhost:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target("127.0.0.1:1") == "127.0.0.1:1"
    with pytest.raises(ValueError, match="not HOST:PORT"):
        parse_addresses("127.0.0.1:1|nope")


def test_a_channel_to_a_shards_replicas_takes_the_replica_options_over_what_its_maker_asked(monkeypatch):
    import grpc

    from psserver.protocol.security import REPLICA_CHANNEL, ClientSecurity

    made = []
    monkeypatch.setattr(grpc, "insecure_channel", lambda target, options: made.append((target, options)))
    asked = [("grpc.max_reconnect_backoff_ms", 2000), ("grpc.keepalive_time_ms", 30_000), ("grpc.lb", "x")]
    ClientSecurity().channel("127.0.0.1:1|127.0.0.1:2", options=asked)
    ClientSecurity().channel("127.0.0.1:1", options=asked)
    (_, replicated), (_, plain) = made
    assert dict(replicated) == {**dict(asked), **dict(REPLICA_CHANNEL)} and len(replicated) == len(dict(replicated))
    assert dict(replicated)["grpc.max_reconnect_backoff_ms"] == 250 and plain == asked


@pytest.mark.parametrize("module", ["psserver.cli", "trainer.running.cli", "trainer.local.cluster",
                                    "trainer.tools.loadgen.cli"])
def test_every_flag_of_every_cli_reads_its_environment_variable_grouped_flags_too(module):
    """ps-server's replica flags sit in an argument group, whose add_argument bypassed the environment: the
    compose file's PS_SERVER_ETCD was ignored and its replicas ran as plain shards."""
    import importlib

    parser = importlib.import_module(module).build_parser()
    missing = [a.option_strings[0] for a in parser._actions
               if a.option_strings and a.dest != "help" and "[env " not in (a.help or "")]
    assert missing == []


def test_a_replica_flag_in_the_environment_is_taken(monkeypatch):
    monkeypatch.setenv("PS_SERVER_ETCD", "etcd:2379")
    monkeypatch.setenv("PS_SERVER_REPLICA", "b")
    args = server_cli.build_parser().parse_args(["--shard", "0"])
    assert (args.etcd, args.replica) == ("etcd:2379", "b")


class _SilentEtcd:
    """A store whose etcd answers after ``fails`` tries."""

    def __init__(self, fails: int):
        self.fails, self.tries = fails, 0

    def grant(self, seconds):
        self.tries += 1
        if self.tries <= self.fails:
            raise ConnectionError("etcd is not up yet")


def _replica(store):
    from psserver.replication.replica import Replica, ReplicaOptions

    cfg = SimpleNamespace(shard=0, host="127.0.0.1", port=7000)
    return Replica(cfg, ReplicaOptions(etcd="etcd:2379", replica="a", job="j"), store=store,
                   server_factory=lambda *a, **k: None)


def test_a_replica_waits_for_an_etcd_that_comes_up_after_it():
    import threading

    store = _SilentEtcd(fails=2)
    _replica(store)._first_lease(threading.Event())
    assert store.tries == 3


def test_a_replica_whose_etcd_never_answers_stops_with_a_one_line_cause(monkeypatch):
    import threading

    from psserver.replication import replica

    monkeypatch.setattr(replica, "ETCD_START_SECONDS", 0.0)
    with pytest.raises(RuntimeError, match=r"etcd at etcd:2379 \(--etcd\) did not answer within 0 s"):
        _replica(_SilentEtcd(fails=10))._first_lease(threading.Event())


def test_a_replica_listening_on_a_wildcard_advertises_an_address_the_other_replicas_can_reach():
    import socket

    from psserver.replication.replica import advertised_host

    assert advertised_host("10.0.0.7") == "10.0.0.7"
    assert advertised_host("0.0.0.0", "ps-shard-0a") == "ps-shard-0a"
    for wildcard in ("0.0.0.0", "::", "[::]"):
        assert advertised_host(wildcard) == socket.gethostbyname(socket.gethostname())
