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

#define EMPTY 0
#define FULL 1
#define GAMMA 0x9E3779B97F4A7C15ULL
#define MIX1 0xBF58476D1CE4E5B9ULL
#define MIX2 0x94D049BB133111EBULL
#define SALT 0xD6E8FEB86659FD93ULL

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

/* probe(keys, state, mask, ids, pos_out, empty_out or None): where each id sits (-1: absent) and, for an absent
 * id, the empty position its probe ended at -- linear probing from mix64(id ^ SALT) & mask past tombstones. */
static PyObject *probe(PyObject *self, PyObject *args) {
    PyObject *okeys, *ostate, *oids, *opos, *oempty;
    long long mask;
    if (!PyArg_ParseTuple(args, "OOLOOO", &okeys, &ostate, &mask, &oids, &opos, &oempty))
        return NULL;
    Py_buffer keys, state, ids, pos, empty;
    Py_ssize_t cap = mask + 1;
    if (mask < 0 || take(okeys, &keys, 8, cap, 0, "keys") < 0)
        return mask < 0 ? PyErr_Format(PyExc_ValueError, "mask is negative") : NULL;
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
        uint64_t p = mix64((uint64_t)id[i] ^ SALT) & m;
        int64_t found = -1, at = -1;
        for (Py_ssize_t step = 0; step < cap; step++, p = (p + 1) & m) {
            if (st[p] == EMPTY) { at = (int64_t)p; break; }
            if (st[p] == FULL && k[p] == id[i]) { found = (int64_t)p; break; }
        }
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
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t s = mix64(((uint64_t)id[i] ^ key) + GAMMA);
        for (Py_ssize_t j = 0; j < dim; j++) {
            uint64_t bits = mix64(s + (uint64_t)(j + 1) * GAMMA);
            float x = (float)(bits >> 40) * 0x1p-23f - 1.0f;  /* exact */
            o[i * dim + j] = x * fa;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    PyBuffer_Release(&ids);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"probe", probe, METH_VARARGS, "probe(keys, state, mask, ids, pos_out, empty_out or None)"},
    {"place_at", place_at, METH_VARARGS, "place_at(keys, slots, state, claim, ids, new_slots, at, losers_out) -> losers"},
    {"uniform", uniform, METH_VARARGS, "uniform(key, ids, dim, scale, out)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernel", "The table kernel's loops (see _kernel.c).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__kernel(void) { return PyModule_Create(&module); }
