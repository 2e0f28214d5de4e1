/*
 * The coded-shuffling planner's loops (dataquay.server.node.exchange.coding)
 * in C: at 256 nodes a plan visits 10^5-10^6 tables, packets and DAG edges,
 * each a few columns or parts, which in Python bytecode costs seconds and in
 * numpy's sorts and gathers most of an epoch's tenth. Plain int64 arrays in,
 * results written into arrays the caller allocated, the GIL released
 * throughout. The same results as dataquay.server._coding_py, so that both
 * give the same packets (tests/test_coding.py runs both).
 *
 * One file per pass: greedy.c (UberShuffle's greedy), packets.c (packet_rows,
 * pick_bits), tables.c (table_hashes, set_numbers), dag.c (dag_edges); the
 * helpers they share in shared.c and here, the module in module.c.
 */
#ifndef DATAQUAY_CODING_H
#define DATAQUAY_CODING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Items a loop over hash-set lookups asks the memory of ahead of the one it is on. */
#define AHEAD 16

/* Set bits of a word: without the popcnt instruction (not in x86-64's
 * baseline) GCC's builtin is a call to a table-driven loop. */
static inline int64_t
popcount64(uint64_t x)
{
#ifdef __POPCNT__
    return __builtin_popcountll(x);
#else
    x -= (x >> 1) & 0x5555555555555555ull;
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
    return (int64_t)((x * 0x0101010101010101ull) >> 56);
#endif
}

/* Where `value` is in a[lo, end), sorted ascending, or -1: a binary search. */
static inline int64_t
find_sorted(const int64_t *a, int64_t lo, int64_t end, int64_t value)
{
    int64_t hi = end;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (a[mid] < value)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < end && a[lo] == value ? lo : -1;
}

/* shared.c */
int dq_coding_get_views(const char *name, PyObject *const *args, Py_ssize_t nargs, int expected, int writable,
                        Py_buffer *views);
PyObject *dq_coding_finish(int done, const char *error, Py_buffer *views, int count, PyObject *result);

/* The module's functions (METH_FASTCALL) and their docstrings. */
PyObject *dq_coding_greedy(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
extern const char dq_coding_greedy_doc[];
PyObject *dq_coding_packet_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
extern const char dq_coding_packet_rows_doc[];
PyObject *dq_coding_pick_bits(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
extern const char dq_coding_pick_bits_doc[];
PyObject *dq_coding_table_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
extern const char dq_coding_table_hashes_doc[];
PyObject *dq_coding_set_numbers(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
extern const char dq_coding_set_numbers_doc[];
PyObject *dq_coding_dag_edges(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
extern const char dq_coding_dag_edges_doc[];

#endif
