/* The table kernel's loops in C: the id index's probe and insert and the uniform initialiser, over numpy buffers.
 *
 * Optional (psserver.protocol.rows.kernel picks it when it was built, the numpy path otherwise) and bit-identical
 * to the numpy path: the same hash, the same probe sequence, the same float32 arithmetic for a row's initial
 * values (tests/unit/test_row_kernel.py runs both on the same inputs).  What numpy does there as a handful of
 * whole-array passes per probe round, each paying a fixed cost and allocating, is one loop here.  No libtorch and
 * no numpy headers: the arguments are Python buffers, so the extension is tied to no torch or numpy version.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define EMPTY 0
#define FULL 1
#define GAMMA 0x9E3779B97F4A7C15ULL
#define MIX1 0xBF58476D1CE4E5B9ULL
#define MIX2 0x94D049BB133111EBULL
#define SALT 0xD6E8FEB86659FD93ULL
/* Rows and index positions a batch reaches are scattered over tables of millions: each is a cache miss.  The loops
 * below ask for the memory AHEAD ids on while they work on this one, so the misses overlap (same results). */
#define AHEAD 8
#if defined(__GNUC__)
#define PREFETCH(addr, write) __builtin_prefetch((addr), (write), 1)
#else
#define PREFETCH(addr, write) ((void)(addr))
#endif

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * MIX1;
    z = (z ^ (z >> 27)) * MIX2;
    return z ^ (z >> 31);
}

/* A buffer argument of at least `count` items of `itemsize` bytes (C-contiguous), writable if asked. */
static int take(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t count, int writable,
                const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->len < itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, %zd needed", name, view->len, itemsize * count);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Where `id` sits (*found, else -1) and, if absent, the empty position its probe ended at (*empty, else -1):
 * linear probing from mix64(id ^ SALT) & mask past tombstones. */
static inline void probe_one(const int64_t *keys, const int8_t *st, uint64_t mask, int64_t id, int64_t *found,
                             int64_t *empty) {
    uint64_t p = mix64((uint64_t)id ^ SALT) & mask;
    *found = *empty = -1;
    for (uint64_t step = 0; step <= mask; step++, p = (p + 1) & mask) {
        if (st[p] == EMPTY) { *empty = (int64_t)p; return; }
        if (st[p] == FULL && keys[p] == id) { *found = (int64_t)p; return; }
    }
}

/* probe(keys, state, mask, ids, pos_out, empty_out or None): where each id sits (-1: absent) and, for an absent
 * id, the empty position its probe ended at -- linear probing from mix64(id ^ SALT) & mask past tombstones. */
static PyObject *probe(PyObject *self, PyObject *args) {
    PyObject *okeys, *ostate, *oids, *opos, *oempty;
    long long mask;
    if (!PyArg_ParseTuple(args, "OOLOOO", &okeys, &ostate, &mask, &oids, &opos, &oempty))
        return NULL;
    Py_buffer keys, state, ids, pos, empty;
    if (mask < 0 || mask >= PY_SSIZE_T_MAX / 8)
        return PyErr_Format(PyExc_ValueError, "mask is %lld, out of range", mask);
    Py_ssize_t cap = mask + 1;
    if (take(okeys, &keys, 8, cap, 0, "keys") < 0)
        return NULL;
    if (take(ostate, &state, 1, cap, 0, "state") < 0)
        goto fail_keys;
    if (take(oids, &ids, 8, 0, 0, "ids") < 0)
        goto fail_state;
    Py_ssize_t n = ids.len / 8;
    if (take(opos, &pos, 8, n, 1, "pos_out") < 0)
        goto fail_ids;
    int with_empty = oempty != Py_None;
    if (with_empty && take(oempty, &empty, 8, n, 1, "empty_out") < 0)
        goto fail_pos;
    const int64_t *k = keys.buf, *id = ids.buf;
    const int8_t *st = state.buf;
    int64_t *out = pos.buf, *emp = with_empty ? empty.buf : NULL;
    uint64_t m = (uint64_t)mask;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t found, at;
        probe_one(k, st, m, id[i], &found, &at);
        out[i] = found;
        if (emp) emp[i] = found >= 0 ? -1 : at;
    }
    Py_END_ALLOW_THREADS
    if (with_empty) PyBuffer_Release(&empty);
    PyBuffer_Release(&pos); PyBuffer_Release(&ids); PyBuffer_Release(&state); PyBuffer_Release(&keys);
    Py_RETURN_NONE;
fail_pos: PyBuffer_Release(&pos);
fail_ids: PyBuffer_Release(&ids);
fail_state: PyBuffer_Release(&state);
fail_keys: PyBuffer_Release(&keys);
    return NULL;
}

/* place_at(keys, slots, state, claim, ids, new_slots, at, losers_out) -> losers: each id (absent, unique) put at
 * at[i], the empty position where its probe ended in the unchanged index.  Of ids sharing a position the last one
 * wins, as numpy's fancy assignment decides (IdIndex._place_at); the others' indices go to losers_out, for the
 * caller's general insert. */
static PyObject *place_at(PyObject *self, PyObject *args) {
    PyObject *okeys, *oslots, *ostate, *oclaim, *oids, *onew, *oat, *olosers;
    if (!PyArg_ParseTuple(args, "OOOOOOOO", &okeys, &oslots, &ostate, &oclaim, &oids, &onew, &oat, &olosers))
        return NULL;
    Py_buffer keys, slots, state, claim, ids, nw, at, losers;
    if (take(ostate, &state, 1, 0, 1, "state") < 0)
        return NULL;
    Py_ssize_t cap = state.len, bad = 0, lost = 0;
    if (take(okeys, &keys, 8, cap, 1, "keys") < 0)
        goto fail_state;
    if (take(oslots, &slots, 8, cap, 1, "slots") < 0)
        goto fail_keys;
    if (take(oclaim, &claim, 4, cap, 1, "claim") < 0)
        goto fail_slots;
    if (take(oids, &ids, 8, 0, 0, "ids") < 0)
        goto fail_claim;
    Py_ssize_t n = ids.len / 8;
    if (take(onew, &nw, 8, n, 0, "new_slots") < 0)
        goto fail_ids;
    if (take(oat, &at, 8, n, 0, "at") < 0)
        goto fail_new;
    if (take(olosers, &losers, 8, n, 1, "losers_out") < 0)
        goto fail_at;
    int64_t *k = keys.buf, *sl = slots.buf, *lose = losers.buf;
    int32_t *cl = claim.buf;
    int8_t *st = state.buf;
    const int64_t *id = ids.buf, *ns = nw.buf, *where = at.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (where[i] < 0 || where[i] >= cap) bad++;
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            cl[where[i]] = (int32_t)i;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t p = where[i];
            if (cl[p] != (int32_t)i) { lose[lost++] = i; continue; }
            k[p] = id[i]; sl[p] = ns[i]; st[p] = FULL;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&losers); PyBuffer_Release(&at); PyBuffer_Release(&nw); PyBuffer_Release(&ids);
    PyBuffer_Release(&claim); PyBuffer_Release(&slots); PyBuffer_Release(&keys); PyBuffer_Release(&state);
    if (bad)
        return PyErr_Format(PyExc_ValueError, "at holds %zd positions outside the table of %zd", bad, cap);
    return PyLong_FromSsize_t(lost);
fail_at: PyBuffer_Release(&at);
fail_new: PyBuffer_Release(&nw);
fail_ids: PyBuffer_Release(&ids);
fail_claim: PyBuffer_Release(&claim);
fail_slots: PyBuffer_Release(&slots);
fail_keys: PyBuffer_Release(&keys);
fail_state: PyBuffer_Release(&state);
    return NULL;
}

/* One id's uniform row: uniform()'s values. */
static inline void init_uniform(uint64_t key, int64_t id, Py_ssize_t dim, float fa, float *o) {
    uint64_t s = mix64(((uint64_t)id ^ key) + GAMMA);
    for (Py_ssize_t j = 0; j < dim; j++) {
        uint64_t bits = mix64(s + (uint64_t)(j + 1) * GAMMA);
        o[j] = ((float)(bits >> 40) * 0x1p-23f - 1.0f) * fa;  /* exact until the multiplication by fa */
    }
}

/* uniform(key, ids, dim, scale, out): out[i, j] = (float(bits >> 40) * 2**-23 - 1) * float(scale) in float32, with
 * bits = mix64(mix64((id ^ key) + GAMMA) + (j + 1) * GAMMA) -- psserver.protocol.rows.init's formula. */
static PyObject *uniform(PyObject *self, PyObject *args) {
    PyObject *oids, *oout;
    unsigned long long key;
    Py_ssize_t dim;
    double scale;
    if (!PyArg_ParseTuple(args, "KOndO", &key, &oids, &dim, &scale, &oout))
        return NULL;
    if (dim < 1)
        return PyErr_Format(PyExc_ValueError, "dim is %zd, it must be at least 1", dim);
    Py_buffer ids, out;
    if (take(oids, &ids, 8, 0, 0, "ids") < 0)
        return NULL;
    Py_ssize_t n = ids.len / 8;
    if (take(oout, &out, 4, n * dim, 1, "out") < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    const int64_t *id = ids.buf;
    float *o = out.buf;
    const float fa = (float)scale;  /* what torch multiplies a float32 tensor by: the scalar as float32 */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        init_uniform(key, id[i], dim, fa, o + i * dim);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    PyBuffer_Release(&ids);
    Py_RETURN_NONE;
}

/* The fused calls: a table's lookup and its push's gather and scatter over the slots of its rows (RowSpace), each
 * one loop where the general path makes a dozen whole-array calls (psserver.protocol.rows.space.RowSpace.fused_*).
 * Only bytes move here and the uniform initialiser's values are uniform()'s: the optimizer's arithmetic stays
 * torch's, so the results are the general path's bit for bit (tests/unit/test_row_kernel.py). */


/* lookup_rows(keys, islots, istate, claim, mask, ids, sp_ids, rows, state, last_tick, last_version, used, dim, width,
 *             seed_key, scale, state_value, tick, version, slots_out, rows_out, losers_out) -> (created, lost)
 * RowStore.lookup's resolve, create, touch and gather for unique ids, where the caller checked that the new rows fit
 * in the slots from `used` on (no free slot to reuse, no growth, no eviction, no index rebuild) and the index is not
 * empty: found ids keep their slot; absent ones get slots used, used+1, ... in order, their ids, uniform rows and
 * state (every float `state_value`), and the empty index position their probe ended at -- of ids ending at one
 * position the last wins, as place_at; the others' indices (into ids) go to losers_out for the general insert.
 * Every slot is marked used at (tick, version); rows_out gets each id's row. */
static PyObject *lookup_rows(PyObject *self, PyObject *args) {
    PyObject *o[22];
    long long mask, used, tick, version;
    Py_ssize_t dim, width;
    unsigned long long key;
    double scale, state_value;
    if (!PyArg_ParseTuple(args, "OOOOLOOOOOOLnnKddLLOOO", &o[0], &o[1], &o[2], &o[3], &mask, &o[5], &o[6], &o[7],
                          &o[8], &o[9], &o[10], &used, &dim, &width, &key, &scale, &state_value, &tick, &version,
                          &o[19], &o[20], &o[21]))
        return NULL;
    Py_buffer b[22];
    int held[22] = {0};
    PyObject *result = NULL;
    int64_t *at = NULL;
    if (mask < 0 || mask >= PY_SSIZE_T_MAX / 8 || dim < 1 || width < 0 || used < 0) {
        PyErr_SetString(PyExc_ValueError, "mask, dim, width and used must not be negative (dim at least 1)");
        return NULL;
    }
    Py_ssize_t cap = mask + 1;
#define TAKE(i, size, count, w, name) \
    do { if (take(o[i], &b[i], size, count, w, name) < 0) goto done; held[i] = 1; } while (0)
    TAKE(5, 8, 0, 0, "ids");
    Py_ssize_t n = b[5].len / 8;
    TAKE(0, 8, cap, 1, "keys");
    TAKE(1, 8, cap, 1, "islots");
    TAKE(2, 1, cap, 1, "istate");
    TAKE(3, 4, cap, 1, "claim");
    TAKE(6, 8, 0, 1, "sp_ids");
    Py_ssize_t slots_cap = b[6].len / 8;
    TAKE(7, 4, slots_cap * dim, 1, "rows");
    TAKE(8, 4, slots_cap * width, 1, "state");
    TAKE(9, 8, slots_cap, 1, "last_tick");
    TAKE(10, 8, slots_cap, 1, "last_version");
    TAKE(19, 8, n, 1, "slots_out");
    TAKE(20, 4, n * dim, 1, "rows_out");
    TAKE(21, 8, n, 1, "losers_out");
#undef TAKE
    if (used + n > slots_cap) {
        PyErr_Format(PyExc_ValueError, "%zd new rows from slot %lld do not fit %zd slots", n, used, slots_cap);
        goto done;
    }
    at = PyMem_Malloc((n ? n : 1) * 2 * sizeof(int64_t));
    if (at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *which = at + n;  /* the index into ids of each new row */
    int64_t *keys = b[0].buf, *islots = b[1].buf, *sp_ids = b[6].buf, *lt = b[9].buf, *lv = b[10].buf;
    int64_t *out = b[19].buf, *lose = b[21].buf;
    const int64_t *id = b[5].buf;
    int8_t *st = b[2].buf;
    int32_t *cl = b[3].buf;
    float *rows = b[7].buf, *state = b[8].buf, *rows_out = b[20].buf;
    uint64_t m = (uint64_t)mask;
    Py_ssize_t created = 0, lost = 0, bad = 0;
    const float fa = (float)scale, sv = (float)state_value;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {  /* the probe, on the index as it was */
        if (i + AHEAD < n) {
            uint64_t home = mix64((uint64_t)id[i + AHEAD] ^ SALT) & m;
            PREFETCH(st + home, 0); PREFETCH(keys + home, 0); PREFETCH(islots + home, 0);
        }
        int64_t found, empty;
        probe_one(keys, st, m, id[i], &found, &empty);
        if (found >= 0) {
            found = islots[found];
            if (found < 0 || found >= slots_cap) bad++;
            out[i] = found;
        } else {
            at[created] = empty;
            which[created++] = i;
            out[i] = used + created - 1;
        }
    }
    if (!bad) {
        for (Py_ssize_t j = 0; j < created; j++) {  /* the new rows */
            int64_t s = used + j, i = which[j];
            sp_ids[s] = id[i];
            init_uniform(key, id[i], dim, fa, rows + s * dim);
            for (Py_ssize_t k = 0; k < width; k++)
                state[s * width + k] = sv;
        }
        for (Py_ssize_t j = 0; j < created; j++)  /* their index positions: the last claimant wins */
            if (at[j] >= 0) cl[at[j]] = (int32_t)j;
        for (Py_ssize_t j = 0; j < created; j++) {
            int64_t p = at[j];
            if (p < 0 || cl[p] != (int32_t)j) { lose[lost++] = which[j]; continue; }
            keys[p] = id[which[j]]; islots[p] = used + j; st[p] = FULL;
        }
        for (Py_ssize_t i = 0; i < n; i++) {  /* touched now, and read out */
            if (i + AHEAD < n) {
                int64_t next = out[i + AHEAD];
                PREFETCH(lt + next, 1); PREFETCH(lv + next, 1); PREFETCH(rows + next * dim, 0);
            }
            int64_t s = out[i];
            lt[s] = tick; lv[s] = version;
            memcpy(rows_out + i * dim, rows + s * dim, dim * sizeof(float));
        }
    }
    Py_END_ALLOW_THREADS
    if (bad)
        PyErr_Format(PyExc_ValueError, "the index holds %zd slots past the %zd slots", bad, slots_cap);
    else
        result = Py_BuildValue("nn", created, lost);
done:
    PyMem_Free(at);
    for (int i = 0; i < 22; i++)
        if (held[i]) PyBuffer_Release(&b[i]);
    return result;
}

/* The slots a call names, copied while the GIL is held and checked on the copy: the loops that run without the GIL
 * read only this copy, so no other thread can change a slot between its check and its use.  NULL with an error
 * set (no memory); *bad_at: the index of the first slot outside [0, cap), or -1 where none is. */
static int64_t *own_slots(const int64_t *slots, Py_ssize_t n, Py_ssize_t cap, Py_ssize_t *bad_at) {
    int64_t *copy = PyMem_Malloc((n ? n : 1) * sizeof(int64_t));
    if (copy == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (n) memcpy(copy, slots, n * sizeof(int64_t));
    *bad_at = -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (copy[i] < 0 || copy[i] >= cap) { *bad_at = i; break; }
    return copy;
}

/* gather_rows(rows, state, slots, grads, last_tick, last_version, tick, version, dim, width, rows_out, state_out,
 *             grads_out, padded) -> bool
 * A push's UpdateScratch.gather after its resolve's touch: the rows and state at `slots` and the gradients into the
 * first n of `padded` rows of each buffer, the rest zeros; every slot marked used at (tick, version).  False, with
 * nothing written, where a slot is not one of the table's (then the general path runs). */
static PyObject *gather_rows(PyObject *self, PyObject *args) {
    PyObject *o[13];
    long long tick, version;
    Py_ssize_t dim, width, padded;
    if (!PyArg_ParseTuple(args, "OOOOOOLLnnOOOn", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &tick, &version, &dim,
                          &width, &o[10], &o[11], &o[12], &padded))
        return NULL;
    Py_buffer b[13];
    int held[13] = {0};
    PyObject *result = NULL;
    int64_t *sl = NULL;
    if (dim < 1 || width < 0 || padded < 0) {
        PyErr_SetString(PyExc_ValueError, "dim must be at least 1, width and padded not negative");
        return NULL;
    }
#define TAKE(i, size, count, w, name) \
    do { if (take(o[i], &b[i], size, count, w, name) < 0) goto done; held[i] = 1; } while (0)
    TAKE(4, 8, 0, 1, "last_tick");
    Py_ssize_t cap = b[4].len / 8;
    TAKE(2, 8, 0, 0, "slots");
    Py_ssize_t n = b[2].len / 8;
    if (padded < n) {
        PyErr_Format(PyExc_ValueError, "padded (%zd) is under the %zd slots", padded, n);
        goto done;
    }
    TAKE(0, 4, cap * dim, 0, "rows");
    TAKE(1, 4, cap * width, 0, "state");
    TAKE(3, 4, n * dim, 0, "grads");
    TAKE(5, 8, cap, 1, "last_version");
    TAKE(10, 4, padded * dim, 1, "rows_out");
    TAKE(11, 4, padded * width, 1, "state_out");
    TAKE(12, 4, padded * dim, 1, "grads_out");
#undef TAKE
    Py_ssize_t outside;
    sl = own_slots(b[2].buf, n, cap, &outside);
    if (sl == NULL)
        goto done;
    if (outside != -1) {
        result = Py_False;
        Py_INCREF(result);
        goto done;
    }
    const float *rows = b[0].buf, *state = b[1].buf, *grads = b[3].buf;
    float *ro = b[10].buf, *so = b[11].buf, *go = b[12].buf;
    int64_t *lt = b[4].buf, *lv = b[5].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            int64_t next = sl[i + AHEAD];
            PREFETCH(lt + next, 1); PREFETCH(lv + next, 1); PREFETCH(rows + next * dim, 0);
            if (width) PREFETCH(state + next * width, 0);
        }
        int64_t s = sl[i];
        lt[s] = tick; lv[s] = version;
        memcpy(ro + i * dim, rows + s * dim, dim * sizeof(float));
        if (width) memcpy(so + i * width, state + s * width, width * sizeof(float));
    }
    memcpy(go, grads, n * dim * sizeof(float));
    memset(ro + n * dim, 0, (padded - n) * dim * sizeof(float));
    memset(go + n * dim, 0, (padded - n) * dim * sizeof(float));
    if (width) memset(so + n * width, 0, (padded - n) * width * sizeof(float));
    Py_END_ALLOW_THREADS
    result = Py_True;
    Py_INCREF(result);
done:
    PyMem_Free(sl);
    for (int i = 0; i < 13; i++)
        if (held[i]) PyBuffer_Release(&b[i]);
    return result;
}

/* scatter_rows(rows, state, slots, rows_in, state_in, dim, width): rows and state back at `slots` (index_copy_),
 * the first n rows of each buffer.  The slots are gather_rows' (checked there). */
static PyObject *scatter_rows(PyObject *self, PyObject *args) {
    PyObject *o[5];
    Py_ssize_t dim, width;
    if (!PyArg_ParseTuple(args, "OOOOOnn", &o[0], &o[1], &o[2], &o[3], &o[4], &dim, &width))
        return NULL;
    Py_buffer b[5];
    int held[5] = {0};
    PyObject *result = NULL;
    int64_t *sl = NULL;
    if (dim < 1 || width < 0) {
        PyErr_SetString(PyExc_ValueError, "dim must be at least 1 and width not negative");
        return NULL;
    }
#define TAKE(i, size, count, w, name) \
    do { if (take(o[i], &b[i], size, count, w, name) < 0) goto done; held[i] = 1; } while (0)
    TAKE(0, 4, 0, 1, "rows");
    Py_ssize_t cap = b[0].len / 4 / dim;
    TAKE(1, 4, cap * width, 1, "state");
    TAKE(2, 8, 0, 0, "slots");
    Py_ssize_t n = b[2].len / 8;
    TAKE(3, 4, n * dim, 0, "rows_in");
    TAKE(4, 4, n * width, 0, "state_in");
#undef TAKE
    Py_ssize_t outside;
    sl = own_slots(b[2].buf, n, cap, &outside);
    if (sl == NULL)
        goto done;
    if (outside != -1) {
        PyErr_Format(PyExc_ValueError, "slot %lld is outside the %zd slots", (long long)sl[outside], cap);
        goto done;
    }
    float *rows = b[0].buf, *state = b[1].buf;
    const float *ri = b[3].buf, *si = b[4].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            PREFETCH(rows + sl[i + AHEAD] * dim, 1);
            if (width) PREFETCH(state + sl[i + AHEAD] * width, 1);
        }
        memcpy(rows + sl[i] * dim, ri + i * dim, dim * sizeof(float));
        if (width) memcpy(state + sl[i] * width, si + i * width, width * sizeof(float));
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(sl);
    for (int i = 0; i < 5; i++)
        if (held[i]) PyBuffer_Release(&b[i]);
    return result;
}

/* unpack_ids(raw, max_ids) -> a bytearray of int64 ids, or None: idpack.unpack's decoding of varint gaps in one pass.
 * None -- where the bytes are malformed in any way idpack.unpack refuses (a truncated or overlong varint, a gap
 * of 0, past max_ids) -- sends the caller to numpy's path, which names what is wrong. */
static PyObject *unpack_ids(PyObject *self, PyObject *args) {
    Py_buffer raw;
    Py_ssize_t max_ids;
    if (!PyArg_ParseTuple(args, "y*n", &raw, &max_ids))
        return NULL;
    const uint8_t *b = raw.buf;
    Py_ssize_t len = raw.len, n = 0;
    for (Py_ssize_t i = 0; i < len; i++)
        n += b[i] < 0x80;
    if (n > max_ids || (len && b[len - 1] >= 0x80)) {
        PyBuffer_Release(&raw);
        Py_RETURN_NONE;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * 8);  /* (writable: a tensor's storage as it is) */
    if (out == NULL) {
        PyBuffer_Release(&raw);
        return NULL;
    }
    uint64_t *ids = (uint64_t *)PyByteArray_AS_STRING(out), acc = 0;
    int bad = 0;
    Py_ssize_t k = 0, i = 0;
    while (i < len && !bad) {
        uint64_t value = 0;
        int shift = 0;
        for (;;) {
            uint8_t byte = b[i++];
            if (shift == 63 && byte > 1) { bad = 1; break; }  /* past 64 bits */
            value |= (uint64_t)(byte & 0x7F) << shift;
            if (byte < 0x80) break;
            shift += 7;
            if (shift > 63) { bad = 1; break; }  /* a varint of more than 10 bytes */
        }
        if (bad) break;
        if (k && value == 0) { bad = 1; break; }  /* a gap of 0: a repeat */
        acc += value;
        ids[k++] = acc;
    }
    PyBuffer_Release(&raw);
    if (bad) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

/* pack_ids(ids) -> bytes, or None: idpack.pack's varint gaps of int64 ids in one pass; None where they are not
 * strictly ascending (numpy's path refuses them). */
static PyObject *pack_ids(PyObject *self, PyObject *args) {
    PyObject *oids;
    if (!PyArg_ParseTuple(args, "O", &oids))
        return NULL;
    Py_buffer ids;
    if (take(oids, &ids, 8, 0, 0, "ids") < 0)
        return NULL;
    const int64_t *id = ids.buf;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 1; i < n; i++)
        if (id[i] <= id[i - 1]) {
            PyBuffer_Release(&ids);
            Py_RETURN_NONE;
        }
    uint8_t *buf = PyMem_Malloc(n ? n * 10 : 1);
    if (buf == NULL) {
        PyBuffer_Release(&ids);
        return PyErr_NoMemory();
    }
    Py_ssize_t at = 0;
    uint64_t prev = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v = (uint64_t)id[i] - prev;  /* the first id as itself; then gaps, mod 2^64 */
        prev = (uint64_t)id[i];
        while (v >= 0x80) {
            buf[at++] = (uint8_t)((v & 0x7F) | 0x80);
            v >>= 7;
        }
        buf[at++] = (uint8_t)v;
    }
    PyBuffer_Release(&ids);
    PyObject *out = PyBytes_FromStringAndSize((const char *)buf, at);
    PyMem_Free(buf);
    return out;
}

static PyMethodDef methods[] = {
    {"probe", probe, METH_VARARGS, "probe(keys, state, mask, ids, pos_out, empty_out or None)"},
    {"place_at", place_at, METH_VARARGS, "place_at(keys, slots, state, claim, ids, new_slots, at, losers_out) -> losers"},
    {"uniform", uniform, METH_VARARGS, "uniform(key, ids, dim, scale, out)"},
    {"lookup_rows", lookup_rows, METH_VARARGS, "a lookup's resolve, create, touch and gather (see _kernel.c)"},
    {"gather_rows", gather_rows, METH_VARARGS, "a push's touch and gather into its scratch (see _kernel.c)"},
    {"unpack_ids", unpack_ids, METH_VARARGS, "unpack_ids(raw, max_ids) -> bytearray of int64 ids, or None"},
    {"pack_ids", pack_ids, METH_VARARGS, "pack_ids(ids) -> bytes, or None"},
    {"scatter_rows", scatter_rows, METH_VARARGS, "a push's rows and state back at their slots (see _kernel.c)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernel", "The table kernel's loops (see _kernel.c).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__kernel(void) { return PyModule_Create(&module); }
