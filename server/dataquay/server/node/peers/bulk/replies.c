/*
 * The asking end of a bulk READ, in C: the frames of a peer's reply received
 * straight into the places given for them, each payload's xxh3 checked there,
 * the whole reply without the GIL. In Python the loop around each payload's one
 * recvmsg (its header, the id's place, the hash, the books) cost as much CPU
 * as the kernel's copy out of the socket. The wire format and the Python twin
 * of this loop are in replies.py, beside it; the two answer alike.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#ifdef DATAQUAY_XXH_X86_DISPATCH
#include "xxhash.h"
#include "xxh_x86dispatch.h"
#else
#define XXH_INLINE_ALL
#include "xxhash.h"
#endif

/* Frame statuses and the frame header: [u8 status][u64 id][u64 length][u64 xxh3], little-endian. */
enum { FRAME_OK = 0, FRAME_MISSING = 1, FRAME_END = 2, FRAME_ERROR = 3 };
#define HEADER_BYTES 25

/* What became of each asked id. */
enum { NOT_SENT = 0, INTACT = 1, MISSING = 2, CORRUPT = 3 };

/* How a reply ended. */
enum { ENDED = 0, REFUSED = 1, UNASKED = 2, BAD_FRAME = 3, CLOSED = 4, TIMED_OUT = 5, FAILED = 6 };

typedef struct {
    int outcome;
    Py_ssize_t frames;
    uint64_t status, sample_id, length;
} Result;

static uint64_t
le64(const unsigned char *at)
{
    uint64_t out = 0;
    for (int b = 7; b >= 0; b--)
        out = (out << 8) | at[b];
    return out;
}

static int
past(double end)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9 > end;
}

/* Fills iov[0..count) from a blocking socket whose SO_RCVTIMEO bounds each
 * call: one recvmsg with MSG_WAITALL as a rule. Returns ENDED when filled,
 * else how it failed (errno kept in *error for FAILED). */
static int
receive_all(int fd, struct iovec *iov, int count, double end, int *error)
{
    while (count > 0 && iov[0].iov_len == 0) {
        iov++;
        count--;
    }
    while (count > 0) {
        struct msghdr message = {.msg_iov = iov, .msg_iovlen = (size_t)count};
        ssize_t got = recvmsg(fd, &message, MSG_WAITALL);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return TIMED_OUT;
            *error = errno;
            return FAILED;
        }
        if (got == 0)
            return CLOSED;
        size_t left = (size_t)got;
        while (count > 0 && left >= iov[0].iov_len) {
            left -= iov[0].iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov[0].iov_base = (char *)iov[0].iov_base + left;
            iov[0].iov_len -= left;
        }
        if (past(end))
            return TIMED_OUT;
    }
    return ENDED;
}

/* The index of id in the sorted ids, or -1. */
static Py_ssize_t
find(const uint64_t *ids, Py_ssize_t count, uint64_t id)
{
    Py_ssize_t low = 0, high = count;
    while (low < high) {
        Py_ssize_t mid = low + (high - low) / 2;
        if (ids[mid] < id)
            low = mid + 1;
        else
            high = mid;
    }
    return low < count && ids[low] == id ? low : -1;
}

static Result
receive(int fd, unsigned char *header, const uint64_t *ids, Py_ssize_t count, const Py_buffer *targets,
        uint64_t *digests, unsigned char *statuses, double end, int *error)
{
    Result result = {0};
    int ahead = 1; /* the header holds the next frame's */
    for (;;) {
        if (!ahead) {
            struct iovec next = {header, HEADER_BYTES};
            result.outcome = receive_all(fd, &next, 1, end, error);
            if (result.outcome != ENDED)
                return result;
        }
        ahead = 0;
        result.frames++;
        result.status = header[0];
        result.sample_id = le64(header + 1);
        result.length = le64(header + 9);
        uint64_t digest = le64(header + 17);
        if (result.status == FRAME_END) {
            result.outcome = ENDED;
            return result;
        }
        if (result.status == FRAME_ERROR) {
            result.outcome = REFUSED;
            return result;
        }
        Py_ssize_t at = find(ids, count, result.sample_id);
        if (at < 0 || statuses[at] != NOT_SENT) {
            result.outcome = UNASKED;
            return result;
        }
        if (result.status == FRAME_MISSING) {
            statuses[at] = MISSING;
            continue;
        }
        if (result.status != FRAME_OK || result.length != (uint64_t)targets[at].len) {
            result.outcome = BAD_FRAME;
            return result;
        }
        struct iovec into[2] = {{targets[at].buf, (size_t)targets[at].len}, {header, HEADER_BYTES}};
        result.outcome = receive_all(fd, into, 2, end, error);
        if (result.outcome != ENDED)
            return result;
        ahead = 1;
        digests[at] = digest;
        statuses[at] = XXH3_64bits(targets[at].buf, (size_t)targets[at].len) == digest ? INTACT : CORRUPT;
    }
}

PyDoc_STRVAR(receive_frames_doc,
"receive_frames(fd, header, ids, targets, digests, statuses, end, /)\n"
"    -> (outcome, frames, status, sample_id, length)\n\n"
"Receives a READ reply's frames on the blocking socket fd, the first one's\n"
"header already in header (25 bytes, writable: it holds each next one), until\n"
"END or the first frame that ends the reply otherwise. ids are the asked ids,\n"
"sorted and distinct (uint64); each OK frame's payload is received into the\n"
"target of its id, which must be exactly as long as the manifest says, and\n"
"its xxh3 checked there. digests (uint64) and statuses (uint8) are written per\n"
"id. end is time.monotonic()'s deadline. The last frame read is returned\n"
"with the outcome (its sample id is the gRPC code of an ERROR frame, and for\n"
"FAILED the length is the errno).");

static PyObject *
receive_frames(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "receive_frames() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(args[0]);
    if (fd < 0)
        return NULL;
    double end = PyFloat_AsDouble(args[6]);
    if (end == -1.0 && PyErr_Occurred())
        return NULL;
    Py_buffer header = {0}, ids = {0}, digests = {0}, statuses = {0};
    Py_buffer *targets = NULL;
    Py_ssize_t held = 0, count = 0;
    PyObject *seq = NULL, *out = NULL;
    if (PyObject_GetBuffer(args[1], &header, PyBUF_WRITABLE) < 0 ||
        PyObject_GetBuffer(args[2], &ids, PyBUF_SIMPLE) < 0 ||
        PyObject_GetBuffer(args[4], &digests, PyBUF_WRITABLE) < 0 ||
        PyObject_GetBuffer(args[5], &statuses, PyBUF_WRITABLE) < 0)
        goto done;
    count = ids.len / (Py_ssize_t)sizeof(uint64_t);
    if (header.len != HEADER_BYTES || ids.len % (Py_ssize_t)sizeof(uint64_t) ||
        digests.len != count * (Py_ssize_t)sizeof(uint64_t) || statuses.len != count) {
        PyErr_SetString(PyExc_ValueError, "receive_frames(): a 25-byte header, and ids, digests and statuses "
                                          "of one count (8, 8 and 1 bytes each)");
        goto done;
    }
    /* A tuple, not the caller's list: the GIL is released while receiving. */
    seq = PySequence_Tuple(args[3]);
    if (seq == NULL)
        goto done;
    if (PyTuple_GET_SIZE(seq) != count) {
        PyErr_SetString(PyExc_ValueError, "receive_frames(): one target per id");
        goto done;
    }
    targets = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    if (targets == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++)
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, held), &targets[held], PyBUF_WRITABLE) < 0)
            goto done;
    memset(statuses.buf, NOT_SENT, (size_t)count);
    int error = 0;
    Result result;
    Py_BEGIN_ALLOW_THREADS
    result = receive(fd, header.buf, ids.buf, count, targets, digests.buf, statuses.buf, end, &error);
    Py_END_ALLOW_THREADS
    if (result.outcome == FAILED)
        result.length = (uint64_t)error;
    out = Py_BuildValue("(inKKK)", result.outcome, result.frames, (unsigned long long)result.status,
                        (unsigned long long)result.sample_id, (unsigned long long)result.length);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&targets[i]);
    PyMem_Free(targets);
    Py_XDECREF(seq);
    if (header.obj)
        PyBuffer_Release(&header);
    if (ids.obj)
        PyBuffer_Release(&ids);
    if (digests.obj)
        PyBuffer_Release(&digests);
    if (statuses.obj)
        PyBuffer_Release(&statuses);
    return out;
}

static PyMethodDef methods[] = {
    {"receive_frames", (PyCFunction)(void (*)(void))receive_frames, METH_FASTCALL, receive_frames_doc},
    {NULL, NULL, 0, NULL},
};

static int
add_constants(PyObject *module)
{
    /* The Python side checks these against its own (replies.py). */
    return PyModule_AddIntConstant(module, "HEADER_BYTES", HEADER_BYTES) ||
           PyModule_AddIntConstant(module, "FRAME_OK", FRAME_OK) ||
           PyModule_AddIntConstant(module, "FRAME_MISSING", FRAME_MISSING) ||
           PyModule_AddIntConstant(module, "FRAME_END", FRAME_END) ||
           PyModule_AddIntConstant(module, "FRAME_ERROR", FRAME_ERROR);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, add_constants},
    {0, NULL},
};

static struct PyModuleDef replies_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dataquay.server._replies",
    .m_doc = "The asking end of a bulk READ's reply, in C (dataquay.server.node.peers.bulk.replies).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC
PyInit__replies(void)
{
    return PyModuleDef_Init(&replies_module);
}
