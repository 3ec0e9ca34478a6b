"""deploy/compose_demo.py's decisions, without an engine: the mirror, the network check, the verdict."""

import pytest

from tests.deploy_config import compose_demo

demo = compose_demo()

INDEXTARGETS = """http://deb.debian.org/debian-security/ bookworm-security
http://deb.debian.org/debian/ bookworm-updates
http://mirror.example/debian/ bookworm
"""


def test_the_mirror_is_the_one_the_apt_sources_name_for_bookworm():
    assert demo.debian_mirror(INDEXTARGETS) == "http://mirror.example/debian/"


def test_another_releases_main_mirror_serves_when_no_source_names_bookworm():
    trixie = "http://deb.debian.org/debian-security/ trixie-security\nhttp://deb.debian.org/debian/ trixie\n"
    assert demo.debian_mirror(trixie) == "http://deb.debian.org/debian/"


def test_no_debian_source_is_an_error_naming_the_suite():
    with pytest.raises(demo.DemoError, match="bookworm"):
        demo.debian_mirror("https://deb.nodesource.com/node_20.x/ nodistro\n".replace("nodistro", "nodistro x"))


def test_network_diff_names_gone_and_new_lines_per_command():
    before = {"iptables -S": "-P FORWARD ACCEPT\n-N KEEP", "ip link": "1: lo"}
    after = {"iptables -S": "-P FORWARD DROP\n-N KEEP", "ip link": "1: lo"}
    assert demo.network_diff(before, after) == ["iptables -S: - -P FORWARD ACCEPT", "iptables -S: + -P FORWARD DROP"]
    assert demo.network_diff(before, before) == []


def test_only_lines_an_engine_makes_count_against_the_run():
    diff = ["iptables -S: + -P FORWARD DROP", "iptables -S: + -N DOCKER-USER", "ip link: + 7: docker0: <BROADCAST>",
            "ip link: + 9: br-0123456789ab: <UP>", "ip link: + 11: veth1a2b3c4@if10: <UP>",
            "ip link: + 12: pt-h0@if13: <UP>", "iptables -S: - -P FORWARD ACCEPT"]
    assert demo.docker_made(diff) == diff[:5]


def test_the_trainer_result_is_its_last_done_line():
    out = 'noise\n{"event": "done", "test_accuracy": 0.95, "steps_lost": 3}\n'
    assert demo.trainer_result(out) == {"event": "done", "test_accuracy": 0.95, "steps_lost": 3}
    assert demo.trainer_result("Traceback (most recent call last):\n") == {}


def _containers(**overrides):
    c = {"ps-shard-0": {"role": "shard", "exit_code": 0, "restarts": 1},
         "ps-trainer-0": {"role": "trainer", "exit_code": 0, "restarts": 0, "test_accuracy": 0.95, "rank": 0},
         "ps-trainer.1": {"role": "trainer", "exit_code": 0, "restarts": 0, "test_accuracy": 0.95, "rank": 1}}
    for name, fields in overrides.items():
        key = name.replace("_", "-").replace("-r", ".")  # ps_trainer_r1: the replica ps-trainer.1
        c[key] = {**c[key], **fields}
    return c


def test_a_run_passes_with_every_exit_0_the_bar_met_and_the_killed_shard_restarted():
    assert demo.verdict(_containers(), 0.90, killed="ps-shard-0") == []


@pytest.mark.parametrize("overrides, problem", [
    ({"ps_trainer_0": {"exit_code": 1}}, "ps-trainer-0 exited 1"),
    ({"ps_shard_0": {"exit_code": 137}}, "ps-shard-0 exited 137"),
    ({"ps_trainer_0": {"test_accuracy": 0.89}}, "ps-trainer-0 reached test accuracy 0.89 (bar 0.9)"),
    ({"ps_trainer_0": {"test_accuracy": None}}, "ps-trainer-0 reached test accuracy None (bar 0.9)"),
    ({"ps_shard_0": {"restarts": 0}}, "ps-shard-0 was killed but never restarted"),
    ({"ps_trainer_r1": {"rank": 0}}, "trainer ranks [0, 0] repeat: the job hands each trainer its own"),
])
def test_a_run_fails_naming_what_went_wrong(overrides, problem):
    assert demo.verdict(_containers(**overrides), 0.90, killed="ps-shard-0") == [problem]


def test_scale_below_zero_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--scale", "-1"])
    assert e.value.code == 2 and "--scale is -1 but must be 0 or more" in capsys.readouterr().err


def test_without_root_no_engine_can_be_started_and_the_reason_says_so(monkeypatch):
    monkeypatch.setattr(demo.os, "geteuid", lambda: 1000)
    assert demo.engine_unavailable_reason() == "starting a Docker engine needs root"
