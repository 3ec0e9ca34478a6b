"""Caps on every size a client declares, checked before the value touches any state.

A shard trusts nothing a request says about itself: each declared count or
length is compared with a cap here first, so a request cannot make a shard
allocate, store, loop or log in proportion to a number it made up.  The caps
sit far above any real job; they exist to turn a hostile or corrupted value
into INVALID_ARGUMENT instead of memory, time or a crash.
"""

from __future__ import annotations

import unicodedata

from psserver.common.logsafe import shorten
from psserver.protocol.errors import InvalidRequest

# A shard keeps per-trainer state (membership, sequence numbers, round bookkeeping): the number of
# trainers a job declares sizes that state, so it is capped well above any real cluster.
MAX_TRAINERS = 4096
# Each trainer opens one channel per shard and fans every step out to all of them.
MAX_SHARDS = 1024
# Partitions of one shard's slice (JobSpec.partitions): each costs the shard a Shard object, a checkpoint file and a
# version waiter, and a trainer a channel and a thread; 256 x 4 MB partitions is a 1 GB slice.
MAX_PARTITIONS = 256
# 2**36 fp32 parameters is 256 GiB: larger than any one job's flat vector we expect, small enough
# that a shard's slice length and byte counts stay far from overflow anywhere.
MAX_TOTAL_PARAMS = 1 << 36
# Tensors in a job spec: every Register compares them one by one with the job's.
MAX_TENSORS = 65536
# trainer_id, fingerprint and job_id: stored per trainer and quoted in logs.
MAX_ID_CHARS = 128
# A tensor's name (and dtype string): dotted module paths are long, but not this long.
MAX_NAME_CHARS = 256
# A tensor's rank: torch itself caps dimensions far higher, models use 1 to 5.
MAX_DIMS = 8
# stale-timeout's round deadline, in seconds (one day): larger values overflow timers.
MAX_SYNC_TIMEOUT = 86400.0
# A pending join's hold for its commit (ps-server --join-timeout), in seconds: it holds a sync job's rounds.
MAX_JOIN_TIMEOUT = 3600.0
# async mode's staleness bound, in versions.
MAX_STALENESS = 1 << 31
MAX_TABLES = 64  # sparse embedding tables in one job
# A push's per-trainer sequence number: at a million pushes a second, 2**48 lasts nine years.
MAX_SEQUENCE = 1 << 48
# Pushes one trainer may have in flight to one shard at once (async --push-window): the shard remembers this
# many numbers below the newest it acknowledged, so one overtaken in flight is still applied once.
MAX_PUSH_WINDOW = 64
# Versions in a learning-rate schedule (warm-up, step size, cosine period): past any real run.
MAX_SCHEDULE_STEPS = 1 << 48
# Samples behind one gradient: it weights the gradient when rounds are averaged.
MAX_NUM_SAMPLES = 1 << 24
# Every chunk of a stream but the last carries at least min(MIN_CHUNK_BYTES, bytes remaining):
# a stream of one-byte chunks would cost a message, a header check and a copy per byte.
MIN_CHUNK_BYTES = 4096
# Chunks one Step message may carry in ``more`` (a shard's requests): a dense part and one part a table, and then
# one chunk for every MIN_CHUNK_BYTES of a 16 MiB message (every chunk of a part but its last carries at least that).
# A trainer's one-message step is a chunk a part.  Each entry is parsed into Python objects on the event loop before
# anything else is checked (psserver.protocol.stepwire.parse_step).
MAX_STEP_MESSAGE_CHUNKS = 1 + MAX_TABLES + (16 << 20) // MIN_CHUNK_BYTES  # 4,161
# A Step reply asked for in one message (StepChunk.one_reply) is packed when it is at most this many bytes (and
# at most half the shard's message limit); a larger one streams.  A protocol constant, not a shard's flag: a
# trainer whose reply is sure to be packed (at most ONE_REPLY_UNARY_BYTES of weights and rows) reads it with a
# unary call, which cannot read a stream.
ONE_REPLY_BYTES = 1 << 20
ONE_REPLY_UNARY_BYTES = ONE_REPLY_BYTES // 2  # the rest: headers, a few hundred bytes a part


def text_problem(field: str, value: str, limit: int) -> str | None:
    """What is wrong with a client-supplied string (too long, not a string, a control or other
    non-printable character), as a message naming ``field``; None if nothing is.  Checks the
    length first, so a huge value costs no scan."""
    if not isinstance(value, str):
        return f"{field} must be a string, not {type(value).__name__} {shorten(value)}"
    if len(value) > limit:
        return f"{field} is {len(value)} characters long, over the limit of {limit}"
    if value.isprintable():
        return None
    for i, ch in enumerate(value):
        if not ch.isprintable():
            kind = "a control character" if unicodedata.category(ch) == "Cc" else "a non-printable character"
            return f"{field} contains {kind} at position {i}: {shorten(value)}"
    return None  # unreachable: isprintable() said some character is not


def check_id(field: str, value: str, limit: int = MAX_ID_CHARS) -> None:
    """Refuse an id (trainer_id, fingerprint, job_id) that is too long or could forge or garble a log line.

    Raises:
        InvalidRequest: naming ``field`` and quoting the value through ``shorten``.
    """
    problem = text_problem(field, value, limit)
    if problem:
        raise InvalidRequest(problem)

def check_num_samples(num_samples: int) -> None:
    """Refuse a gradient (dense or rows) that stands for no sample: ``num_samples`` weights it in a round's
    average, so one of 0 would be acknowledged as a push and then weigh nothing."""
    if num_samples < 1:
        raise InvalidRequest(f"num_samples is {num_samples} but a gradient needs at least 1 sample")


# Sparse tables (psserver.sparse).  A row's width: 65536 fp32 is 256 KiB a row, past any embedding.
MAX_EMBEDDING_DIM = 1 << 16
# Live rows one table may keep on one shard (its max_rows): 2**32 rows of dim 1 are already 16 GiB.
MAX_TABLE_ROWS = 1 << 32
# Ids in one lookup or push: 2**20 rows of dim 64 are 256 MiB of fp32.  A call this big is checked, its rows
# created and gathered on the state worker, never on the event loop (psserver.serving.service: ServedTable.small_work
# decides); docs/memory.md.
MAX_IDS_PER_CALL = 1 << 20
# Bytes of rows in one PullRows reply (ids x dim x 4): a reply is held whole until its reader took it, so a
# few stalled readers must not pin gigabytes.  2**20 ids of dim 16 fit; a trainer splits a bigger pull
# (trainer.tables.sparse_client), and a shard refuses one RESOURCE_EXHAUSTED naming both sizes.
MAX_ROWS_REPLY_BYTES = 64 << 20
# Sightings an id needs before its row is stored (admit_after).
MAX_ADMIT_AFTER = 1 << 16

# A Step part's chunks may take on the wire (what they keep in memory: a dense chunk's data is a view into its
# whole message) their declared payload plus a header's ids and numbers and each chunk's framing (tags, lengths,
# an offset) -- and a table part's pull ids, extra ids and pull refs, which their own checks bound (step_parts).
# A header of this protocol takes under 1 KiB besides those; a chunk's framing under 20 bytes.
STEP_PART_HEADER_BYTES = 4096
STEP_CHUNK_FRAMING_BYTES = 32

# A shard serves at most this many data calls naming one rank (and partition) at once: ps-server
# --max-calls-per-rank's default; a call past it is refused RESOURCE_EXHAUSTED (psserver.serving.service).
MAX_CALLS_PER_RANK = 8
# A trainer's windowed async table pushes (trainer.tables.table_window) on the wire to one shard at once, across all its
# tables: the per-rank cap less room for the step's own call and a pull.  Without it, W pushes in flight per
# table times 26 tables passed the cap and the shard refused them.
ROW_PUSHES_ON_WIRE_PER_SHARD = MAX_CALLS_PER_RANK - 2
