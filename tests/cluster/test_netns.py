"""The tests' network namespaces (tests/cluster/netns.py): their hosts reach each other at once, and the
machine's firewall and links end as they were -- also where the firewall drops forwarded traffic."""

import pytest

from tests.cluster.netns import Hosts, firewall_as_others_see_it, links


def test_namespace_hosts_reach_each_other_and_leave_firewall_and_links_as_they_were():
    hosts = Hosts(["a", "b", "c"])
    before = firewall_as_others_see_it(hosts.tag)
    hosts.up()
    try:
        if hosts.fallback:
            pytest.skip(hosts.fallback_reason)
        assert hosts.tag in links()
        assert hosts.reachable("a", "b") and hosts.reachable("c", "a") and hosts.reachable("b", "c")
    finally:
        hosts.down()
    assert firewall_as_others_see_it(hosts.tag) == before
    assert hosts.tag not in links()
