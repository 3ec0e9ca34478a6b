"""The Step RPC against a real shard on loopback: one call carrying a dense PushPull and tables' PushPullRows /
PushRows answers what those calls answer, a retry under the same numbers applies nothing twice, a shard's tables
alone or its dense slice alone work the same, and every refusal of the call's fields changes nothing."""

from __future__ import annotations

import grpc
import pytest
import torch

from psserver.protocol import limits
from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stepwire import StepMessage, one_message, parse_step, serialize_step
from psserver.protocol.stubs import method
from tests.conftest import P
from tests.helpers import refused
from tests.integration.test_push_pull_rows import push_pull
from tests.integration.test_sparse_rpc import DIM, job, pull_rows, rows_chunks


def started(shard_server, **cfg):
    """A shard of the sparse test job (a dense slice of P and table ``emb``), registered and initialised."""
    raw = shard_server(**cfg)
    raw.register(spec=job(num_embeddings=100))
    raw.init(torch.zeros(P))
    return raw


def dense(raw, grad, part=0, **header):
    h = raw.header(n=header.pop("n", grad.numel()), sequence=header.pop("sequence", 1), **header)
    return [StepMessage(part, dense=c) for c in encode(wire_tensor(grad, h.dtype), h, 1024)]


def rows(part, chunks, pull_ids=None):
    if pull_ids is not None:
        chunks[0].header.pull_ids = torch.tensor(pull_ids, dtype=torch.int64).numpy().tobytes()
    return [StepMessage(part, rows=c) for c in chunks]


def step(raw, msgs) -> dict[int, list]:
    """One Step call: each part's reply chunks by part number."""
    call = raw.channel.stream_stream(method("Step"), serialize_step, parse_step)
    out: dict[int, list] = {}
    for m in call(iter(msgs), timeout=10):
        out.setdefault(m.part, []).append(m.dense if m.dense is not None else m.rows)
    return out


def weights(chunks) -> tuple[pb.ChunkHeader, torch.Tensor]:
    return chunks[0].header, torch.frombuffer(bytearray(b"".join(bytes(c.data) for c in chunks)), dtype=torch.float32)


def table_reply(chunks) -> tuple[pb.PushRowsReply, int, torch.Tensor]:
    data = b"".join(c.rows for c in chunks)
    return chunks[0].header.push, chunks[0].header.version, torch.frombuffer(bytearray(data),
                                                                             dtype=torch.float32).view(-1, DIM)


def test_one_step_call_answers_what_a_push_pull_and_a_push_pull_rows_answer(shard_server):
    one, two = started(shard_server), started(shard_server)
    grad = torch.linspace(-1, 1, P)
    got = step(one, dense(one, grad) + rows(1, rows_chunks([1, 2]), [1, 2, 3]))
    h, w = weights(got[0])
    expect_h, expect_w = two.push_pull(grad, sequence=1)
    reply, version, r = table_reply(got[1])
    expect_reply, expect_version, expect_r = push_pull(two, rows_chunks([1, 2]), [1, 2, 3])
    assert h.outcome == expect_h.outcome == pb.APPLIED and h.version == expect_h.version == 1
    assert torch.equal(w, expect_w)
    assert reply.outcome == expect_reply.outcome == pb.APPLIED and version == expect_version == 1
    assert torch.equal(r, expect_r)
    assert one.stats().counters["step_calls"] == 1


def test_a_step_sent_as_one_message_answers_what_the_same_step_as_a_stream_answers(shard_server):
    streamed, single = started(shard_server), started(shard_server)
    msgs = lambda raw: dense(raw, torch.linspace(-1, 1, P)) + rows(1, rows_chunks([1, 2]), [1, 2, 3])  # noqa: E731
    a = step(streamed, msgs(streamed))
    call = single.channel.unary_stream(method("Step"), serialize_step, parse_step)
    b: dict[int, list] = {}
    for m in call(one_message(msgs(single)), timeout=10):
        b.setdefault(m.part, []).append(m.dense if m.dense is not None else m.rows)
    assert torch.equal(weights(a[0])[1], weights(b[0])[1]) and weights(b[0])[0].outcome == pb.APPLIED
    assert torch.equal(table_reply(a[1])[2], table_reply(b[1])[2]) and table_reply(b[1])[0].outcome == pb.APPLIED


def test_a_step_retried_under_the_same_numbers_applies_nothing_twice_and_answers_the_same(shard_server):
    raw = started(shard_server)
    msgs = dense(raw, torch.ones(P)) + rows(1, rows_chunks([1, 2]), [1, 2, 5])
    first = step(raw, msgs)
    after = raw.digest()
    again = step(raw, msgs)  # its reply was "lost": the same numbers again
    assert raw.digest() == after
    assert weights(first[0])[0].outcome == pb.APPLIED and weights(again[0])[0].outcome == pb.DUPLICATE
    assert torch.equal(weights(first[0])[1], weights(again[0])[1])
    assert table_reply(first[1])[0].outcome == pb.APPLIED and table_reply(again[1])[0].outcome == pb.DUPLICATE
    assert torch.equal(table_reply(first[1])[2], table_reply(again[1])[2])
    c = raw.stats().counters
    assert c["duplicates"] == 1 and c["table.emb.pushes_duplicate"] == 1


def test_a_step_of_tables_alone_and_one_of_the_dense_slice_alone_work_the_same(shard_server):
    raw = started(shard_server)
    tables_only = step(raw, rows(0, rows_chunks([1, 2])))  # no pull ids: a PushRows, answered at once
    assert list(tables_only) == [0] and tables_only[0][0].header.push.outcome == pb.APPLIED
    assert tables_only[0][0].header.table == "emb" and not tables_only[0][0].rows
    dense_only = step(raw, dense(raw, torch.ones(P)))
    assert list(dense_only) == [0] and weights(dense_only[0])[0].version == 1
    assert pull_rows(raw, [1, 2])[0] == 1


def _nan_rows():
    grads = torch.ones(2, DIM)
    grads[1, 0] = float("nan")
    return rows_chunks([1, 2], grads=grads)


def _cases(raw):
    """name -> (the Step's messages, status, fragments of its message)."""
    invalid, exhausted = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
    d = dense(raw, torch.ones(P))
    no_header = rows_chunks([1, 2])
    no_header[0].ClearField("header")
    return {
        "empty stream": ([], invalid, "the Step stream is empty"),
        "part numbers skip": (d + rows(2, rows_chunks([1])), invalid, "part is 2 but 0 or 1 was expected"),
        "first part not 0": (rows(1, rows_chunks([1])), invalid, "part is 1 but -1 or 0 was expected"),
        "a part changes kind": (d + rows(0, rows_chunks([1])), invalid, "part 0 is dense but a chunk of it carries rows"),
        "two dense parts": (d + dense(raw, torch.ones(P), part=1), invalid, "part 1 is a second dense part"),
        "a table twice": (rows(0, rows_chunks([1])) + rows(1, rows_chunks([2], seq=2)), invalid,
                          "part 1 names table 'emb', as part 0 did"),
        "two callers": (d + rows(1, rows_chunks([1], rank=1)), invalid, "part 1 names rank 1", "part 0 names rank 0"),
        "a part without header": (d + rows(1, no_header), invalid, "part 1's first chunk has no header"),
        "a chunk of neither kind": ([StepMessage(0)], invalid, "carries neither dense nor rows"),
        "unknown table": (d + rows(1, rows_chunks([1], table_name="nope")), invalid, "table is 'nope'"),
        "wrong dim": (d + rows(1, rows_chunks([1], dim=DIM + 1)), invalid, f"dim is {DIM + 1}"),
        "repeated pull ids": (d + rows(1, rows_chunks([1]), [4, 4]), invalid, "id 4 appears 2 times"),
        "repeated push ids": (d + rows(1, rows_chunks([3, 3])), invalid, "id 3 appears 2 times"),
        "rows past num_ids": (d + rows(1, rows_chunks([1, 2], num_ids=1)), invalid,
                              "part 1 carries 48 bytes so far but its header declares 24 bytes"),
        "NaN in a table's rows": (d + rows(1, _nan_rows()), invalid, "NaN"),
        "dense dtype": (dense(raw, torch.ones(P), dtype=pb.BFLOAT16) + rows(1, rows_chunks([1])), invalid,
                        "dtype is bfloat16"),
        "dense of another caller's fingerprint": (dense(raw, torch.ones(P), fingerprint="e" * 16), grpc.StatusCode.FAILED_PRECONDITION,
                                                  "fingerprint"),
        "over the pull id cap": (d + [StepMessage(1, rows=_over_cap())], exhausted,
                                 f"{limits.MAX_IDS_PER_CALL + 1} entries, over the limit"),
    }


def _over_cap():
    chunk = rows_chunks([1])[0]
    chunk.header.pull_ids = b"\0" * 8 * (limits.MAX_IDS_PER_CALL + 1)
    return chunk


CASES = ["empty stream", "part numbers skip", "first part not 0", "a part changes kind", "two dense parts",
         "a table twice", "two callers", "a part without header", "a chunk of neither kind", "unknown table",
         "wrong dim", "repeated pull ids", "repeated push ids", "rows past num_ids", "NaN in a table's rows",
         "dense dtype", "dense of another caller's fingerprint", "over the pull id cap"]


@pytest.mark.parametrize("case", CASES)
def test_a_refused_step_changes_no_state_and_the_shard_goes_on_serving(shard_server, case):
    raw = started(shard_server)
    msgs, code, *fragments = _cases(raw)[case]
    refused(lambda: step(raw, msgs), code, *fragments, unchanged=raw)
    assert raw.stats().counters.get("table.emb.pushes_applied", 0) == 0 and raw.stats().version == 0
    after = step(raw, dense(raw, torch.ones(P)) + rows(1, rows_chunks([1]), [1]))  # still serving
    assert weights(after[0])[0].outcome == pb.APPLIED and table_reply(after[1])[0].outcome == pb.APPLIED


def test_a_step_stream_past_the_byte_limit_is_refused_before_any_part_runs(shard_server):
    raw = started(shard_server, max_push_bytes=6 * P)  # each part alone is under it
    refused(lambda: step(raw, dense(raw, torch.ones(P)) + rows(1, rows_chunks(list(range(90))))),
            grpc.StatusCode.RESOURCE_EXHAUSTED, "the Step stream holds", f"limit of {6 * P} bytes", unchanged=raw)
    assert raw.stats().version == 0
    assert weights(step(raw, dense(raw, torch.ones(P)))[0])[0].outcome == pb.APPLIED
