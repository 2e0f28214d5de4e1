/*
 * The per-sample loops of a local hit, in C: at 4 KiB a sample, building its
 * key and checking and copying its value cost as much in Python bytecode as
 * the LMDB lookup itself. And the framing of a value read from the PFS, and
 * the check of values received from a peer, which hash without holding the
 * GIL, so that reader threads leave it to the cache writer. The layouts are those of records.py:
 *
 *     key   = sample id, 8 bytes big-endian
 *     value = [xxh3-64 of payload, 8 bytes little-endian][payload]
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifdef DATAQUAY_XXH_X86_DISPATCH
/* XXH3_64bits picks SSE2, AVX2 or AVX-512 at run time, as the xxhash
 * package's build does: a wheel must not assume the build machine's ISA. */
#include "xxhash.h"
#include "xxh_x86dispatch.h"
#else
#define XXH_INLINE_ALL
#include "xxhash.h"
#endif

#define KEY_BYTES 8
#define CHECKSUM_BYTES 8
/* Payloads at least this large are hashed and copied without the GIL, so
 * other reader threads (DataLoader threads, a prefetcher) run meanwhile. */
#define RELEASE_GIL_BYTES (64 * 1024)

/* Runs stmt, without the GIL where size is at least RELEASE_GIL_BYTES. */
#define RUN_SIZED(size, stmt)                   \
    do {                                        \
        if ((size) >= RELEASE_GIL_BYTES) {      \
            Py_BEGIN_ALLOW_THREADS              \
            stmt;                               \
            Py_END_ALLOW_THREADS                \
        } else {                                \
            stmt;                               \
        }                                       \
    } while (0)

/* A list of bools from count flags; NULL with an exception set. */
static PyObject *
bool_list(const char *flags, Py_ssize_t count)
{
    PyObject *out = PyList_New(count);
    if (out != NULL)
        for (Py_ssize_t i = 0; i < count; i++)
            PyList_SET_ITEM(out, i, PyBool_FromLong(flags[i]));
    return out;
}

PyDoc_STRVAR(sample_keys_doc,
"sample_keys(ids, /) -> list[bytes]\n\n"
"LMDB keys of a sequence of int ids.\n\n"
"Raises TypeError for an item that is not an integer and OverflowError for\n"
"one outside 0..2**64-1.");

static PyObject *
sample_keys(PyObject *module, PyObject *ids)
{
    PyObject *seq = PySequence_Fast(ids, "sample ids must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *keys = PyList_New(count);
    if (keys == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *index = PyNumber_Index(items[i]);
        if (index == NULL)
            goto fail;
        unsigned long long id = PyLong_AsUnsignedLongLong(index);
        Py_DECREF(index);
        if (id == (unsigned long long)-1 && PyErr_Occurred())
            goto fail;
        PyObject *key = PyBytes_FromStringAndSize(NULL, KEY_BYTES);
        if (key == NULL)
            goto fail;
        unsigned char *out = (unsigned char *)PyBytes_AS_STRING(key);
        for (int b = KEY_BYTES - 1; b >= 0; b--, id >>= 8)
            out[b] = (unsigned char)id;
        PyList_SET_ITEM(keys, i, key);
    }
    Py_DECREF(seq);
    return keys;
fail:
    Py_DECREF(seq);
    Py_XDECREF(keys);
    return NULL;
}

/* The copy is hashed, not the source: it is still in the CPU cache, while
 * the source is a page of the map that is read only this once. */
static int
copy_intact(char *target, const unsigned char *source, size_t size, int verify, uint64_t stored)
{
    memcpy(target, source, size);
    return !verify || XXH3_64bits(target, size) == stored;
}

/* Copies one value's payload into a new bytes object and checks it (when
 * verify). Returns the bytes, Py_None (new reference) when the value is
 * corrupt, or NULL with an exception set. */
static PyObject *
payload_copy(const unsigned char *value, Py_ssize_t length, int verify)
{
    if (length < CHECKSUM_BYTES)
        Py_RETURN_NONE;
    Py_ssize_t size = length - CHECKSUM_BYTES;
    PyObject *payload = PyBytes_FromStringAndSize(NULL, size);
    if (payload == NULL)
        return NULL;
    char *target = PyBytes_AS_STRING(payload);
    uint64_t stored = 0;
    for (int b = CHECKSUM_BYTES - 1; b >= 0; b--)
        stored = (stored << 8) | value[b];
    int intact;
    RUN_SIZED(size, intact = copy_intact(target, value + CHECKSUM_BYTES, (size_t)size, verify, stored));
    if (!intact) {
        Py_DECREF(payload);
        Py_RETURN_NONE;
    }
    return payload;
}

PyDoc_STRVAR(payload_copies_doc,
"payload_copies(values, verify, /) -> (list[bytes | None], absent, corrupt)\n\n"
"Payloads of cache values (buffers, or None for a key that was not found),\n"
"copied out of the map in order. A value shorter than its header, or with\n"
"verify one whose xxh3 differs from its header, becomes None and is counted\n"
"as corrupt; a None value stays None and is counted as absent.");

static PyObject *
payload_copies(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "payload_copies() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    int verify = PyObject_IsTrue(args[1]);
    if (verify < 0)
        return NULL;
    /* A tuple, not the caller's list: the GIL is released while large values
     * are copied, and a list could be resized meanwhile. */
    PyObject *seq = PySequence_Tuple(args[0]);
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *payloads = PyList_New(count);
    if (payloads == NULL)
        goto fail;
    Py_ssize_t absent = 0, corrupt = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *payload;
        if (items[i] == Py_None) {
            absent++;
            payload = Py_NewRef(Py_None);
        } else {
            Py_buffer view;
            if (PyObject_GetBuffer(items[i], &view, PyBUF_SIMPLE) < 0)
                goto fail;
            payload = payload_copy(view.buf, view.len, verify);
            PyBuffer_Release(&view);
            if (payload == NULL)
                goto fail;
            if (payload == Py_None)
                corrupt++;
        }
        PyList_SET_ITEM(payloads, i, payload);
    }
    Py_DECREF(seq);
    return Py_BuildValue("(Nnn)", payloads, absent, corrupt);
fail:
    Py_DECREF(seq);
    Py_XDECREF(payloads);
    return NULL;
}

/* Copies size bytes to target; their xxh3 when hash, else digest. */
static uint64_t
copy_hashed(unsigned char *target, const void *source, size_t size, int hash, uint64_t digest)
{
    memcpy(target, source, size);
    return hash ? XXH3_64bits(target, size) : digest;
}

PyDoc_STRVAR(encode_value_doc,
"encode_value(payload, digest=None, /) -> bytes\n\n"
"The cache value of a payload: its xxh3-64 (digest, when the caller has it)\n"
"little-endian, then the payload.");

static PyObject *
encode_value(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "encode_value() takes 1 or 2 arguments (%zd given)", nargs);
        return NULL;
    }
    int hash = nargs < 2 || args[1] == Py_None;
    uint64_t digest = 0;
    if (!hash) {
        digest = PyLong_AsUnsignedLongLong(args[1]);
        if (digest == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
    }
    Py_buffer payload;
    if (PyObject_GetBuffer(args[0], &payload, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *value = PyBytes_FromStringAndSize(NULL, payload.len + CHECKSUM_BYTES);
    if (value != NULL) {
        unsigned char *target = (unsigned char *)PyBytes_AS_STRING(value);
        size_t size = (size_t)payload.len;
        RUN_SIZED(size, digest = copy_hashed(target + CHECKSUM_BYTES, payload.buf, size, hash, digest));
        for (int b = 0; b < CHECKSUM_BYTES; b++, digest >>= 8)
            target[b] = (unsigned char)digest;
    }
    PyBuffer_Release(&payload);
    return value;
}

PyDoc_STRVAR(values_intact_doc,
"values_intact(values, /) -> list[bool]\n\n"
"Whether each cache value's payload matches the xxh3 in its header (a value\n"
"shorter than its header does not). The values of a batch are hashed\n"
"together without the GIL: a thread that checks what it received leaves\n"
"the event loop and the cache writer running meanwhile.");

static void
check_all(const Py_buffer *views, Py_ssize_t count, char *intact)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        const unsigned char *value = views[i].buf;
        Py_ssize_t length = views[i].len;
        if (length < CHECKSUM_BYTES) {
            intact[i] = 0;
            continue;
        }
        uint64_t stored = 0;
        for (int b = CHECKSUM_BYTES - 1; b >= 0; b--)
            stored = (stored << 8) | value[b];
        intact[i] = XXH3_64bits(value + CHECKSUM_BYTES, (size_t)(length - CHECKSUM_BYTES)) == stored;
    }
}

static PyObject *
values_intact(PyObject *module, PyObject *values)
{
    /* A tuple, as in payload_copies: the GIL is released while hashing. */
    PyObject *seq = PySequence_Tuple(values);
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(seq), held = 0, total = 0;
    Py_buffer *views = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    char *intact = PyMem_Malloc(count ? (size_t)count : 1);
    PyObject *out = NULL;
    if (views == NULL || intact == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, held), &views[held], PyBUF_SIMPLE) < 0)
            goto done;
        total += views[held].len;
    }
    RUN_SIZED(total, check_all(views, count, intact));
    out = bool_list(intact, count);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(intact);
    Py_DECREF(seq);
    return out;
}

PyDoc_STRVAR(payloads_into_doc,
"payloads_into(values, target, offsets, /) -> list[bool]\n\n"
"Copies each cache value's payload into the writable buffer target at\n"
"offsets[i] and checks it against the xxh3 in the value's header: whether\n"
"each is intact there. A value shorter than its header is not copied and is\n"
"not intact. The values of a call are copied and hashed together without\n"
"the GIL, so a daemon's event loop makes one call for a read's local hits.\n\n"
"Raises ValueError when a payload would end past the target, before\n"
"anything is copied.");

typedef struct {
    const unsigned char *value;
    Py_ssize_t length;
    Py_ssize_t offset;
} placed_value;

static void
copy_all_intact(char *target, const placed_value *values, Py_ssize_t count, char *intact)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        const unsigned char *value = values[i].value;
        if (values[i].length < CHECKSUM_BYTES) {
            intact[i] = 0;
            continue;
        }
        uint64_t stored = 0;
        for (int b = CHECKSUM_BYTES - 1; b >= 0; b--)
            stored = (stored << 8) | value[b];
        intact[i] = (char)copy_intact(target + values[i].offset, value + CHECKSUM_BYTES,
                                      (size_t)(values[i].length - CHECKSUM_BYTES), 1, stored);
    }
}

static PyObject *
payloads_into(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "payloads_into() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    /* Tuples, as in payload_copies: the GIL is released while copying. */
    PyObject *seq = PySequence_Tuple(args[0]);
    if (seq == NULL)
        return NULL;
    PyObject *where = PySequence_Tuple(args[2]);
    if (where == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(seq), held = 0, total = 0;
    PyObject *out = NULL;
    Py_buffer target = {0};
    int target_held = 0;
    Py_buffer *views = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    placed_value *values = PyMem_Calloc(count ? (size_t)count : 1, sizeof(placed_value));
    char *intact = PyMem_Malloc(count ? (size_t)count : 1);
    if (views == NULL || values == NULL || intact == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyTuple_GET_SIZE(where) != count) {
        PyErr_Format(PyExc_ValueError, "payloads_into(): %zd values but %zd offsets", count, PyTuple_GET_SIZE(where));
        goto done;
    }
    if (PyObject_GetBuffer(args[1], &target, PyBUF_WRITABLE) < 0)
        goto done;
    target_held = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t offset = PyNumber_AsSsize_t(PyTuple_GET_ITEM(where, i), PyExc_OverflowError);
        if (offset == -1 && PyErr_Occurred())
            goto done;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, i), &views[i], PyBUF_SIMPLE) < 0)
            goto done;
        held++;
        Py_ssize_t size = views[i].len > CHECKSUM_BYTES ? views[i].len - CHECKSUM_BYTES : 0;
        if (offset < 0 || offset > target.len || size > target.len - offset) {
            PyErr_Format(PyExc_ValueError, "payloads_into(): payload %zd of %zd bytes at offset %zd ends past the "
                         "target's %zd bytes", i, size, offset, target.len);
            goto done;
        }
        values[i] = (placed_value){views[i].buf, views[i].len, offset};
        total += size;
    }
    RUN_SIZED(total, copy_all_intact(target.buf, values, count, intact));
    out = bool_list(intact, count);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    if (target_held)
        PyBuffer_Release(&target);
    PyMem_Free(views);
    PyMem_Free(values);
    PyMem_Free(intact);
    Py_DECREF(seq);
    Py_DECREF(where);
    return out;
}

static PyMethodDef methods[] = {
    {"values_intact", values_intact, METH_O, values_intact_doc},
    {"sample_keys", sample_keys, METH_O, sample_keys_doc},
    {"payload_copies", (PyCFunction)(void (*)(void))payload_copies, METH_FASTCALL, payload_copies_doc},
    {"encode_value", (PyCFunction)(void (*)(void))encode_value, METH_FASTCALL, encode_value_doc},
    {"payloads_into", (PyCFunction)(void (*)(void))payloads_into, METH_FASTCALL, payloads_into_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef records_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dataquay.client.wire._records",
    .m_doc = "C loops over the key and value layouts of dataquay.client.wire.records.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__records(void)
{
    return PyModuleDef_Init(&records_module);
}
