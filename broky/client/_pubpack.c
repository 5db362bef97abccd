/* The compiled twin of the SDK's publish encoding (broky.client.publisher).
 *
 * Three pure functions and one small type, no I/O:
 *
 * - Sequence: the state of a KSUID sequence (broky.protocol.ksuid.KsuidSequence:
 *   start, until, pre, next) held in C, so the functions below read and
 *   advance it without attribute lookups. Its `roll` is KsuidSequence's own,
 *   in Python (broky.client.pubpack subclasses this type with it).
 * - encode(key_partition, key, payload, ts_producer, uid): the Message frame
 *   in canonical layout with a uid, byte for byte what
 *   broky.protocol.encode_message returns for the same fields.
 * - stamp(sample, payload, ts_producer, seq): a new frame from a sample frame
 *   of the same key_partition, key and payload length (an encoder template):
 *   the sample's bytes with ts_producer, the next uid of `seq` and the payload
 *   written in. publish's per-call fast path.
 * - pack_rows(...): publish_many's loop over columns: the rows encoded one
 *   after the other into one chunk per Link, appended to the Link's outbound
 *   list, until a row the Python code must handle itself (see pack_rows_doc).
 *
 * Anything unusual (a field that is not bytes, a second the sequence has not
 * rolled to, an oversized frame, an unknown route) is left to the Python code,
 * which stays the reference: tests/client/test_client_pubpack.py holds this twin to it.
 * The layout (the fixed header, the positions of ts_producer, the uoffsets, the
 * uid and the vectors) is handed over once by configure(), from its one owner,
 * broky.protocol.layout (see broky/protocol/_layout.h); layout() gives it back.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "../protocol/_layout.h"

#define PUBPACK_VERSION 5
#define PRE_SIZE 12 /* the uid's time and seed; then an 8-byte little-endian counter */

#define MAX_ZEROS 16

/* What write_frame needs: the layout, and where to write zero words so that the
 * bytes before the vectors of a frame with a uid that none of the fields it writes
 * covers (the stamped region, which the server writes, and any padding) are zeros.
 * A word may run over a field or the vectors' first bytes: those are written after. */
typedef struct {
    Layout l;
    Py_ssize_t n_zeros;
    Py_ssize_t zeros[MAX_ZEROS]; /* positions of 8-byte zero words */
} Writer;

static Writer writer;
static int configured = 0;

static inline void
put_u32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static inline void
put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static inline uint32_t
u32_at(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline Py_ssize_t
pad4(Py_ssize_t n)
{
    return -n & 3;
}

/* time.time_ns(): nanoseconds since the Unix epoch. */
static inline int64_t
now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* memcpy of n bytes, 16 <= n: by 16-byte moves, the last one overlapping (a call
 * into libc for the few dozen bytes of the fixed header costs more than the copy). */
static inline void
copy_small(unsigned char *to, const unsigned char *from, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 16 < n; i += 16) {
        memcpy(to + i, from + i, 16);
    }
    memcpy(to + n - 16, from + n - 16, 16);
}

/* The size of the canonical frame with a uid, size prefix included (message_size):
 * the vectors one after the other, each padded to 4, the frame to 8
 * (broky.protocol.layout.shape). */
static inline Py_ssize_t
frame_size(const Layout *l, Py_ssize_t kp_len, Py_ssize_t key_len, Py_ssize_t pay_len)
{
    Py_ssize_t end = l->vectors_at[1] + 12 + kp_len + pad4(kp_len) + key_len + pad4(key_len) + pay_len;
    return end + (-end & 7);
}

/* Write the canonical frame with a uid into f (frame_size bytes). Every byte is
 * written: the zero ones (the bytes between the fields at fixed positions, the
 * padding after key_partition, key and payload) first, by whole words that the
 * fields written after overlap. */
static inline void
write_frame(const Writer *w, unsigned char *f, Py_ssize_t size, const char *kp, Py_ssize_t kp_len,
            const char *key, Py_ssize_t key_len, const char *pay, Py_ssize_t pay_len, int64_t ts_producer,
            const unsigned char *pre, uint64_t counter)
{
    const Layout *l = &w->l;
    Py_ssize_t kp_at = l->vectors_at[1];              /* key_partition's length */
    Py_ssize_t k = kp_at + 4 + kp_len + pad4(kp_len); /* key's length */
    Py_ssize_t p = k + 4 + key_len + pad4(key_len);   /* payload's length */
    put_u64(f + size - 8, 0); /* the payload's tail and the frame's padding */
    put_u32(f + k - 4, 0);    /* key_partition's tail and padding (or its length, when empty) */
    put_u32(f + p - 4, 0);    /* key's tail and padding (or its length) */
    for (Py_ssize_t i = 0; i < w->n_zeros; i++) {
        put_u64(f + w->zeros[i], 0);
    }
    put_u32(f, (uint32_t)(size - 4));
    copy_small(f + l->header_at, l->header_uid, l->header_size);
    put_u64(f + l->ts_producer_at, (uint64_t)ts_producer);
    put_u32(f + l->key_uoffset_at, (uint32_t)(k - l->key_uoffset_at));
    put_u32(f + l->payload_uoffset_at, (uint32_t)(p - l->payload_uoffset_at));
    memcpy(f + l->uid_at, pre, PRE_SIZE);
    put_u64(f + l->uid_at + PRE_SIZE, counter);
    put_u32(f + kp_at, (uint32_t)kp_len);
    memcpy(f + kp_at + 4, kp, (size_t)kp_len);
    put_u32(f + k, (uint32_t)key_len);
    memcpy(f + k + 4, key, (size_t)key_len);
    put_u32(f + p, (uint32_t)pay_len);
    memcpy(f + p + 4, pay, (size_t)pay_len);
}

/* ------------------------------------------------------------------ Sequence */

typedef struct {
    PyObject_HEAD
    long long start;
    long long until;
    unsigned long long next;
    PyObject *pre; /* bytes: PRE_SIZE once rolled */
} Sequence;

static int
Sequence_traverse(Sequence *self, visitproc visit, void *arg)
{
    Py_VISIT(self->pre);
    return 0;
}

static int
Sequence_clear(Sequence *self)
{
    Py_CLEAR(self->pre);
    return 0;
}

static void
Sequence_dealloc(Sequence *self)
{
    PyObject_GC_UnTrack(self);
    Sequence_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Sequence_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Sequence *self = (Sequence *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->pre = PyBytes_FromStringAndSize(NULL, 0);
        if (self->pre == NULL) {
            Py_DECREF(self);
            return NULL;
        }
    }
    return (PyObject *)self;
}

static PyObject *
Sequence_get_pre(Sequence *self, void *closure)
{
    return Py_NewRef(self->pre);
}

static int
Sequence_set_pre(Sequence *self, PyObject *value, void *closure)
{
    if (value == NULL || !PyBytes_CheckExact(value)
        || (PyBytes_GET_SIZE(value) != PRE_SIZE && PyBytes_GET_SIZE(value) != 0)) {
        PyErr_SetString(PyExc_TypeError, "pre must be 12 bytes");
        return -1;
    }
    Py_SETREF(self->pre, Py_NewRef(value));
    return 0;
}

static PyMemberDef Sequence_members[] = {
    {"start", T_LONGLONG, offsetof(Sequence, start), 0, "first ns of the current second"},
    {"until", T_LONGLONG, offsetof(Sequence, until), 0, "first ns after it"},
    {"next", T_ULONGLONG, offsetof(Sequence, next), 0, "the next id's counter"},
    {NULL},
};

static PyGetSetDef Sequence_getset[] = {
    {"pre", (getter)Sequence_get_pre, (setter)Sequence_set_pre, "12 bytes: time and seed", NULL},
    {NULL},
};

static PyTypeObject SequenceType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "broky.client._pubpack.Sequence",
    .tp_doc = PyDoc_STR("A KSUID sequence's state (see broky.protocol.ksuid.KsuidSequence)."),
    .tp_basicsize = sizeof(Sequence),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = Sequence_new,
    .tp_traverse = (traverseproc)Sequence_traverse,
    .tp_clear = (inquiry)Sequence_clear,
    .tp_dealloc = (destructor)Sequence_dealloc,
    .tp_members = Sequence_members,
    .tp_getset = Sequence_getset,
};

/* The next uid of seq for the time ts: 0, or 1 when seq must roll first (Python's roll). */
static inline int
next_uid(Sequence *seq, int64_t ts, const unsigned char **pre, uint64_t *counter)
{
    if (ts < seq->start || ts >= seq->until || PyBytes_GET_SIZE(seq->pre) != PRE_SIZE
        || seq->next == UINT64_MAX) {
        return 1;
    }
    *pre = (const unsigned char *)PyBytes_AS_STRING(seq->pre);
    *counter = seq->next++;
    return 0;
}

/* ------------------------------------------------------------------ functions */

static PyObject *
configure(PyObject *module, PyObject *owner)
{
    Writer w = {.n_zeros = 0};
    if (layout_load(owner, &w.l) < 0) {
        return NULL;
    }
    /* The zero words: over the bytes before the vectors (of a frame with a uid) that no
     * field covers. The frame has at least 8 bytes after the last of them. */
    const Layout *l = &w.l;
    unsigned char covered[LAYOUT_MAX_FIXED] = {0};
    const Py_ssize_t fields[][2] = {
        {0, 4}, /* the size prefix */
        {l->header_at, l->header_size},
        {l->ts_producer_at, 8},
        {l->key_uoffset_at, 4},
        {l->payload_uoffset_at, 4},
        {l->uid_at, LAYOUT_UID_SIZE},
    };
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        memset(covered + fields[i][0], 1, (size_t)fields[i][1]); /* before the vectors: layout_load checked */
    }
    for (Py_ssize_t at = 0; at < l->vectors_at[1]; at++) {
        if (covered[at]) {
            continue;
        }
        if (w.n_zeros == MAX_ZEROS) {
            PyErr_SetString(PyExc_ValueError, "configure: this layout does not fit the compiled twin: "
                                              "more than 128 bytes between its fields");
            return NULL;
        }
        w.zeros[w.n_zeros++] = at;
        at += 7; /* the word's last byte */
    }
    writer = w;
    configured = 1;
    Py_RETURN_NONE;
}

static PyObject *
layout_of(PyObject *module, PyObject *unused)
{
    if (!configured) {
        Py_RETURN_NONE;
    }
    return layout_as_dict(&writer.l);
}

/* An int64 ts_producer (None: now); -1 with an error set when out of range or not an int. */
static inline int
ts_of(PyObject *value, int64_t now, int64_t *ts)
{
    if (value == Py_None) {
        *ts = now;
        return 0;
    }
    if (!PyLong_CheckExact(value)) {
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    *ts = v;
    return 0;
}

PyDoc_STRVAR(encode_doc,
"encode(key_partition, key, payload, ts_producer, uid) -> bytes\n\n"
"The Message frame in canonical layout, as broky.protocol.encode_message(key_partition,\n"
"key, payload, ts_producer, 0, uid) returns it; fields bytes, uid 20 bytes.");

static PyObject *
encode(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "encode() takes 5 arguments");
        return NULL;
    }
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "encode() before configure()");
        return NULL;
    }
    PyObject *kp = args[0], *key = args[1], *pay = args[2], *uid = args[4];
    if (!PyBytes_CheckExact(kp) || !PyBytes_CheckExact(key) || !PyBytes_CheckExact(pay)
        || !PyBytes_CheckExact(uid) || PyBytes_GET_SIZE(uid) != LAYOUT_UID_SIZE) {
        PyErr_SetString(PyExc_TypeError, "encode(bytes, bytes, bytes, int, 20 bytes)");
        return NULL;
    }
    int64_t ts;
    if (ts_of(args[3], 0, &ts) < 0 || args[3] == Py_None) {
        PyErr_SetString(PyExc_OverflowError, "ts_producer must be an int64");
        return NULL;
    }
    Py_ssize_t kp_len = PyBytes_GET_SIZE(kp), key_len = PyBytes_GET_SIZE(key), pay_len = PyBytes_GET_SIZE(pay);
    if (kp_len > UINT32_MAX || key_len > UINT32_MAX || pay_len > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a field is over 4 GiB");
        return NULL;
    }
    Py_ssize_t size = frame_size(&writer.l, kp_len, key_len, pay_len);
    PyObject *frame = PyBytes_FromStringAndSize(NULL, size);
    if (frame == NULL) {
        return NULL;
    }
    const unsigned char *u = (const unsigned char *)PyBytes_AS_STRING(uid);
    uint64_t counter = 0;
    for (int i = 7; i >= 0; i--) {
        counter = (counter << 8) | u[PRE_SIZE + i];
    }
    write_frame(&writer, (unsigned char *)PyBytes_AS_STRING(frame), size, PyBytes_AS_STRING(kp), kp_len,
                PyBytes_AS_STRING(key), key_len, PyBytes_AS_STRING(pay), pay_len, ts, u, counter);
    return frame;
}

PyDoc_STRVAR(stamp_doc,
"stamp(sample, payload, ts_producer, seq[, out]) -> bytes | int | None\n\n"
"A frame like `sample` (a canonical frame with a uid and a payload of len(payload)\n"
"bytes) with ts_producer (None: now), the next uid of seq and payload written in.\n"
"With `out` (a list), the frame is appended to it and its size returned instead.\n"
"None, with seq untouched, when the Python path must publish it: payload not bytes\n"
"of the sample's length, ts_producer not an int64, or seq must roll first.");

/* stamp's work: *frame = a new frame from sample (see stamp_doc). 1 when made, 0 when the
 * Python path must publish it (seq untouched), -1 on an error (set). */
static int
stamp_frame(PyObject *sample, PyObject *pay, PyObject *ts_producer, Sequence *seq, PyObject **frame)
{
    const unsigned char *s = (const unsigned char *)PyBytes_AS_STRING(sample);
    Py_ssize_t size = PyBytes_GET_SIZE(sample);
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "stamp() before configure()");
        return -1;
    }
    const Layout *l = &writer.l;
    if (size < l->vectors_at[1] + 12 || memcmp(s + l->header_at, l->header_uid, (size_t)l->header_size) != 0) {
        PyErr_SetString(PyExc_ValueError, "stamp: the sample is not a canonical frame with a uid");
        return -1;
    }
    /* the payload's length */
    Py_ssize_t p = l->payload_uoffset_at + (Py_ssize_t)u32_at(s + l->payload_uoffset_at);
    if (p + 4 > size || !PyBytes_CheckExact(pay) || (Py_ssize_t)u32_at(s + p) != PyBytes_GET_SIZE(pay)
        || p + 4 + PyBytes_GET_SIZE(pay) > size) {
        return 0;
    }
    int64_t now = now_ns(), ts;
    if (ts_of(ts_producer, now, &ts) < 0) {
        return 0;
    }
    const unsigned char *pre;
    uint64_t counter;
    if (next_uid(seq, now, &pre, &counter)) {
        return 0;
    }
    PyObject *f = PyBytes_FromStringAndSize((const char *)s, size);
    if (f == NULL) {
        seq->next--;
        return -1;
    }
    unsigned char *b = (unsigned char *)PyBytes_AS_STRING(f);
    put_u64(b + l->ts_producer_at, (uint64_t)ts);
    memcpy(b + l->uid_at, pre, PRE_SIZE);
    put_u64(b + l->uid_at + PRE_SIZE, counter);
    memcpy(b + p + 4, PyBytes_AS_STRING(pay), (size_t)PyBytes_GET_SIZE(pay));
    *frame = f;
    return 1;
}

static PyObject *
stamp(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "stamp() takes 4 or 5 arguments");
        return NULL;
    }
    PyObject *sample = args[0], *pay = args[1], *out = nargs == 5 ? args[4] : NULL;
    if (!PyBytes_CheckExact(sample) || !PyObject_TypeCheck(args[3], &SequenceType)
        || (out != NULL && !PyList_CheckExact(out))) {
        PyErr_SetString(PyExc_TypeError, "stamp(bytes, bytes, int | None, Sequence[, list])");
        return NULL;
    }
    Sequence *seq = (Sequence *)args[3];
    PyObject *frame;
    int made = stamp_frame(sample, pay, args[2], seq, &frame);
    if (made <= 0) {
        return made < 0 ? NULL : Py_NewRef(Py_None);
    }
    if (out == NULL) {
        return frame;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(frame);
    int rc = PyList_Append(out, frame);
    Py_DECREF(frame);
    if (rc < 0) {
        seq->next--;
        return NULL;
    }
    return PyLong_FromSsize_t(size);
}

PyDoc_STRVAR(pack_rows_doc,
"pack_rows(key_partitions, keys, payloads, ts_producers, start, slots, outs, added, counts,\n"
"          room, part, max_frame, seq, uid_prefix, uid_base) -> (stop, full)\n\n"
"publish_many's loop: from row `start`, encode row i (key_partitions[i], keys[i],\n"
"payloads[i], ts_producers[i] or now when ts_producers is None) into the chunks of\n"
"slot j = slots[key_partition] (now: a clock reading taken every 32 rows). The uid is\n"
"the next of seq, or with uid_prefix (12 bytes) uid_prefix + (uid_base + i) as 8\n"
"little-endian bytes. Stops before a row the Python path must publish (a field that is\n"
"not bytes, a key that is not plainly literal (empty, an empty token, a '*' or '>'),\n"
"a ts_producer that is not None or an int64, a key_partition not in slots, a\n"
"slot whose room is negative, a frame over max_frame, seq to roll), or after a row that\n"
"brings slot j's chunks to room[j] bytes or more (then full = j, else -1). A chunk is\n"
"bytes, whole frames one after the other, at most `part` bytes unless it holds one larger\n"
"frame; slot j's are appended to the list outs[j], their size in added[j], their frame\n"
"count in counts[j]. Returns the row it stopped at. On an error (MemoryError) outs is\n"
"left as it was.");

/* 1 if `key` is plainly publishable: not empty, no empty token (no leading, trailing
 * or doubled '.') and no '*' or '>' byte at all. Anything else goes to the Python
 * path, which checks the key exactly (broky.client.encoder.check_fields: it raises
 * BadKeyError for a wildcard or empty token, publishes "a*b"). */
static int
plain_key(const char *s, Py_ssize_t n)
{
    if (n == 0 || s[0] == '.' || s[n - 1] == '.' || memchr(s, '*', (size_t)n) || memchr(s, '>', (size_t)n)) {
        return 0;
    }
    const char *end = s + n - 1; /* s[n - 1] is no '.' */
    for (const char *p = memchr(s, '.', (size_t)(end - s)); p != NULL;
         p = memchr(p + 1, '.', (size_t)(end - p - 1))) {
        if (p[1] == '.') {
            return 0;
        }
    }
    return 1;
}

#define CHUNK_MIN 4096
/* The clock is read once per CLOCK_ROWS rows: "now" for a row is a reading at most
 * that many rows old (a few microseconds: rows are encoded at tens of millions a second). */
#define CLOCK_ROWS 32

/* One slot of pack_rows: its chunk being written (bytes, grown as needed up to a
 * part, cut to size when finished), the bytes used and its capacity; the bytes of
 * its chunks finished so far and all its frames; the room before its batch is
 * full; its list of chunks (outs[j]) and that list's length before the call. */
typedef struct {
    PyObject *chunk;
    Py_ssize_t used, cap, done, frames, room;
    PyObject *out;
    Py_ssize_t out0;
} Slot;

/* Cut the slot's chunk to its size and append it to its list. On error the
 * chunk is released and -1 returned. */
static int
finish_chunk(Slot *s)
{
    if (s->used < s->cap && _PyBytes_Resize(&s->chunk, s->used) < 0) {
        s->chunk = NULL; /* freed by _PyBytes_Resize */
        return -1;
    }
    int err = PyList_Append(s->out, s->chunk);
    Py_CLEAR(s->chunk);
    if (err < 0) {
        return -1;
    }
    s->done += s->used;
    s->used = s->cap = 0;
    return 0;
}

static PyObject *
pack_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "pack_rows() takes 15 arguments");
        return NULL;
    }
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "pack_rows() before configure()");
        return NULL;
    }
    PyObject *kps = args[0], *keys = args[1], *pays = args[2], *tss = args[3];
    PyObject *slots = args[5], *outs = args[6], *added = args[7], *counts = args[8], *room = args[9];
    PyObject *prefix = args[13];
    if (!PyDict_CheckExact(slots) || !PyList_CheckExact(outs) || !PyList_CheckExact(added)
        || !PyList_CheckExact(counts) || !PyList_CheckExact(room)
        || PyList_GET_SIZE(added) != PyList_GET_SIZE(outs) || PyList_GET_SIZE(counts) != PyList_GET_SIZE(outs)
        || PyList_GET_SIZE(room) != PyList_GET_SIZE(outs) || !PyObject_TypeCheck(args[12], &SequenceType)
        || (prefix != Py_None && (!PyBytes_CheckExact(prefix) || PyBytes_GET_SIZE(prefix) != PRE_SIZE))) {
        PyErr_SetString(PyExc_TypeError, "pack_rows: bad arguments (see its docstring)");
        return NULL;
    }
    Sequence *seq = (Sequence *)args[12];
    const Writer w = writer; /* read once per call: a copy the calls in the loop cannot change */
    Py_ssize_t start = PyLong_AsSsize_t(args[4]);
    Py_ssize_t part = PyLong_AsSsize_t(args[10]);
    long long max_frame = PyLong_AsLongLong(args[11]);
    unsigned long long uid_base = prefix == Py_None ? 0 : PyLong_AsUnsignedLongLong(args[14]);
    Py_ssize_t n = PySequence_Size(kps);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n_slots = PyList_GET_SIZE(outs);
    if (part < 1) {
        PyErr_SetString(PyExc_ValueError, "pack_rows: part must be at least 1");
        return NULL;
    }
    Slot stack_slots[16];
    Slot *sl = stack_slots;
    if (n_slots > 16) {
        sl = PyMem_Malloc(sizeof(Slot) * (size_t)n_slots);
        if (sl == NULL) {
            return PyErr_NoMemory();
        }
    }
    for (Py_ssize_t j = 0; j < n_slots; j++) {
        sl[j].chunk = NULL;
        sl[j].used = sl[j].cap = sl[j].frames = sl[j].done = sl[j].out0 = 0;
        sl[j].out = Py_NewRef(PyList_GET_ITEM(outs, j)); /* held: a column's __getitem__ may run code */
        sl[j].room = PyLong_AsSsize_t(PyList_GET_ITEM(room, j));
        if (!PyList_CheckExact(sl[j].out)) {
            PyErr_SetString(PyExc_TypeError, "pack_rows: outs must hold lists");
        } else {
            sl[j].out0 = PyList_GET_SIZE(sl[j].out);
        }
    }
    if (PyErr_Occurred()) {
        goto error;
    }
    int fast_cols = (PyList_CheckExact(kps) || PyTuple_CheckExact(kps))
                    && (PyList_CheckExact(keys) || PyTuple_CheckExact(keys))
                    && (PyList_CheckExact(pays) || PyTuple_CheckExact(pays))
                    && (tss == Py_None || PyList_CheckExact(tss) || PyTuple_CheckExact(tss));
    Py_ssize_t i = start, full = -1;
    int64_t now = 0;
    PyObject *plain = NULL; /* with fast_cols, the last key plain_key passed (held by its column) */
    for (; i < n; i++) {
        PyObject *kp, *key, *pay, *t = Py_None;
        if (fast_cols) {
            if (i >= PySequence_Fast_GET_SIZE(kps) || i >= PySequence_Fast_GET_SIZE(keys)
                || i >= PySequence_Fast_GET_SIZE(pays)
                || (tss != Py_None && i >= PySequence_Fast_GET_SIZE(tss))) {
                break; /* columns of unequal length: the Python path raises */
            }
            kp = Py_NewRef(PySequence_Fast_GET_ITEM(kps, i));
            key = Py_NewRef(PySequence_Fast_GET_ITEM(keys, i));
            pay = Py_NewRef(PySequence_Fast_GET_ITEM(pays, i));
            if (tss != Py_None) {
                t = PySequence_Fast_GET_ITEM(tss, i);
            }
            Py_INCREF(t);
        } else {
            kp = PySequence_GetItem(kps, i);
            key = kp == NULL ? NULL : PySequence_GetItem(keys, i);
            pay = key == NULL ? NULL : PySequence_GetItem(pays, i);
            t = pay == NULL ? NULL : (tss == Py_None ? Py_NewRef(Py_None) : PySequence_GetItem(tss, i));
            if (t == NULL) {
                Py_XDECREF(kp);
                Py_XDECREF(key);
                Py_XDECREF(pay);
                PyErr_Clear(); /* the Python path reads the row again and raises */
                break;
            }
        }
        int stop = 1;
        Py_ssize_t j = -1;
        if (PyBytes_CheckExact(kp) && PyBytes_CheckExact(key) && PyBytes_CheckExact(pay)) {
            PyObject *slot = PyDict_GetItemWithError(slots, kp); /* bytes keys: cannot raise */
            j = slot == NULL || !PyLong_CheckExact(slot) ? -1 : PyLong_AsSsize_t(slot);
            if (j == -1 && PyErr_Occurred()) {
                PyErr_Clear();
            }
            Py_ssize_t kp_len = PyBytes_GET_SIZE(kp), key_len = PyBytes_GET_SIZE(key);
            Py_ssize_t pay_len = PyBytes_GET_SIZE(pay);
            Py_ssize_t size = frame_size(&w.l, kp_len, key_len, pay_len);
            if ((i - start) % CLOCK_ROWS == 0) {
                now = now_ns();
            }
            int64_t ts;
            const unsigned char *pre = NULL;
            uint64_t counter = 0;
            if (j >= 0 && j < n_slots && sl[j].room >= 0 && size - 4 <= max_frame && ts_of(t, now, &ts) == 0
                && ((fast_cols && key == plain) || plain_key(PyBytes_AS_STRING(key), key_len))) {
                plain = key; /* the next row's key is mostly this one: checked once */
                if (prefix != Py_None) {
                    pre = (const unsigned char *)PyBytes_AS_STRING(prefix);
                    counter = (uint64_t)uid_base + (uint64_t)i;
                    stop = counter < (uint64_t)uid_base; /* wrapped: the Python path raises */
                } else {
                    stop = next_uid(seq, now, &pre, &counter);
                }
            }
            if (!stop) {
                Slot *s = &sl[j];
                if (s->used + size > s->cap) {
                    /* A chunk the frame would take past a part is finished (the frame
                     * starts a new one); a smaller one grows by doubling, up to a part; a
                     * new one starts with what the batch may still take, at most a part
                     * (or the one frame, when larger). */
                    int ok = s->chunk == NULL || s->used + size <= part || finish_chunk(s) == 0;
                    Py_ssize_t cap = s->chunk == NULL ? s->room - s->done + size : s->cap * 2;
                    if (cap < CHUNK_MIN) {
                        cap = CHUNK_MIN;
                    }
                    if (cap > part) {
                        cap = part;
                    }
                    if (cap < s->used + size) {
                        cap = s->used + size;
                    }
                    if (!ok) {
                        /* finish_chunk failed: s->chunk is NULL */
                    } else if (s->chunk == NULL) {
                        s->chunk = PyBytes_FromStringAndSize(NULL, cap);
                    } else if (_PyBytes_Resize(&s->chunk, cap) < 0) {
                        s->chunk = NULL; /* freed by _PyBytes_Resize */
                    }
                    if (s->chunk == NULL) {
                        if (prefix == Py_None) {
                            seq->next--;
                        }
                        Py_DECREF(kp);
                        Py_DECREF(key);
                        Py_DECREF(pay);
                        Py_DECREF(t);
                        goto error;
                    }
                    s->cap = cap;
                }
                write_frame(&w, (unsigned char *)PyBytes_AS_STRING(s->chunk) + s->used, size, PyBytes_AS_STRING(kp),
                            kp_len, PyBytes_AS_STRING(key), key_len, PyBytes_AS_STRING(pay), pay_len, ts, pre,
                            counter);
                s->used += size;
                s->frames++;
            }
        }
        Py_DECREF(kp);
        Py_DECREF(key);
        Py_DECREF(pay);
        Py_DECREF(t);
        if (stop) {
            break;
        }
        if (sl[j].done + sl[j].used >= sl[j].room) {
            full = j;
            i++;
            break;
        }
    }
    for (Py_ssize_t j = 0; j < n_slots; j++) {
        Slot *s = &sl[j];
        if (s->chunk != NULL && finish_chunk(s) < 0) {
            goto error;
        }
    }
    for (Py_ssize_t j = 0; j < n_slots; j++) {
        Slot *s = &sl[j];
        if (s->frames == 0) {
            continue;
        }
        PyObject *size = PyLong_FromSsize_t(s->done), *frames = PyLong_FromSsize_t(s->frames);
        if (size == NULL || frames == NULL) {
            Py_XDECREF(size);
            Py_XDECREF(frames);
            goto error;
        }
        PyList_SetItem(added, j, size);
        PyList_SetItem(counts, j, frames);
    }
    for (Py_ssize_t j = 0; j < n_slots; j++) {
        Py_DECREF(sl[j].out);
    }
    if (sl != stack_slots) {
        PyMem_Free(sl);
    }
    return Py_BuildValue("(nn)", i, full);
error:
    for (Py_ssize_t j = 0; j < n_slots; j++) {
        Py_XDECREF(sl[j].chunk);
        if (PyList_CheckExact(sl[j].out) && PyList_GET_SIZE(sl[j].out) > sl[j].out0) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyList_SetSlice(sl[j].out, sl[j].out0, PyList_GET_SIZE(sl[j].out), NULL); /* outs as they were */
            PyErr_Restore(type, value, tb);
        }
        Py_DECREF(sl[j].out);
    }
    if (sl != stack_slots) {
        PyMem_Free(sl);
    }
    return NULL;
}

/* ------------------------------------------------------------------ LinkState */

/* The state of a Link (broky.client.link) that publish's fast path reads and writes,
 * held in C so FastPath reaches it without attribute lookups: Link subclasses this
 * type when the twin is built. Python code sees plain attributes. */
typedef struct {
    PyObject_HEAD
    PyObject *proto;        /* the connection's protocol, or None while down */
    PyObject *out;          /* list: frames to write */
    PyObject *out_bytes;    /* int: their size */
    PyObject *flush_handle; /* the scheduled write, or None */
} LinkState;

static int
LinkState_traverse(LinkState *self, visitproc visit, void *arg)
{
    Py_VISIT(self->proto);
    Py_VISIT(self->out);
    Py_VISIT(self->out_bytes);
    Py_VISIT(self->flush_handle);
    return 0;
}

static int
LinkState_clear(LinkState *self)
{
    Py_CLEAR(self->proto);
    Py_CLEAR(self->out);
    Py_CLEAR(self->out_bytes);
    Py_CLEAR(self->flush_handle);
    return 0;
}

static void
LinkState_dealloc(LinkState *self)
{
    PyObject_GC_UnTrack(self);
    LinkState_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
LinkState_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    LinkState *self = (LinkState *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->proto = Py_NewRef(Py_None);
    self->out = PyList_New(0);
    self->out_bytes = PyLong_FromLong(0);
    self->flush_handle = Py_NewRef(Py_None);
    if (self->out == NULL || self->out_bytes == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyMemberDef LinkState_members[] = {
    {"proto", T_OBJECT_EX, offsetof(LinkState, proto), 0, "the connection's protocol, or None while down"},
    {"out", T_OBJECT_EX, offsetof(LinkState, out), 0, "frames to write"},
    {"out_bytes", T_OBJECT_EX, offsetof(LinkState, out_bytes), 0, "their size"},
    {"flush_handle", T_OBJECT_EX, offsetof(LinkState, flush_handle), 0, "the scheduled write, or None"},
    {NULL},
};

static PyTypeObject LinkStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "broky.client._pubpack.LinkState",
    .tp_doc = PyDoc_STR("The part of a Link's state publish's fast path uses (see FastPath)."),
    .tp_basicsize = sizeof(LinkState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = LinkState_new,
    .tp_traverse = (traverseproc)LinkState_traverse,
    .tp_clear = (inquiry)LinkState_clear,
    .tp_dealloc = (destructor)LinkState_dealloc,
    .tp_members = LinkState_members,
};

/* ------------------------------------------------------------------ FastPath */

/* publish's whole fast path (broky.client.publisher): the cache lookup, stamp, and
 * the Link's bookkeeping (Link.send's steps for a Link that is up). */
typedef struct {
    PyObject_HEAD
    PyObject *fast;       /* dict: key_partition -> key -> payload length -> (sample, Link) */
    Sequence *seq;
    Py_ssize_t batch_size;
} FastPath;

static PyObject *str_schedule_flush;

static int
FastPath_traverse(FastPath *self, visitproc visit, void *arg)
{
    Py_VISIT(self->fast);
    Py_VISIT(self->seq);
    return 0;
}

static int
FastPath_clear(FastPath *self)
{
    Py_CLEAR(self->fast);
    Py_CLEAR(self->seq);
    return 0;
}

static void
FastPath_dealloc(FastPath *self)
{
    PyObject_GC_UnTrack(self);
    FastPath_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
FastPath_init(FastPath *self, PyObject *args, PyObject *kwds)
{
    PyObject *fast, *seq;
    Py_ssize_t batch_size;
    if (!PyArg_ParseTuple(args, "O!O!n:FastPath", &PyDict_Type, &fast, &SequenceType, &seq, &batch_size)) {
        return -1;
    }
    Py_XSETREF(self->fast, Py_NewRef(fast));
    Py_XSETREF(self->seq, (Sequence *)Py_NewRef(seq));
    self->batch_size = batch_size;
    return 0;
}

/* d[key] (borrowed), NULL when missing or d is not a dict (no error set), or on an error. */
static inline PyObject *
lookup(PyObject *d, PyObject *key)
{
    if (d == NULL || !PyDict_CheckExact(d)) {
        return NULL;
    }
    return PyDict_GetItemWithError(d, key);
}

PyDoc_STRVAR(FastPath_publish_doc,
"publish(key_partition, key, payload, ts_producer) -> None | False | Link\n\n"
"publish's fast path for a new KSUID: the cache entry (sample, link) of\n"
"fast[key_partition][key][len(payload)]; the frame stamped from the sample (see stamp)\n"
"and appended to link.out, link.out_bytes counted, and the Link's flush scheduled\n"
"when none is (link.schedule_flush()). Returns None when published, the Link when\n"
"published and its out_bytes reached batch_size (the caller writes the batch), False\n"
"when nothing was done and the Python path must publish it: no cache entry, the Link\n"
"down (link.proto None), or what makes stamp return None.");

static PyObject *
FastPath_publish(FastPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "publish() takes 4 arguments");
        return NULL;
    }
    PyObject *pay = args[2];
    if (!PyBytes_CheckExact(pay)) {
        Py_RETURN_FALSE;
    }
    PyObject *by_key = lookup(self->fast, args[0]);
    PyObject *by_len = lookup(by_key, args[1]);
    if (by_len == NULL || !PyDict_CheckExact(by_len)) {
        goto python_path;
    }
    PyObject *len = PyLong_FromSsize_t(PyBytes_GET_SIZE(pay));
    if (len == NULL) {
        return NULL;
    }
    PyObject *entry = PyDict_GetItemWithError(by_len, len);
    Py_DECREF(len);
    if (entry == NULL || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2
        || !PyBytes_CheckExact(PyTuple_GET_ITEM(entry, 0))) {
        goto python_path;
    }
    PyObject *link = PyTuple_GET_ITEM(entry, 1);
    if (!PyObject_TypeCheck(link, &LinkStateType)) {
        goto python_path;
    }
    LinkState *ls = (LinkState *)link;
    if (ls->proto == NULL || ls->proto == Py_None || ls->out == NULL || !PyList_CheckExact(ls->out)
        || ls->out_bytes == NULL || !PyLong_CheckExact(ls->out_bytes)) {
        Py_RETURN_FALSE; /* the Link is down (or odd): the Python path */
    }
    Py_ssize_t n = PyLong_AsSsize_t(ls->out_bytes);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *frame;
    int made = stamp_frame(PyTuple_GET_ITEM(entry, 0), pay, args[3], self->seq, &frame);
    if (made <= 0) {
        return made < 0 ? NULL : Py_NewRef(Py_False);
    }
    n += PyBytes_GET_SIZE(frame);
    PyObject *count = PyLong_FromSsize_t(n);
    if (count == NULL || PyList_Append(ls->out, frame) < 0) {
        Py_XDECREF(count);
        Py_DECREF(frame);
        self->seq->next--;
        return NULL;
    }
    Py_DECREF(frame);
    Py_SETREF(ls->out_bytes, count); /* published: the frame is in out, and counted */
    if (n >= self->batch_size) {
        return Py_NewRef(link);
    }
    if (ls->flush_handle == NULL || ls->flush_handle == Py_None) {
        Py_INCREF(link);
        PyObject *r = PyObject_CallMethodNoArgs(link, str_schedule_flush);
        Py_DECREF(link);
        if (r == NULL) {
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
python_path: /* (an unhashable field too: the Python path tells what is wrong) */
    PyErr_Clear();
    Py_RETURN_FALSE;
}

static PyMethodDef FastPath_methods[] = {
    {"publish", (PyCFunction)(void (*)(void))FastPath_publish, METH_FASTCALL, FastPath_publish_doc},
    {NULL},
};

static PyMemberDef FastPath_members[] = {
    {"batch_size", T_PYSSIZET, offsetof(FastPath, batch_size), 0, "a Link's batch is written at this many bytes"},
    {NULL},
};

static PyTypeObject FastPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "broky.client._pubpack.FastPath",
    .tp_doc = PyDoc_STR("FastPath(fast, seq, batch_size): publish's fast path over a publisher's cache (see publish)."),
    .tp_basicsize = sizeof(FastPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FastPath_init,
    .tp_traverse = (traverseproc)FastPath_traverse,
    .tp_clear = (inquiry)FastPath_clear,
    .tp_dealloc = (destructor)FastPath_dealloc,
    .tp_methods = FastPath_methods,
    .tp_members = FastPath_members,
};

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)configure, METH_O,
     "configure(layout): the canonical layout's positions, read by name from `layout`\n"
     "(broky.protocol.layout)"},
    {"layout", (PyCFunction)layout_of, METH_NOARGS,
     "layout() -> dict | None: the positions configure() read, by the owner's names"},
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL, encode_doc},
    {"stamp", (PyCFunction)(void (*)(void))stamp, METH_FASTCALL, stamp_doc},
    {"pack_rows", (PyCFunction)(void (*)(void))pack_rows, METH_FASTCALL, pack_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "broky.client._pubpack",
    "The compiled twin of the SDK's publish encoding (see broky/client/_pubpack.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__pubpack(void)
{
    if (PyType_Ready(&SequenceType) < 0 || PyType_Ready(&FastPathType) < 0
        || PyType_Ready(&LinkStateType) < 0) {
        return NULL;
    }
    str_schedule_flush = PyUnicode_InternFromString("schedule_flush");
    if (str_schedule_flush == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "VERSION", PUBPACK_VERSION) < 0
        || PyModule_AddObjectRef(m, "Sequence", (PyObject *)&SequenceType) < 0
        || PyModule_AddObjectRef(m, "FastPath", (PyObject *)&FastPathType) < 0
        || PyModule_AddObjectRef(m, "LinkState", (PyObject *)&LinkStateType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
