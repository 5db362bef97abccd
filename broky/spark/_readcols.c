/* The compiled twin of the Spark source's column decoding (broky.spark.readcols).
 *
 * One type, no I/O: a Decoder takes the Message frames of a bounded read's
 * answer straight from the bytes the connection received (Decoder.scan) and
 * appends each message to the nine columns of the source's schema, in
 * Arrow's memory layout, with no Message object made per row:
 *
 *   key_partition, key, payload   binary: int32 offsets, then the bytes
 *   ts_producer, ts_broker        timestamp (us): a validity bitmap (null for
 *                                 0, "not set"), int64 values (ns // 1000, floor)
 *   uid                           string: validity (null without a uid),
 *                                 int32 offsets, the 27-character KSUID text
 *   vbucket                       int32
 *   epoch                         string: int32 offsets, the decimal text
 *   offset                        int64
 *
 * Decoder.take() hands the columns over as bytes (a flat tuple, the fields
 * of broky.spark.readcols.Columns) and starts a new batch.
 *
 * What scan takes: the frames from `pos`, one after the other, while each is
 * whole (inside [pos, end)), its size prefix is within [min_frame_size,
 * max_frame], and it is a Message in the canonical layout (with or without a
 * uid) whose three vectors lie inside it -- exactly the frames
 * broky.protocol.decode_message reads on its canonical path. It stops before
 * the first frame that is not so (a partial frame, a control frame, a
 * Message in another layout, a malformed one) and returns its position: the
 * caller decodes that one with the reference codec, which raises a clear
 * error for a malformed frame. It also stops once the batch is full (rows
 * or bytes). A frame of a vbucket whose byte in `vbuckets` is 0 (or past its
 * end) is passed over: consumed, no row. Every read is bounds-checked
 * against the frame, so no input makes it read outside `data`.
 *
 * The Python reference (broky.spark.readcols.PyDecoder) decodes with
 * decode_message and builds the same bytes; tests/spark/test_spark_readcols.py
 * holds this twin to it, on valid, truncated and random input. The layout is
 * handed over by configure(), from its one owner, broky.protocol.layout (see
 * broky/protocol/_layout.h); layout() gives it back.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../protocol/_layout.h"

#define READCOLS_VERSION 1
#define UID_TEXT 27               /* broky.protocol.ksuid.TEXT_SIZE */
#define MAX_BATCH_ROWS (1 << 24)  /* the uid and epoch columns stay far under 2 GiB */
#define MAX_BATCH_BYTES (1 << 30) /* with one frame (< 1 GiB) more: under int32 offsets */
#define BASE62_5 916132832ULL     /* 62 ** 5 */

static Layout layout;
static Py_ssize_t min_frame;
static char alphabet[62];
static int configured = 0;

static inline uint32_t
u32_at(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
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

static inline uint32_t
be32_at(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

/* The 27-character base62 text of a 20-byte KSUID (broky.protocol.ksuid.ksuid_text):
 * the 160-bit big-endian number divided by 62**5 five times (five digits each), the
 * quotient left (< 62**2) giving the first two. */
static void
ksuid_text(const unsigned char *uid, char *out)
{
    uint32_t n[5];
    for (int i = 0; i < 5; i++) {
        n[i] = be32_at(uid + 4 * i);
    }
    char *d = out + UID_TEXT;
    for (int round = 0; round < 5; round++) {
        uint64_t rem = 0;
        for (int i = 0; i < 5; i++) {
            uint64_t cur = (rem << 32) | n[i];
            n[i] = (uint32_t)(cur / BASE62_5);
            rem = cur % BASE62_5;
        }
        for (int k = 0; k < 5; k++) {
            *--d = alphabet[rem % 62];
            rem /= 62;
        }
    }
    uint32_t top = n[4]; /* the rest: n[0..3] are 0 (2**160 < 62**27) */
    out[1] = alphabet[top % 62];
    out[0] = alphabet[top / 62];
}

/* ------------------------------------------------------------------ growable buffers */

typedef struct {
    char *p;
    Py_ssize_t len, cap;
} Buf;

static int
buf_grow(Buf *b, Py_ssize_t more)
{
    Py_ssize_t need = b->len + more;
    if (need <= b->cap) {
        return 0;
    }
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < need) {
        cap *= 2;
    }
    char *p = PyMem_Realloc(b->p, (size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static PyObject *
buf_bytes(const Buf *b)
{
    return PyBytes_FromStringAndSize(b->len ? b->p : "", b->len);
}

/* ------------------------------------------------------------------ Decoder */

/* A variable-width column: int32 offsets (rows + 1 of them), the bytes. */
typedef struct {
    Buf offsets, data;
} VarCol;

/* A nullable fixed-width column: a validity bitmap, the values, the nulls. */
typedef struct {
    Buf valid, values;
    Py_ssize_t nulls;
} NullCol;

typedef struct {
    PyObject_HEAD
    Py_ssize_t batch_rows, batch_bytes;
    Py_ssize_t rows, bytes; /* of the batch under way */
    VarCol kp, key, payload, uid, epoch;
    NullCol ts_producer, ts_broker;
    Buf uid_valid;
    Py_ssize_t uid_nulls;
    Buf vbucket, offset;
    uint64_t last_epoch; /* the text of the last epoch met, kept */
    char epoch_text[24];
    int epoch_len;
} Decoder;

/* The writes of one row: each buffer was grown for it first (Decoder_add), so none fails. */
static inline void
put(Buf *b, const void *data, Py_ssize_t n)
{
    if (n) {
        memcpy(b->p + b->len, data, (size_t)n);
    }
    b->len += n;
}

static inline void
var_add(VarCol *c, const void *data, Py_ssize_t n)
{
    put(&c->data, data, n);
    int32_t end = (int32_t)c->data.len;
    put(&c->offsets, &end, 4);
}

/* Set (or leave clear) bit `row` of a bitmap that holds `row` bits so far. */
static inline void
bit_add(Buf *bits, Py_ssize_t row, int set)
{
    if ((row & 7) == 0) {
        bits->p[bits->len++] = 0;
    }
    if (set) {
        bits->p[row >> 3] |= (char)(1 << (row & 7));
    }
}

/* ns since the epoch -> us (floor, as Python's //); 0 is null (a value of 0). */
static inline void
ts_add(NullCol *c, Py_ssize_t row, int64_t ns)
{
    int64_t us = ns / 1000 - (ns % 1000 < 0);
    bit_add(&c->valid, row, ns != 0);
    c->nulls += ns == 0;
    put(&c->values, &us, 8);
}

static void
Decoder_free_bufs(Decoder *self)
{
    Buf *bufs[] = {&self->kp.offsets, &self->kp.data, &self->key.offsets, &self->key.data,
                   &self->payload.offsets, &self->payload.data, &self->uid.offsets, &self->uid.data,
                   &self->epoch.offsets, &self->epoch.data, &self->ts_producer.valid, &self->ts_producer.values,
                   &self->ts_broker.valid, &self->ts_broker.values, &self->uid_valid, &self->vbucket,
                   &self->offset};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) {
        PyMem_Free(bufs[i]->p);
        bufs[i]->p = NULL;
        bufs[i]->len = bufs[i]->cap = 0;
    }
}

/* Start a new batch (the buffers keep their memory). */
static int
Decoder_reset(Decoder *self)
{
    self->rows = self->bytes = 0;
    self->ts_producer.nulls = self->ts_broker.nulls = self->uid_nulls = 0;
    self->ts_producer.valid.len = self->ts_producer.values.len = 0;
    self->ts_broker.valid.len = self->ts_broker.values.len = 0;
    self->uid_valid.len = self->vbucket.len = self->offset.len = 0;
    VarCol *vars[] = {&self->kp, &self->key, &self->payload, &self->uid, &self->epoch};
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++) {
        vars[i]->data.len = vars[i]->offsets.len = 0;
        if (buf_grow(&vars[i]->offsets, 4) < 0) {
            return -1;
        }
        int32_t zero = 0;
        put(&vars[i]->offsets, &zero, 4);
    }
    return 0;
}

static void
Decoder_dealloc(Decoder *self)
{
    Decoder_free_bufs(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Decoder_init(Decoder *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"batch_rows", "batch_bytes", NULL};
    Py_ssize_t rows, bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nn", kwlist, &rows, &bytes)) {
        return -1;
    }
    if (rows < 1 || rows > MAX_BATCH_ROWS || bytes < 1 || bytes > MAX_BATCH_BYTES) {
        PyErr_Format(PyExc_ValueError, "Decoder: batch_rows must be 1 .. %d and batch_bytes 1 .. %d",
                     MAX_BATCH_ROWS, MAX_BATCH_BYTES);
        return -1;
    }
    self->batch_rows = rows;
    self->batch_bytes = bytes;
    self->epoch_len = 0;
    return Decoder_reset(self);
}

static inline int
Decoder_full(const Decoder *self)
{
    return self->rows >= self->batch_rows || self->bytes >= self->batch_bytes;
}

/* Append one message's row (0), or leave the batch as it was (-1, an exception set).
 * f: the frame; kp, key, pay: its vectors' bytes. */
static int
Decoder_add(Decoder *self, const unsigned char *f, int has_uid, const unsigned char *kp, Py_ssize_t kp_len,
            const unsigned char *key, Py_ssize_t key_len, const unsigned char *pay, Py_ssize_t pay_len)
{
    const Layout *l = &layout;
    uint64_t offset = u64_at(f + l->offset_at);
    uint32_t vb = (uint32_t)f[l->vbucket_at] | ((uint32_t)f[l->vbucket_at + 1] << 8);
    if (offset > (uint64_t)INT64_MAX) {
        PyErr_Format(PyExc_OverflowError,
                     "offset %llu of vbucket %u does not fit the offset column (a long): not a "
                     "position a Broky server gives",
                     (unsigned long long)offset, (unsigned)vb);
        return -1;
    }
    uint64_t epoch = u64_at(f + l->epoch_at);
    if (self->epoch_len == 0 || epoch != self->last_epoch) {
        char digits[24];
        int n = 0;
        uint64_t e = epoch;
        do {
            digits[n++] = (char)('0' + e % 10);
            e /= 10;
        } while (e);
        for (int i = 0; i < n; i++) {
            self->epoch_text[i] = digits[n - 1 - i];
        }
        self->epoch_len = n;
        self->last_epoch = epoch;
    }
    /* Room for the row in every buffer first: then the writes below cannot fail. */
    const struct {
        Buf *buf;
        Py_ssize_t n;
    } room[] = {
        {&self->kp.data, kp_len},         {&self->kp.offsets, 4},     {&self->key.data, key_len},
        {&self->key.offsets, 4},          {&self->payload.data, pay_len}, {&self->payload.offsets, 4},
        {&self->ts_producer.valid, 1},    {&self->ts_producer.values, 8}, {&self->ts_broker.valid, 1},
        {&self->ts_broker.values, 8},     {&self->uid_valid, 1},      {&self->uid.data, UID_TEXT},
        {&self->uid.offsets, 4},          {&self->epoch.data, self->epoch_len}, {&self->epoch.offsets, 4},
        {&self->vbucket, 4},              {&self->offset, 8},
    };
    for (size_t i = 0; i < sizeof(room) / sizeof(room[0]); i++) {
        if (room[i].buf->len + room[i].n > room[i].buf->cap && buf_grow(room[i].buf, room[i].n) < 0) {
            return -1;
        }
    }
    Py_ssize_t row = self->rows;
    var_add(&self->kp, kp, kp_len);
    var_add(&self->key, key, key_len);
    var_add(&self->payload, pay, pay_len);
    ts_add(&self->ts_producer, row, (int64_t)u64_at(f + l->ts_producer_at));
    ts_add(&self->ts_broker, row, (int64_t)u64_at(f + l->ts_broker_at));
    bit_add(&self->uid_valid, row, has_uid);
    if (has_uid) {
        char text[UID_TEXT];
        ksuid_text(f + l->uid_at, text);
        var_add(&self->uid, text, UID_TEXT);
    } else {
        int32_t end = (int32_t)self->uid.data.len;
        put(&self->uid.offsets, &end, 4);
        self->uid_nulls++;
    }
    var_add(&self->epoch, self->epoch_text, self->epoch_len);
    int32_t vb32 = (int32_t)vb;
    int64_t off64 = (int64_t)offset;
    put(&self->vbucket, &vb32, 4);
    put(&self->offset, &off64, 8);
    self->rows = row + 1;
    self->bytes += kp_len + key_len + pay_len;
    return 0;
}

PyDoc_STRVAR(scan_doc,
             "scan(data, pos, end, vbuckets, max_frame) -> int\n\n"
             "Take the whole canonical Message frames of data[pos:end], one after the other, into\n"
             "the batch (those of a vbucket whose byte in `vbuckets` is 0: passed over), until a\n"
             "frame it does not take or a full batch; return the position after the last taken.\n"
             "Raises OverflowError for an offset a long cannot hold (nothing of that frame taken).");

static PyObject *
Decoder_scan(Decoder *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "scan(data, pos, end, vbuckets, max_frame)");
        return NULL;
    }
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "scan() before configure()");
        return NULL;
    }
    if (!PyBytes_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "scan: data must be bytes, not %s", Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    Py_ssize_t end = pos == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[2]);
    Py_ssize_t max_frame = end == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    if (pos < 0 || end < pos || end > PyBytes_GET_SIZE(args[0])) {
        PyErr_Format(PyExc_ValueError, "scan: [%zd, %zd) is not inside the %zd bytes of data", pos, end,
                     PyBytes_GET_SIZE(args[0]));
        return NULL;
    }
    if (max_frame < 0 || max_frame >= MAX_BATCH_BYTES) {
        PyErr_Format(PyExc_ValueError, "scan: max_frame must be 0 .. %d", MAX_BATCH_BYTES - 1);
        return NULL;
    }
    Py_buffer mask;
    if (PyObject_GetBuffer(args[3], &mask, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *vbs = (const unsigned char *)mask.buf;
    Py_ssize_t n_vbs = mask.len;
    const Layout *l = &layout;
    int failed = 0;
    while (!Decoder_full(self) && end - pos >= 4) {
        const unsigned char *f = data + pos;
        Py_ssize_t size = (Py_ssize_t)u32_at(f);
        if (size < min_frame || size > max_frame || size > end - pos - 4) {
            break; /* (a bad size prefix: the reference codec says why) */
        }
        Py_ssize_t len = 4 + size;
        int has_uid;
        if (len < l->fixed_size[0]) {
            break;
        }
        if (memcmp(f + l->header_at, l->header_uid, (size_t)l->header_size) == 0) {
            has_uid = 1;
        } else if (memcmp(f + l->header_at, l->header_no_uid, (size_t)l->header_size) == 0) {
            has_uid = 0;
        } else {
            break; /* another frame, or a Message in another layout */
        }
        Py_ssize_t kp_at = l->vectors_at[has_uid];
        if (len < l->fixed_size[has_uid]) {
            break;
        }
        /* The vectors, each inside the frame (as decode_message checks them). */
        Py_ssize_t kp_len = (Py_ssize_t)u32_at(f + kp_at);
        Py_ssize_t k = l->key_uoffset_at + (Py_ssize_t)u32_at(f + l->key_uoffset_at);
        Py_ssize_t p = l->payload_uoffset_at + (Py_ssize_t)u32_at(f + l->payload_uoffset_at);
        if (kp_at + 4 + kp_len > len || k + 4 > len || p + 4 > len) {
            break;
        }
        Py_ssize_t key_len = (Py_ssize_t)u32_at(f + k);
        Py_ssize_t pay_len = (Py_ssize_t)u32_at(f + p);
        if (k + 4 + key_len > len || p + 4 + pay_len > len) {
            break;
        }
        uint32_t vb = (uint32_t)f[l->vbucket_at] | ((uint32_t)f[l->vbucket_at + 1] << 8);
        if (vb < (uint32_t)n_vbs && vbs[vb]) {
            if (Decoder_add(self, f, has_uid, f + kp_at + 4, kp_len, f + k + 4, key_len, f + p + 4, pay_len) < 0) {
                failed = 1;
                break;
            }
        }
        pos += len;
    }
    PyBuffer_Release(&mask);
    if (failed) {
        return NULL; /* (the rows before that frame stay in the batch) */
    }
    return PyLong_FromSsize_t(pos);
}

static PyObject *
Decoder_take(Decoder *self, PyObject *unused)
{
    PyObject *out = Py_BuildValue(
        "(nNNNNNNNNnNNnNNNnNNNN)", self->rows, buf_bytes(&self->kp.offsets), buf_bytes(&self->kp.data),
        buf_bytes(&self->key.offsets), buf_bytes(&self->key.data), buf_bytes(&self->payload.offsets),
        buf_bytes(&self->payload.data),
        self->ts_producer.nulls ? buf_bytes(&self->ts_producer.valid) : Py_NewRef(Py_None),
        buf_bytes(&self->ts_producer.values), self->ts_producer.nulls,
        self->ts_broker.nulls ? buf_bytes(&self->ts_broker.valid) : Py_NewRef(Py_None),
        buf_bytes(&self->ts_broker.values), self->ts_broker.nulls,
        self->uid_nulls ? buf_bytes(&self->uid_valid) : Py_NewRef(Py_None), buf_bytes(&self->uid.offsets),
        buf_bytes(&self->uid.data), self->uid_nulls, buf_bytes(&self->vbucket), buf_bytes(&self->epoch.offsets),
        buf_bytes(&self->epoch.data), buf_bytes(&self->offset));
    if (out == NULL || Decoder_reset(self) < 0) {
        Py_XDECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *
Decoder_get_rows(Decoder *self, void *closure)
{
    return PyLong_FromSsize_t(self->rows);
}

static PyObject *
Decoder_get_bytes(Decoder *self, void *closure)
{
    return PyLong_FromSsize_t(self->bytes);
}

static PyObject *
Decoder_get_full(Decoder *self, void *closure)
{
    return PyBool_FromLong(Decoder_full(self));
}

static PyObject *
Decoder_get_batch_rows(Decoder *self, void *closure)
{
    return PyLong_FromSsize_t(self->batch_rows);
}

static PyObject *
Decoder_get_batch_bytes(Decoder *self, void *closure)
{
    return PyLong_FromSsize_t(self->batch_bytes);
}

static PyGetSetDef Decoder_getset[] = {
    {"rows", (getter)Decoder_get_rows, NULL, "rows of the batch under way", NULL},
    {"nbytes", (getter)Decoder_get_bytes, NULL, "key_partition, key and payload bytes of the batch under way", NULL},
    {"full", (getter)Decoder_get_full, NULL, "whether the batch is full (rows or bytes): scan takes no more", NULL},
    {"batch_rows", (getter)Decoder_get_batch_rows, NULL, "rows that make a batch full", NULL},
    {"batch_bytes", (getter)Decoder_get_batch_bytes, NULL, "bytes that make a batch full", NULL},
    {NULL},
};

static PyMethodDef Decoder_methods[] = {
    {"scan", (PyCFunction)(void (*)(void))Decoder_scan, METH_FASTCALL, scan_doc},
    {"take", (PyCFunction)Decoder_take, METH_NOARGS,
     "take() -> tuple: the batch's columns (broky.spark.readcols.Columns' fields); a new batch starts"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "broky.spark._readcols.Decoder",
    .tp_doc = PyDoc_STR("Decoder(batch_rows, batch_bytes): a read's Message frames into Arrow columns"),
    .tp_basicsize = sizeof(Decoder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Decoder_init,
    .tp_dealloc = (destructor)Decoder_dealloc,
    .tp_methods = Decoder_methods,
    .tp_getset = Decoder_getset,
};

/* ------------------------------------------------------------------ module */

static PyObject *
configure(PyObject *module, PyObject *args)
{
    PyObject *owner;
    Py_ssize_t min;
    const char *letters;
    Py_ssize_t n_letters;
    Layout l;
    if (!PyArg_ParseTuple(args, "Ony#", &owner, &min, &letters, &n_letters) || layout_load(owner, &l) < 0) {
        return NULL;
    }
    if (n_letters != 62 || min < 4) {
        PyErr_SetString(PyExc_ValueError, "configure: the base62 alphabet has 62 letters, a frame 4 bytes or more");
        return NULL;
    }
    layout = l;
    min_frame = min;
    memcpy(alphabet, letters, 62);
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

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)configure, METH_VARARGS,
     "configure(layout, min_frame_size, alphabet): the canonical layout's positions, read by name from\n"
     "`layout` (broky.protocol.layout), the smallest valid frame's size prefix, and the KSUID text's\n"
     "62 letters (broky.protocol.ksuid.ALPHABET, as bytes)"},
    {"layout", (PyCFunction)layout_of, METH_NOARGS,
     "layout() -> dict | None: the positions configure() read, by the owner's names"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "broky.spark._readcols",
    "The compiled twin of the Spark source's column decoding (see broky/spark/_readcols.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__readcols(void)
{
    if (PyType_Ready(&DecoderType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "VERSION", READCOLS_VERSION) < 0
        || PyModule_AddObjectRef(m, "Decoder", (PyObject *)&DecoderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
