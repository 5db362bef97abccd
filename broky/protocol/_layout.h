/* The canonical Message layout on the C side, for the compiled twins
 * (broky/server/shard/_feedscan.c, broky/client/_pubpack.c, broky/spark/_readcols.c).
 *
 * Nothing here spells a byte position: layout_load reads each one the twins
 * use by name from broky.protocol.layout, the layout's one owner, when a twin
 * is configured at import (broky.server.shard.fastpath, broky.client.pubpack,
 * broky.spark.readcols), into
 * a Layout the twin keeps in a static variable. What a twin does with a frame
 * (the fixed header compared, ts_broker stamped, the uoffsets and the uid
 * read or written, the vectors laid out one after the other as
 * broky.protocol.layout.shape lays them out) follows from those positions, so
 * a layout change is made in layout.py alone. layout_load refuses positions a
 * twin could not use safely (every field at a fixed position lies before the
 * vectors); layout_as_dict gives them back, and a test holds them to the owner.
 *
 * Included by every twin: everything is static.
 */
#ifndef BROKY_LAYOUT_H
#define BROKY_LAYOUT_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <string.h>

#define LAYOUT_MAX_HEADER 128 /* bytes of fixed header a twin can hold */
#define LAYOUT_MAX_FIXED 256  /* bytes at fixed positions (FIXED_SIZE) a twin can hold */
#define LAYOUT_UID_SIZE 20    /* the schema's Ksuid (broky.protocol.ksuid.SIZE) */

/* Positions from f, the frame's first byte (the size prefix's); [2]: [has_uid]. */
typedef struct {
    Py_ssize_t header_at, header_size;
    unsigned char header_uid[LAYOUT_MAX_HEADER], header_no_uid[LAYOUT_MAX_HEADER];
    Py_ssize_t ts_producer_at, ts_broker_at;
    Py_ssize_t epoch_at, offset_at, vbucket_at; /* the position, stamped by the server */
    Py_ssize_t key_uoffset_at, payload_uoffset_at;
    Py_ssize_t uid_at;
    Py_ssize_t vectors_at[2]; /* the key_partition vector's length word */
    Py_ssize_t fixed_size[2]; /* bytes at fixed positions: through that length word */
} Layout;

static int
layout_int(PyObject *owner, const char *name, Py_ssize_t *out)
{
    PyObject *v = PyObject_GetAttrString(owner, name);
    if (v == NULL) {
        return -1;
    }
    *out = PyLong_Check(v) ? PyLong_AsSsize_t(v) : -1;
    Py_DECREF(v);
    if (*out < 0 || *out > LAYOUT_MAX_FIXED) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "layout.%s must be a position (an int from 0 to %d)", name, LAYOUT_MAX_FIXED);
        return -1;
    }
    return 0;
}

static int
layout_pair(PyObject *owner, const char *name, Py_ssize_t out[2])
{
    PyObject *v = PyObject_GetAttrString(owner, name);
    if (v == NULL) {
        return -1;
    }
    int ok = PyTuple_Check(v) && PyTuple_GET_SIZE(v) == 2;
    for (int i = 0; ok && i < 2; i++) {
        PyObject *item = PyTuple_GET_ITEM(v, i);
        out[i] = PyLong_Check(item) ? PyLong_AsSsize_t(item) : -1;
        ok = out[i] >= 0 && out[i] <= LAYOUT_MAX_FIXED;
    }
    Py_DECREF(v);
    if (!ok) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "layout.%s must be two positions (without, with a uid)", name);
        return -1;
    }
    return 0;
}

static int
layout_bytes(PyObject *owner, const char *name, unsigned char *out, Py_ssize_t *len)
{
    PyObject *v = PyObject_GetAttrString(owner, name);
    if (v == NULL) {
        return -1;
    }
    int ok = PyBytes_Check(v) && PyBytes_GET_SIZE(v) <= LAYOUT_MAX_HEADER;
    if (ok) {
        *len = PyBytes_GET_SIZE(v);
        memcpy(out, PyBytes_AS_STRING(v), (size_t)*len);
    }
    Py_DECREF(v);
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "layout.%s must be bytes, at most %d of them", name, LAYOUT_MAX_HEADER);
        return -1;
    }
    return 0;
}

/* Fill *l from the owner (broky.protocol.layout, or anything with its names).
 * 0, or -1 with an exception set and *l unusable. */
static int
layout_load(PyObject *owner, Layout *l)
{
    Py_ssize_t uid_len, no_uid_len, header_end;
    if (layout_int(owner, "HEADER_AT", &l->header_at) < 0 || layout_int(owner, "HEADER_END", &header_end) < 0
        || layout_bytes(owner, "HEADER_UID", l->header_uid, &uid_len) < 0
        || layout_bytes(owner, "HEADER_NO_UID", l->header_no_uid, &no_uid_len) < 0
        || layout_int(owner, "TS_PRODUCER_AT", &l->ts_producer_at) < 0
        || layout_int(owner, "TS_BROKER_AT", &l->ts_broker_at) < 0
        || layout_int(owner, "EPOCH_AT", &l->epoch_at) < 0 || layout_int(owner, "OFFSET_AT", &l->offset_at) < 0
        || layout_int(owner, "VBUCKET_AT", &l->vbucket_at) < 0
        || layout_int(owner, "KEY_UOFFSET_AT", &l->key_uoffset_at) < 0
        || layout_int(owner, "PAYLOAD_UOFFSET_AT", &l->payload_uoffset_at) < 0
        || layout_int(owner, "UID_AT", &l->uid_at) < 0
        || layout_pair(owner, "VECTORS_AT", l->vectors_at) < 0
        || layout_pair(owner, "FIXED_SIZE", l->fixed_size) < 0) {
        return -1;
    }
    l->header_size = header_end - l->header_at;
    Py_ssize_t plain = l->vectors_at[0];
    /* What the twins rely on: a frame has at least its vectors' three length words
     * after VECTORS_AT (the shape checks see to it), so every field at a fixed
     * position lies inside it when it lies before the vectors. */
    const char *wrong = NULL;
    if (l->header_at < 4 || l->header_size < 16 || uid_len != l->header_size || no_uid_len != l->header_size) {
        wrong = "the fixed header lies after the size prefix and is HEADER_END - HEADER_AT >= 16 bytes";
    } else if (l->header_at + l->header_size > plain || l->ts_producer_at + 8 > plain
               || l->ts_broker_at + 8 > plain || l->epoch_at + 8 > plain || l->offset_at + 8 > plain
               || l->vbucket_at + 2 > plain || l->key_uoffset_at + 4 > plain
               || l->payload_uoffset_at + 4 > plain) {
        wrong = "every field at a fixed position lies before the vectors";
    } else if (l->uid_at + LAYOUT_UID_SIZE > l->vectors_at[1]) {
        wrong = "the 20-byte uid lies before the vectors of a frame with a uid";
    } else if (plain > l->vectors_at[1] || l->fixed_size[0] < plain + 4 || l->fixed_size[1] < l->vectors_at[1] + 4
               || l->fixed_size[0] > LAYOUT_MAX_FIXED || l->fixed_size[1] > LAYOUT_MAX_FIXED) {
        wrong = "FIXED_SIZE runs through the key_partition's length word (at most 256 bytes)";
    }
    if (wrong != NULL) {
        PyErr_Format(PyExc_ValueError, "configure: this layout does not fit the compiled twin: %s", wrong);
        return -1;
    }
    return 0;
}

/* The layout as a dict of the owner's names (what layout_load read). */
static PyObject *
layout_as_dict(const Layout *l)
{
    return Py_BuildValue(
        "{s:n,s:n,s:y#,s:y#,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:(nn),s:(nn)}", "HEADER_AT", l->header_at, "HEADER_END",
        l->header_at + l->header_size, "HEADER_UID", (const char *)l->header_uid, l->header_size, "HEADER_NO_UID",
        (const char *)l->header_no_uid, l->header_size, "TS_PRODUCER_AT", l->ts_producer_at, "TS_BROKER_AT",
        l->ts_broker_at, "EPOCH_AT", l->epoch_at, "OFFSET_AT", l->offset_at, "VBUCKET_AT", l->vbucket_at,
        "KEY_UOFFSET_AT", l->key_uoffset_at, "PAYLOAD_UOFFSET_AT", l->payload_uoffset_at, "UID_AT",
        l->uid_at, "VECTORS_AT", l->vectors_at[0], l->vectors_at[1], "FIXED_SIZE", l->fixed_size[0],
        l->fixed_size[1]);
}

#endif
