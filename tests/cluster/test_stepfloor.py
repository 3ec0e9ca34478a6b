"""The sparse step's transport floor (trainer.tools.stepfloor) over real echo server processes on loopback: each
step's sizes replayed as one unary call a shard, the replies of the asked sizes, and no process left behind."""

import struct

import pytest

from trainer.tools import stepfloor


@pytest.mark.parametrize("shards", [1, 2])
def test_each_step_is_one_call_a_shard_to_as_many_echo_servers_and_every_server_exits(tmp_path, children, shards):
    sizes = [[(4 + 1000 * k, 2_000_000 + k) for _ in range(shards)] for k in range(5)]  # a request under 8 bytes too
    assert stepfloor.measure(sizes, tmp_path) > 0
    assert len(children) == shards and all(c.popen.poll() is not None for c in children)


def test_a_step_that_cannot_be_sent_fails_the_floor_and_every_server_exits(tmp_path, children):
    with pytest.raises(struct.error):
        stepfloor.measure([[(100, -1)]], tmp_path)  # a reply size the request cannot carry
    assert children and all(c.popen.poll() is not None for c in children)
