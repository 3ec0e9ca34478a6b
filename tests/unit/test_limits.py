"""The caps and check_id: refusals name the field and show the value cut and escaped."""

import pytest

from psserver.protocol import limits
from psserver.protocol.errors import InvalidRequest
from psserver.protocol.limits import check_id, text_problem


def test_the_caps_have_the_documented_values():
    assert (limits.MAX_TRAINERS, limits.MAX_SHARDS, limits.MAX_TOTAL_PARAMS, limits.MAX_TENSORS) == \
        (4096, 1024, 1 << 36, 65536)
    assert (limits.MAX_ID_CHARS, limits.MAX_NAME_CHARS, limits.MAX_DIMS) == (128, 256, 8)
    assert (limits.MAX_SYNC_TIMEOUT, limits.MAX_STALENESS, limits.MAX_SEQUENCE) == (86400.0, 1 << 31, 1 << 48)
    assert (limits.MAX_NUM_SAMPLES, limits.MIN_CHUNK_BYTES) == (1 << 24, 4096)


@pytest.mark.parametrize("value", ["", "t0", "rank-0@host-a:5", "x" * 128, "café", "名前"])
def test_check_id_accepts_printable_ids_up_to_the_limit(value):
    check_id("trainer_id", value)


@pytest.mark.parametrize("value,message", [
    ("x" * 4_000_000, "trainer_id is 4000000 characters long, over the limit of 128"),
    ("x" * 129, "trainer_id is 129 characters long, over the limit of 128"),
    ("rank0\nforged", "trainer_id contains a control character at position 5: 'rank0\\nforged'"),
    ("\x1b[31mred", "trainer_id contains a control character at position 0: '\\x1b[31mred'"),
    ("t\x00", "trainer_id contains a control character at position 1: 't\\x00'"),
    ("t\u200b", "trainer_id contains a non-printable character at position 1: 't\\u200b'"),
    ("t\u2028x", "trainer_id contains a non-printable character at position 1: 't\\u2028x'"),
    ("tab\there", "trainer_id contains a control character at position 3: 'tab\\there'"),
])
def test_check_id_refuses_long_or_unprintable_ids_naming_the_field(value, message):
    with pytest.raises(InvalidRequest) as e:
        check_id("trainer_id", value)
    assert str(e.value) == message


def test_check_id_shows_a_long_bad_value_cut():
    with pytest.raises(InvalidRequest) as e:
        check_id("fingerprint", "a\n" + "b" * 120)
    message = str(e.value)
    assert message.startswith("fingerprint contains a control character at position 1: 'a\\nbbb")
    assert message.endswith(" chars)") and len(message) < 130


def test_check_id_takes_another_limit():
    check_id("job_id", "x" * 200, limit=limits.MAX_NAME_CHARS)
    with pytest.raises(InvalidRequest, match="job_id is 5 characters long, over the limit of 4"):
        check_id("job_id", "x" * 5, limit=4)


def test_text_problem_refuses_a_non_string():
    assert text_problem("trainer_id", b"t0", 128) == "trainer_id must be a string, not bytes b't0'"
    assert text_problem("trainer_id", "t0", 128) is None
