"""Quoting client strings safely, and rate-limiting repeated log lines (fake clock, no sleeping)."""

import ast
import logging
import threading

import pytest

from psserver.common.logsafe import MIN_LIMIT, RateLimitedLog, counted, shorten


@pytest.mark.parametrize("value,shown", [
    ("rank0", "'rank0'"),
    ("", "''"),
    ("rank0\nforged", "'rank0\\nforged'"),
    ("a\r\tb", "'a\\r\\tb'"),
    ("\x1b[2J", "'\\x1b[2J'"),
    ("\x00\x7f", "'\\x00\\x7f'"),
    ("café", "'caf\\xe9'"),
    ("\u202eevil", "'\\u202eevil'"),
    ("🙂", "'\\U0001f642'"),
    ("it's", "'it\\'s'"),
    ("back\\slash", "'back\\\\slash'"),
    ("…", "'\\u2026'"),
])
def test_shorten_escapes_like_a_python_literal_in_printable_ascii(value, shown):
    assert shorten(value) == shown
    assert shorten(value).isascii() and shorten(value).isprintable()


def test_shorten_cuts_to_the_limit_and_says_how_much_was_cut():
    value = "x" * 4_000_000
    out = shorten(value)
    assert len(out) <= 64
    kept = out.index("'", 1) - 1
    assert out == "'" + "x" * kept + f"'…(+{4_000_000 - kept} chars)"


@pytest.mark.parametrize("limit", [MIN_LIMIT, 40, 64, 100, 1000])
@pytest.mark.parametrize("value", ["y" * 5000, "\n" * 5000, "é" * 5000, "ab\x1bc" * 700, "🙂" * 300])
def test_shorten_never_exceeds_the_limit_and_counts_every_cut_character(value, limit):
    out = shorten(value, limit)
    assert len(out) <= limit
    assert out.count("…") == 1 and out.replace("…", "").isascii() and out.isprintable()
    head, _, cut = out.rpartition("…(+")
    assert cut.endswith(" chars)")
    shown_chars = len(ast.literal_eval(head))  # the kept part is a valid literal of the value's first characters
    assert value.startswith(ast.literal_eval(head))
    assert shown_chars + int(cut.removesuffix(" chars)")) == len(value)


def test_shorten_keeps_a_value_that_just_fits_whole():
    assert shorten("z" * 62) == "'" + "z" * 62 + "'"
    assert "…" in shorten("z" * 63)


def test_shorten_never_splits_an_escape():
    out = shorten("a" + "\n" * 100, 40)
    head = out.rpartition("…(+")[0]
    assert head.endswith("\\n'") and ast.literal_eval(head) == "a" + "\n" * ((len(head) - 3) // 2)


def test_shorten_of_other_values_uses_their_repr_escaped():
    assert shorten(3.5) == "3.5"
    assert shorten(b"\x00ab") == "b'\\x00ab'"
    assert shorten(["é\n"]) == "['é\\n']".replace("é", "\\xe9")
    out = shorten(list(range(10_000)))
    assert len(out) <= 64 and out.startswith("[0, 1, 2") and out.endswith(" chars)")


def test_shorten_refuses_a_limit_too_small_for_its_marker():
    with pytest.raises(ValueError, match=r"The limit \(10\) must be at least 32"):
        shorten("abc", 10)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def captured():
    logger = logging.getLogger("test_logsafe.rate_limited")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    yield logger, records
    logger.removeHandler(handler)


def messages(records):
    return [r.getMessage() for r in records]


def test_a_burst_passes_and_the_rest_is_suppressed(clock, captured):
    logger, records = captured
    log = RateLimitedLog(logger, burst=5, interval=10.0, clock=clock)
    results = [log.warning("refused", "refused rank %d", i) for i in range(12)]
    assert results == [True] * 5 + [False] * 7
    assert messages(records) == [f"refused rank {i}" for i in range(5)]
    assert all(r.levelno == logging.WARNING for r in records)
    assert log.suppressed("refused") == 7


def test_the_suppressed_count_is_reported_when_the_next_window_opens(clock, captured):
    logger, records = captured
    log = RateLimitedLog(logger, burst=2, interval=10.0, clock=clock)
    for i in range(5):
        log.warning("k", "refused %d", i)
    clock.now += 9.9
    assert not log.warning("k", "still in the first window")
    clock.now += 0.1
    assert log.warning("k", "refused %s", "again")
    assert messages(records)[-1] == "(4 similar messages suppressed in the last 10 s) refused again"
    assert log.suppressed("k") == 0
    assert log.warning("k", "second of the new window")
    assert messages(records)[-1] == "second of the new window"


def test_a_quiet_window_reports_nothing(clock, captured):
    logger, records = captured
    log = RateLimitedLog(logger, burst=2, interval=10.0, clock=clock)
    log.warning("k", "one")
    clock.now += 60
    log.warning("k", "two")
    assert messages(records) == ["one", "two"]


def test_keys_are_limited_independently(clock, captured):
    logger, records = captured
    log = RateLimitedLog(logger, burst=1, interval=10.0, clock=clock)
    assert log.warning("a", "a1") and log.warning("b", "b1")
    assert not log.warning("a", "a2")
    assert log.warning("c", "c1")
    assert messages(records) == ["a1", "b1", "c1"]
    assert (log.suppressed("a"), log.suppressed("b"), log.suppressed("c")) == (1, 0, 0)


def test_the_key_table_is_bounded_and_forgets_the_least_recently_used(clock, captured):
    logger, records = captured
    log = RateLimitedLog(logger, burst=1, interval=10.0, max_keys=3, clock=clock)
    for key in ("a", "b", "c"):
        log.warning(key, key)
    assert not log.warning("a", "a again")  # a is now the most recent; b the oldest
    log.warning("d", "d")  # forgets b
    assert len(log._windows) == 3
    assert log.warning("b", "b again")  # a fresh key: logged
    assert not log.warning("a", "a a third time")  # still remembered, still suppressed
    for i in range(10_000):
        log.warning(f"key{i}", "many")
    assert len(log._windows) == 3


def test_a_huge_key_is_cut_so_memory_stays_bounded(clock, captured):
    logger, _ = captured
    log = RateLimitedLog(logger, burst=1, clock=clock)
    log.warning("k" * 1_000_000, "one")
    assert not log.warning("k" * 2_000_000, "same kind")
    assert all(len(k) <= RateLimitedLog.MAX_KEY_CHARS for k in log._windows)


def test_other_levels_and_percent_signs_in_arguments(clock, captured):
    logger, records = captured
    log = RateLimitedLog(logger, burst=1, interval=1.0, clock=clock)
    log.log(logging.ERROR, "k", "value %s", "100%")
    log.log(logging.ERROR, "k", "value %s", "200%")
    clock.now += 1
    log.log(logging.ERROR, "k", "value %s", "300%")
    assert messages(records) == ["value 100%", "(1 similar messages suppressed in the last 1 s) value 300%"]
    assert records[-1].levelno == logging.ERROR


def test_concurrent_callers_log_exactly_the_burst(clock, captured):
    logger, records = captured
    log = RateLimitedLog(logger, burst=5, interval=10.0, clock=clock)
    barrier = threading.Barrier(8)

    def hammer():
        barrier.wait()
        for _ in range(200):
            log.warning("k", "refused")

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(records) == 5
    assert log.suppressed("k") == 8 * 200 - 5


@pytest.mark.parametrize("kw,message", [
    (dict(burst=0), "The burst (0) must be at least 1."),
    (dict(interval=0.0), "The interval (0.0 s) must be greater than zero."),
    (dict(max_keys=0), "The maximum number of keys (0) must be at least 1."),
])
def test_invalid_settings_are_refused(kw, message):
    with pytest.raises(ValueError) as e:
        RateLimitedLog(logging.getLogger("x"), **kw)
    assert str(e.value) == message


def test_counted_agrees_the_noun_with_the_count():
    assert [counted(n, "trainer") for n in (0, 1, 2)] == ["0 trainers", "1 trainer", "2 trainers"]
    assert counted(1, "damaged file") == "1 damaged file" and counted(3, "index", "indices") == "3 indices"
