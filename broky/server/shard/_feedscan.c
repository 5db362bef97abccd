/* The compiled twin of the fan-out fast path (broky.server.shard.core, Shard.feed).
 *
 * scan() walks a read from `pos` over consecutive Message frames in the
 * canonical layout (broky.protocol.message) whose route is in the route cache,
 * and does for each exactly what the pure-Python loop of Shard.feed does:
 * check the frame's shape and the key's and payload's bounds, look the routing
 * bytes (key_partition and key vectors) up in the cache (a route is the
 * targets and the vbucket), give the message its vbucket's next offset (the
 * sequences: 1024 x (epoch, next offset, last and first stamp), broky.server.shard.sequences), count a
 * message that matches nobody, stamp ts_broker and the position into the copy
 * of the read, record it in the replay buffer when there is one
 * (broky.server.shard.replay: its index entry and vbucket, 16 bytes appended to the
 * log; or the entry straight to its vbucket's index while the log is empty and
 * the call's messages so far are all of that vbucket), and group consecutive
 * messages with the same targets into runs.
 * It stops, leaving the
 * frame at the returned position to the Python code, at anything else: a
 * frame of another kind or layout, a shape or bound the checks refuse, a route
 * not in the cache or not owned here, an incomplete frame. So the Python code
 * stays the reference and handles every rare case; tests/server/unit/test_server_feed_twin.py
 * holds this twin to it (same bytes in, same deliveries, drops and errors out).
 *
 * note() is the compiled twin of Lag.missed's loop (broky.server.shard.lag): it notes
 * the offsets a lagging connection was refused, per vbucket, as ranges
 * (tests/server/unit/test_server_lag.py holds it to the Python loop).
 *
 * settle() is the compiled twin of ReplayBuffer.settle's loop: it moves the
 * log's entries into their vbuckets' indexes (tests/server/unit/test_server_replay.py holds
 * it to the Python loop).
 *
 * It does no I/O and keeps no state between calls: the layout (the headers it
 * compares against, the positions it reads and stamps) is handed over once by
 * configure(), from its one owner, broky.protocol.layout (see
 * broky/protocol/_layout.h); layout() gives it back.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../../protocol/_layout.h"

#define FEEDSCAN_VERSION 8
#define VBUCKETS 1024
#define SEQ_ENTRY 32 /* broky.server.shard.sequences.ENTRY_BYTES: epoch, next offset, last and first stamp */

static Layout layout;
static int configured = 0;
static uint64_t min_frame = 0;

static inline uint64_t
u32_at(const unsigned char *p)
{
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 24);
}

static inline void
put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static inline uint64_t
u64_at(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

static PyObject *
configure(PyObject *module, PyObject *args)
{
    PyObject *owner;
    unsigned long long min;
    Layout l;
    if (!PyArg_ParseTuple(args, "OK", &owner, &min) || layout_load(owner, &l) < 0) {
        return NULL;
    }
    layout = l;
    min_frame = min;
    configured = 1;
    Py_RETURN_NONE;
}

static PyObject *
layout_of(PyObject *module, PyObject *unused)
{
    if (!configured) {
        Py_RETURN_NONE;
    }
    return layout_as_dict(&layout);
}

/* Append one run (targets, start, end, count) to the list `runs`. */
static int
add_run(PyObject *runs, PyObject *targets, Py_ssize_t start, Py_ssize_t end, Py_ssize_t count)
{
    PyObject *run = Py_BuildValue("(Onnn)", targets, start, end, count);
    if (run == NULL) {
        return -1;
    }
    int rc = PyList_Append(runs, run);
    Py_DECREF(run);
    return rc;
}

/* Append the u64 `a`, then the u64 `b` (when `two`), to a bytearray. */
static int
append_u64s(PyObject *array, uint64_t a, uint64_t b, int two)
{
    Py_ssize_t len = PyByteArray_GET_SIZE(array);
    if (PyByteArray_Resize(array, len + (two ? 16 : 8)) < 0) {
        return -1;
    }
    unsigned char *p = (unsigned char *)PyByteArray_AS_STRING(array) + len;
    put_u64(p, a);
    if (two) {
        put_u64(p + 8, b);
    }
    return 0;
}

PyDoc_STRVAR(scan_doc,
"scan(data, pos, buf, t0, routes, max_frame, runs, seqs, log, index, seg) -> (pos, buf, published, unmatched)\n\n"
"Handle the canonical Messages with a cached route ((targets, vbucket)) from data[pos:], as\n"
"Shard.feed's Python loop would; stop at the first frame that loop must handle itself. buf\n"
"is the bytearray copy of data that is stamped (None until a message has targets, or any\n"
"accepted message when there is a log: then it is made). seqs is the bytearray of the\n"
"sequences (epoch, next offset, last and first stamp per vbucket): each message takes its vbucket's next offset.\n"
"log (the replay buffer's bytearray, or None) gets (seg << 32 | position, vbucket) appended\n"
"for each message, two u64; while the log is empty and the call's messages so far are all of\n"
"one vbucket, the entry goes to index[vbucket] instead (index: the replay buffer's list of\n"
"1024 bytearrays; None with log). Each run of consecutive messages with the same targets is\n"
"appended to `runs` as (targets, start, end, count). Returns where it stopped, buf, the\n"
"messages handled and how many of them matched nobody.");

static PyObject *
scan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "scan() takes 11 arguments");
        return NULL;
    }
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "scan() before configure()");
        return NULL;
    }
    PyObject *data = args[0], *buf = args[2], *routes = args[4], *runs = args[6];
    PyObject *seqs = args[7], *log = args[8], *index = args[9];
    if (!PyBytes_CheckExact(data) || !PyDict_CheckExact(routes) || !PyList_CheckExact(runs)
        || (buf != Py_None && !PyByteArray_CheckExact(buf)) || !PyByteArray_CheckExact(seqs)
        || PyByteArray_GET_SIZE(seqs) != VBUCKETS * SEQ_ENTRY
        || (log != Py_None && (!PyByteArray_CheckExact(log) || log == buf))
        || (index != Py_None && (!PyList_CheckExact(index) || PyList_GET_SIZE(index) != VBUCKETS))
        || (log == Py_None) != (index == Py_None)) {
        PyErr_SetString(PyExc_TypeError,
                        "scan(bytes, int, bytearray | None, int, dict, int, list, bytearray(16384), "
                        "bytearray | None, list of 1024 bytearrays | None, int)");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    long long t0 = PyLong_AsLongLong(args[3]);
    unsigned long long max_frame = PyLong_AsUnsignedLongLong(args[5]);
    unsigned long long seg = PyLong_AsUnsignedLongLong(args[10]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    if (pos < 0 || pos > n) {
        PyErr_SetString(PyExc_ValueError, "scan(): pos out of the data");
        return NULL;
    }
    if (buf != Py_None && PyByteArray_GET_SIZE(buf) != n) {
        PyErr_SetString(PyExc_ValueError, "scan(): buf is not a copy of data");
        return NULL;
    }
    /* The layout, read once per call. */
    const unsigned char *header_uid = layout.header_uid, *header_no_uid = layout.header_no_uid;
    const Py_ssize_t header_at = layout.header_at, header_size = layout.header_size;
    const Py_ssize_t fixed_size = layout.fixed_size[1], ts_broker_at = layout.ts_broker_at;
    const Py_ssize_t epoch_at = layout.epoch_at, offset_at = layout.offset_at, vbucket_at = layout.vbucket_at;
    unsigned char *seq = (unsigned char *)PyByteArray_AS_STRING(seqs);
    const uint64_t key_uoffset_at = (uint64_t)layout.key_uoffset_at;
    const uint64_t payload_uoffset_at = (uint64_t)layout.payload_uoffset_at;
    const uint64_t vectors_at[2] = {(uint64_t)layout.vectors_at[0], (uint64_t)layout.vectors_at[1]};
    Py_INCREF(buf); /* our reference, returned */
    Py_ssize_t published = 0, unmatched = 0;
    PyObject *run = NULL; /* the current run's targets (a strong reference) */
    Py_ssize_t run_start = 0, run_end = -1, run_n = 0;
    long direct_vb = -1; /* the vbucket of this call's messages recorded straight to its index */

    while (n - pos >= fixed_size) {
        const unsigned char *p = d + pos;
        int uid;
        if (memcmp(p + header_at, header_uid, (size_t)header_size) == 0) {
            uid = 1;
        } else if (memcmp(p + header_at, header_no_uid, (size_t)header_size) == 0) {
            uid = 0;
        } else {
            break; /* another frame or layout */
        }
        uint64_t size = u32_at(p);
        uint64_t route_at = vectors_at[uid]; /* the key_partition vector */
        uint64_t kp_len = u32_at(p + route_at);
        uint64_t k_at = key_uoffset_at + u32_at(p + key_uoffset_at);         /* the key vector */
        uint64_t p_at = payload_uoffset_at + u32_at(p + payload_uoffset_at); /* the payload vector */
        uint64_t end_at = 4 + size;
        /* The shape: what Shard.shape checks once per (size, offsets, kp length),
         * broky.protocol.layout.read_shape. */
        if (!(min_frame <= size && size <= max_frame && k_at == route_at + 4 + kp_len + ((4 - (kp_len & 3)) & 3)
              && k_at + 4 <= p_at && p_at + 4 <= end_at)) {
            break;
        }
        if (end_at > (uint64_t)(n - pos)) {
            break; /* incomplete */
        }
        uint64_t key_stop = k_at + 4 + u32_at(p + k_at);
        if (key_stop > p_at || p_at + 4 + u32_at(p + p_at) > end_at) {
            break; /* the generic read accepts or refuses it */
        }
        PyObject *rkey = PyBytes_FromStringAndSize((const char *)p + route_at, (Py_ssize_t)(key_stop - route_at));
        if (rkey == NULL) {
            goto error;
        }
        PyObject *route = PyDict_GetItemWithError(routes, rkey); /* borrowed */
        Py_DECREF(rkey);
        if (route == NULL) {
            if (PyErr_Occurred()) {
                goto error;
            }
            break; /* not cached: Shard.route decides */
        }
        if (!PyTuple_CheckExact(route) || PyTuple_GET_SIZE(route) != 2) {
            break; /* None: not this worker's vbucket */
        }
        PyObject *targets = PyTuple_GET_ITEM(route, 0);
        long vb = PyLong_AsLong(PyTuple_GET_ITEM(route, 1));
        /* A tuple subclass is a route with consumer groups (broky.server.shard.groups.GroupTargets):
         * its runs are queued by Shard.emit like any other, which also serves the groups. */
        if (!PyTuple_Check(targets) || vb < 0 || vb >= VBUCKETS) {
            PyErr_Clear();
            break; /* not a route this loop knows: the Python code decides */
        }
        Py_ssize_t end = pos + (Py_ssize_t)end_at;
        published++;
        /* Accepted: the next offset of its vbucket is its own. */
        unsigned char *s = seq + SEQ_ENTRY * vb;
        uint64_t epoch = u64_at(s), offset = u64_at(s + 8);
        put_u64(s + 8, offset + 1);
        if (log == Py_None) {
            put_u64(s + 16, (uint64_t)t0); /* its last stamp (without a replay buffer) */
        }
        if (offset == 1) {
            put_u64(s + 24, (uint64_t)t0); /* the sequence's first stamp */
        }
        int nobody = PyTuple_GET_SIZE(targets) == 0 && PyTuple_CheckExact(targets);
        if (nobody) {
            unmatched++;
            if (log == Py_None) { /* nobody gets it, nobody can ask for it later */
                pos = end;
                continue;
            }
        }
        if (buf == Py_None) {
            Py_DECREF(buf);
            buf = PyByteArray_FromStringAndSize((const char *)d, n);
            if (buf == NULL) {
                Py_XDECREF(run);
                return NULL;
            }
        }
        unsigned char *frame = (unsigned char *)PyByteArray_AS_STRING(buf) + pos;
        put_u64(frame + ts_broker_at, (uint64_t)t0);
        put_u64(frame + epoch_at, epoch);
        put_u64(frame + offset_at, offset);
        frame[vbucket_at] = (unsigned char)(vb & 0xFF);
        frame[vbucket_at + 1] = (unsigned char)(vb >> 8);
        if (log != Py_None) { /* the replay buffer: its index entry, seg << 32 | pos */
            uint64_t entry = (uint64_t)(seg << 32 | (uint64_t)pos);
            if (PyByteArray_GET_SIZE(log) == 0 && (direct_vb < 0 || direct_vb == vb)) {
                /* Nothing waits in the log, so the index is complete: the entry goes straight
                 * to it, in order (a read of one key_partition never uses the log). */
                PyObject *ix = PyList_GET_ITEM(index, vb);
                if (!PyByteArray_CheckExact(ix) || ix == log || ix == buf) {
                    PyErr_SetString(PyExc_TypeError, "scan(): the index holds a bytearray per vbucket");
                    goto error;
                }
                if (append_u64s(ix, entry, 0, 0) < 0) {
                    goto error;
                }
                direct_vb = vb;
            } else if (append_u64s(log, entry, (uint64_t)vb, 1) < 0) {
                goto error;
            }
        }
        if (nobody) { /* retained; delivered to nobody */
            pos = end;
            continue;
        }
        if (targets == run && pos == run_end) {
            run_end = end;
            run_n++;
        } else {
            if (run != NULL && add_run(runs, run, run_start, run_end, run_n) < 0) {
                goto error;
            }
            Py_INCREF(targets);
            Py_XSETREF(run, targets);
            run_start = pos;
            run_end = end;
            run_n = 1;
        }
        pos = end;
    }
    if (run != NULL && add_run(runs, run, run_start, run_end, run_n) < 0) {
        goto error;
    }
    Py_XDECREF(run);
    return Py_BuildValue("(nNnn)", pos, buf, published, unmatched);
error:
    Py_XDECREF(run);
    Py_DECREF(buf);
    return NULL;
}

PyDoc_STRVAR(settle_doc,
"settle(log, index) -> None\n\n"
"ReplayBuffer.settle's loop: for each (entry, vbucket) pair of u64 in the bytearray `log`,\n"
"append the entry to index[vbucket] (index: the list of 1024 bytearrays), in the log's\n"
"order. The caller empties the log.");

static PyObject *
settle(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "settle() takes 2 arguments");
        return NULL;
    }
    PyObject *log = args[0], *index = args[1];
    if (!PyByteArray_CheckExact(log) || PyByteArray_GET_SIZE(log) % 16 != 0 || !PyList_CheckExact(index)
        || PyList_GET_SIZE(index) != VBUCKETS) {
        PyErr_SetString(PyExc_TypeError, "settle(bytearray of (u64, u64) pairs, list of 1024 bytearrays)");
        return NULL;
    }
    Py_ssize_t n = PyByteArray_GET_SIZE(log);
    for (Py_ssize_t at = 0; at < n; at += 16) {
        /* The index's bytearrays grow here, never the log (it is none of them). */
        const unsigned char *item = (const unsigned char *)PyByteArray_AS_STRING(log) + at;
        uint64_t entry = u64_at(item), vb = u64_at(item + 8);
        if (vb >= VBUCKETS) {
            PyErr_SetString(PyExc_ValueError, "settle(): a vbucket out of range in the log");
            return NULL;
        }
        PyObject *ix = PyList_GET_ITEM(index, (Py_ssize_t)vb);
        if (!PyByteArray_CheckExact(ix) || ix == log) {
            PyErr_SetString(PyExc_TypeError, "settle(): the index holds a bytearray per vbucket");
            return NULL;
        }
        if (append_u64s(ix, entry, 0, 0) < 0) {
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(gather_doc,
"gather(entries, segments, room, first) -> (bytes, n)\n\n"
"The replay buffer's gather (broky.server.shard.replay): the frames the u64 index entries of\n"
"`entries` (a bytes-like object: segment id << 32 | position) point at in `segments` (a dict\n"
"of segment id -> bytearray or bytes), joined in order, as long as they fit in `room` bytes\n"
"(the first one whatever its size if `first`); and how many they are.");

/* The segment of `id` in `segments` and its bytes; -1 (an error set) if it is not there. */
static int
segment_of(PyObject *segments, uint64_t id, const unsigned char **data, Py_ssize_t *len)
{
    PyObject *key = PyLong_FromUnsignedLongLong(id);
    if (key == NULL) {
        return -1;
    }
    PyObject *seg = PyDict_GetItemWithError(segments, key); /* borrowed */
    Py_DECREF(key);
    if (seg == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "gather(): an entry names a segment that is not retained");
        }
        return -1;
    }
    if (PyByteArray_CheckExact(seg)) {
        *data = (const unsigned char *)PyByteArray_AS_STRING(seg);
        *len = PyByteArray_GET_SIZE(seg);
    } else if (PyBytes_CheckExact(seg)) {
        *data = (const unsigned char *)PyBytes_AS_STRING(seg);
        *len = PyBytes_GET_SIZE(seg);
    } else {
        PyErr_SetString(PyExc_TypeError, "gather(): a segment is a bytearray or bytes");
        return -1;
    }
    return 0;
}

static PyObject *
gather(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "gather() takes 4 arguments");
        return NULL;
    }
    PyObject *segments = args[1];
    if (!PyDict_CheckExact(segments)) {
        PyErr_SetString(PyExc_TypeError, "gather(entries, dict of segments, room, first)");
        return NULL;
    }
    Py_ssize_t room = PyLong_AsSsize_t(args[2]);
    if (room == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int first = PyObject_IsTrue(args[3]);
    if (first < 0) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (view.len % 8 != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "gather(): entries are u64");
        return NULL;
    }
    const unsigned char *entries = (const unsigned char *)view.buf;
    Py_ssize_t count = view.len / 8, n = 0, total = 0;
    uint64_t last = UINT64_MAX;
    const unsigned char *data = NULL;
    Py_ssize_t len = 0;
    PyObject *out = NULL;
    /* Two passes over the same entries: the sizes, then the copies. No Python code runs
       between them (int keys' lookups), so the segments neither change nor move. */
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t entry = u64_at(entries + 8 * i), id = entry >> 32, pos = entry & 0xFFFFFFFFu;
        if (id != last) {
            if (segment_of(segments, id, &data, &len) < 0) {
                goto done;
            }
            last = id;
        }
        if (pos + 4 > (uint64_t)len || pos + 4 + u32_at(data + pos) > (uint64_t)len) {
            PyErr_SetString(PyExc_ValueError, "gather(): an entry points past its segment");
            goto done;
        }
        Py_ssize_t size = (Py_ssize_t)(4 + u32_at(data + pos));
        if (total + size > room && !(first && n == 0)) {
            break;
        }
        total += size;
        n++;
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        goto done;
    }
    unsigned char *to = (unsigned char *)PyBytes_AS_STRING(out);
    last = UINT64_MAX;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t entry = u64_at(entries + 8 * i), id = entry >> 32, pos = entry & 0xFFFFFFFFu;
        if (id != last) {
            if (segment_of(segments, id, &data, &len) < 0) {
                Py_CLEAR(out);
                goto done;
            }
            last = id;
        }
        Py_ssize_t size = (Py_ssize_t)(4 + u32_at(data + pos));
        memcpy(to, data + pos, (size_t)size);
        to += size;
    }
done:
    PyBuffer_Release(&view);
    if (out == NULL) {
        return NULL;
    }
    return Py_BuildValue("(Nn)", out, n);
}

PyDoc_STRVAR(note_doc,
"note(buf, start, end, owed, epochs) -> None\n\n"
"Lag.missed's loop (broky.server.shard.lag): for each stamped Message frame of buf[start:end],\n"
"note its offset in owed[vbucket], a list of [first, stop) ranges as two-item lists: the last\n"
"range grows when the offset is its stop, else a range is appended; a vbucket not in `owed`\n"
"gets its first range, and epochs[vbucket] the frame's epoch.");

/* owed[vb]'s last range gets `stop` as its end. */
static int
set_stop(PyObject *range, uint64_t stop)
{
    PyObject *v = PyLong_FromUnsignedLongLong(stop);
    if (v == NULL) {
        return -1;
    }
    return PyList_SetItem(range, 1, v); /* steals v */
}

/* A [first, stop] range of PyLongs, as a new list. */
static PyObject *
new_range(uint64_t first, uint64_t stop)
{
    PyObject *range = Py_BuildValue("[KK]", (unsigned long long)first, (unsigned long long)stop);
    return range;
}

/* note()'s view of one vbucket during a call: its `ranges` list (borrowed from `owed`,
   which keeps it: the call adds keys, never removes one), its last range (a reference of
   ours) and that range's stop, kept here while frames extend it and written back at the
   end of the call (`dirty`). No Python code runs during a call, so nothing else sees the
   lists meanwhile. */
typedef struct {
    PyObject *ranges, *last;
    uint64_t stop;
    int dirty;
} NoteVb;

static NoteVb note_vbs[VBUCKETS];
static uint16_t note_seen[VBUCKETS];

/* Write back every seen vbucket's stop and drop the call's references; -1 if a write back
   failed (the error set, unless one was already). */
static int
note_done(Py_ssize_t seen)
{
    int rc = 0;
    for (Py_ssize_t i = 0; i < seen; i++) {
        NoteVb *v = &note_vbs[note_seen[i]];
        if (v->dirty && rc == 0) {
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            if (set_stop(v->last, v->stop) < 0) {
                rc = -1;
                if (type != NULL) {
                    PyErr_Clear();
                }
            }
            if (type != NULL) {
                PyErr_Restore(type, value, traceback);
            }
        }
        Py_CLEAR(v->last);
        v->ranges = NULL;
        v->dirty = 0;
    }
    return rc;
}

static PyObject *
note(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "note() takes 5 arguments");
        return NULL;
    }
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "note(): configure() first");
        return NULL;
    }
    PyObject *buf = args[0], *owed = args[3], *epochs = args[4];
    if (!PyByteArray_CheckExact(buf) || !PyDict_CheckExact(owed) || !PyDict_CheckExact(epochs)) {
        PyErr_SetString(PyExc_TypeError, "note(bytearray, start, end, dict, dict)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), end = PyLong_AsSsize_t(args[2]);
    if ((start == -1 || end == -1) && PyErr_Occurred()) {
        return NULL;
    }
    if (start < 0 || end > PyByteArray_GET_SIZE(buf) || start > end) {
        PyErr_SetString(PyExc_ValueError, "note(): start and end must lie within buf");
        return NULL;
    }
    /* The position's last byte: a frame shorter than that is not a stamped Message. */
    Py_ssize_t need = layout.vbucket_at + 2;
    if (layout.offset_at + 8 > need) {
        need = layout.offset_at + 8;
    }
    if (layout.epoch_at + 8 > need) {
        need = layout.epoch_at + 8;
    }
    Py_ssize_t seen = 0, pos = start;
    while (pos < end) {
        /* The bytearray neither moves nor changes here: the calls below build lists and
           ints and store them in dicts of int keys, which run no Python code. */
        const unsigned char *f = (const unsigned char *)PyByteArray_AS_STRING(buf) + pos;
        if (end - pos < 4) {
            goto truncated;
        }
        Py_ssize_t size = (Py_ssize_t)(4 + u32_at(f));
        if (size > end - pos || size < need) {
            goto truncated;
        }
        unsigned vb = (unsigned)f[layout.vbucket_at] | ((unsigned)f[layout.vbucket_at + 1] << 8);
        if (vb >= VBUCKETS) {
            PyErr_SetString(PyExc_ValueError, "note(): a vbucket out of range");
            goto fail;
        }
        uint64_t offset = u64_at(f + layout.offset_at);
        NoteVb *v = &note_vbs[vb];
        if (v->last != NULL && v->stop == offset) { /* the run goes on: the common case */
            v->stop = offset + 1;
            v->dirty = 1;
            pos += size;
            continue;
        }
        if (v->last == NULL) { /* first seen in this call */
            PyObject *key = PyLong_FromUnsignedLong(vb);
            if (key == NULL) {
                goto fail;
            }
            PyObject *ranges = PyDict_GetItemWithError(owed, key); /* borrowed */
            if (ranges == NULL) {
                if (PyErr_Occurred()) {
                    Py_DECREF(key);
                    goto fail;
                }
                PyObject *epoch = PyLong_FromUnsignedLongLong(u64_at(f + layout.epoch_at));
                PyObject *range = new_range(offset, offset + 1);
                ranges = PyList_New(1);
                int rc = (epoch == NULL || range == NULL || ranges == NULL) ? -1 : 0;
                if (rc == 0) {
                    Py_INCREF(range);
                    PyList_SET_ITEM(ranges, 0, range);
                    rc = PyDict_SetItem(owed, key, ranges);
                }
                if (rc == 0) {
                    rc = PyDict_SetItem(epochs, key, epoch);
                }
                Py_XDECREF(epoch);
                Py_XDECREF(ranges); /* (owed keeps it) */
                Py_DECREF(key);
                if (rc < 0) {
                    Py_XDECREF(range);
                    goto fail;
                }
                note_seen[seen++] = (uint16_t)vb;
                v->ranges = ranges;
                v->last = range; /* ours */
                v->stop = offset + 1;
                pos += size;
                continue;
            }
            Py_DECREF(key);
            Py_ssize_t n = PyList_Check(ranges) ? PyList_GET_SIZE(ranges) : 0;
            PyObject *last = n ? PyList_GET_ITEM(ranges, n - 1) : NULL;
            if (last == NULL || !PyList_CheckExact(last) || PyList_GET_SIZE(last) != 2) {
                PyErr_SetString(PyExc_TypeError, "note(): owed holds a non-empty list of [first, stop] lists per vbucket");
                goto fail;
            }
            unsigned long long last_stop = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(last, 1));
            if (last_stop == (unsigned long long)-1 && PyErr_Occurred()) {
                goto fail;
            }
            note_seen[seen++] = (uint16_t)vb;
            v->ranges = ranges;
            Py_INCREF(last);
            v->last = last;
            v->stop = last_stop;
            v->dirty = 0;
            if (last_stop == offset) {
                v->stop = offset + 1;
                v->dirty = 1;
                pos += size;
                continue;
            }
        }
        /* A gap: the last range is done, a new one begins. */
        if (v->dirty && set_stop(v->last, v->stop) < 0) {
            goto fail;
        }
        v->dirty = 0;
        PyObject *range = new_range(offset, offset + 1);
        if (range == NULL || PyList_Append(v->ranges, range) < 0) {
            Py_XDECREF(range);
            goto fail;
        }
        Py_SETREF(v->last, range);
        v->stop = offset + 1;
        pos += size;
    }
    if (note_done(seen) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
truncated:
    PyErr_SetString(PyExc_ValueError, "note(): buf[start:end] is not whole stamped Message frames");
fail:
    note_done(seen); /* what was noted stays noted, as in the Python loop */
    return NULL;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)configure, METH_VARARGS,
     "configure(layout, min_frame_size): the canonical layout's positions, read by name from `layout`\n"
     "(broky.protocol.layout), and the smallest valid frame's size prefix"},
    {"layout", (PyCFunction)layout_of, METH_NOARGS,
     "layout() -> dict | None: the positions configure() read, by the owner's names"},
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL, scan_doc},
    {"settle", (PyCFunction)(void (*)(void))settle, METH_FASTCALL, settle_doc},
    {"gather", (PyCFunction)(void (*)(void))gather, METH_FASTCALL, gather_doc},
    {"note", (PyCFunction)(void (*)(void))note, METH_FASTCALL, note_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "broky.server.shard._feedscan",
    "The compiled twin of Shard.feed's fast path (see broky/server/shard/_feedscan.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__feedscan(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "VERSION", FEEDSCAN_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
