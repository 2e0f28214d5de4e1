/*
 * The coded-shuffling planner's loops (dataquay.server.node.exchange.coding)
 * in C: at 256 nodes a plan visits 10^5-10^6 tables, packets and DAG edges,
 * each a few columns or parts, which in Python bytecode costs seconds and in
 * numpy's sorts and gathers most of an epoch's tenth. Plain int64 arrays in,
 * results written into arrays the caller allocated, the GIL released
 * throughout. The same results as dataquay.server._coding_py, so that both
 * give the same packets (tests/test_coding.py runs both).
 *
 * UberShuffle's greedy: a table's columns are its members, in ascending node
 * order ("slots"): a column's count is 0 until a sample arrives in it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The greedy's arguments. */
#define NUM_ARRAYS 10
/* Sample ids per block that the greedy's pools are carved from. */
#define BLOCK (1 << 16)
/* Rows of a bitset matrix asked for ahead of a gather over it. */
#define PREFETCH 16
/* Items a loop over hash-set lookups asks the memory of ahead of the one it is on. */
#define AHEAD 16
/* Parents of more members than this are first looked up by their halves (dag_edges). */
#define HALVES_FROM 8
/* Parents whose lookups dag_edges makes at a time: their few MB stay in the caches. */
#define CHUNK 4096
#define EVEN_BITS 0x5555555555555555ull

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

typedef struct {
    int64_t *ids;   /* NULL: still the group's run of `order` */
    int64_t len, cap;
} Pool;

typedef struct {
    const uint64_t *keys;
    int64_t tables, words;
    const int64_t *table_start, *decoder, *count, *order, *starts, *parent, *member, *child;
    int64_t groups, num_order, edges, num_out;
    int64_t *out;
    /* built here */
    int64_t *slot_start, *slot_node, *cnt, *rows0, *pool_lo;
    Pool *pools;
    int64_t *targets, *moved;   /* (parent slot, child slot, child table); moved has a count too */
    int64_t moved_cap;
    int64_t **blocks, num_blocks;   /* the pools' arrays, carved from blocks freed together */
    int64_t *block_next, *block_end;
    const char *error;
} Greedy;

static int64_t
find_slot(const Greedy *g, int64_t table, int64_t node)
{
    int64_t lo = g->slot_start[table], hi = g->slot_start[table + 1];
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (g->slot_node[mid] < node)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < g->slot_start[table + 1] && g->slot_node[lo] == node ? lo : -1;
}

/* The slots of the tables that edges name (the others keep their samples):
 * at 256 nodes and a fifth of the data in each cache, Lee's tables have some
 * 50 members each, and a slot for every member of all of them would take
 * gigabytes where the greedy has nothing to move. */
static int
build_slots(Greedy *g)
{
    int64_t t, w, k, slots = 0;
    char *touched = calloc(g->tables + 1, 1);
    g->slot_start = malloc((g->tables + 1) * sizeof(int64_t));
    g->rows0 = calloc(g->tables + 1, sizeof(int64_t));
    if (!touched || !g->slot_start || !g->rows0) {
        free(touched);
        return -1;
    }
    for (k = 0; k < g->edges; k++) {
        if (g->parent[k] < 0 || g->parent[k] >= g->tables || g->child[k] < 0 || g->child[k] >= g->tables) {
            free(touched);
            g->error = "an edge's parent or child is not a table";
            return 0;
        }
        touched[g->parent[k]] = touched[g->child[k]] = 1;
    }
    for (t = 0; t < g->tables; t++) {
        g->slot_start[t] = slots;
        for (w = 0; touched[t] && w < g->words; w++)
            slots += popcount64(g->keys[t * g->words + w]);
    }
    g->slot_start[g->tables] = slots;
    free(touched);
    g->slot_node = malloc((slots + 1) * sizeof(int64_t));
    g->cnt = calloc(slots + 1, sizeof(int64_t));
    g->pool_lo = calloc(slots + 1, sizeof(int64_t));
    g->pools = calloc(slots + 1, sizeof(Pool));
    if (!g->slot_node || !g->cnt || !g->pool_lo || !g->pools)
        return -1;
    for (t = 0; t < g->tables; t++) {
        int64_t s = g->slot_start[t];
        for (w = 0; s < g->slot_start[t + 1] && w < g->words; w++) {
            uint64_t bits = g->keys[t * g->words + w];
            while (bits) {
                g->slot_node[s++] = w * 64 + __builtin_ctzll(bits);
                bits &= bits - 1;
            }
        }
    }
    for (t = 0; t < g->tables; t++) {
        if (g->table_start[t] < 0 || g->table_start[t] > g->table_start[t + 1] || g->table_start[t + 1] > g->groups) {
            g->error = "table_start is not ascending within the groups";
            return 0;
        }
        if (g->slot_start[t] == g->slot_start[t + 1])
            continue;
        for (k = g->table_start[t]; k < g->table_start[t + 1]; k++) {
            int64_t s = find_slot(g, t, g->decoder[k]);
            if (s < 0) {
                g->error = "a group's decoder is not a member of its table";
                return 0;
            }
            if (g->count[k] < 1 || g->starts[k] < 0 || g->starts[k] > g->num_order - g->count[k]) {
                g->error = "a group's run is outside order";
                return 0;
            }
            g->cnt[s] = g->count[k];
            g->pool_lo[s] = g->starts[k];
            g->pools[s].len = g->count[k];
            if (g->count[k] > g->rows0[t])
                g->rows0[t] = g->count[k];
        }
    }
    return 1;
}

/* The pool of slot s as its own array, with room for `more` ids. */
static int
pool_reserve(Greedy *g, int64_t s, int64_t more)
{
    Pool *p = &g->pools[s];
    if (p->ids && p->len + more <= p->cap)
        return 1;
    int64_t cap = p->len + more < 8 ? 8 : 2 * (p->len + more);
    if (g->block_end - g->block_next < cap) {
        int64_t size = cap > BLOCK ? cap : BLOCK;
        int64_t **blocks = realloc(g->blocks, (g->num_blocks + 1) * sizeof(int64_t *));
        if (!blocks)
            return -1;
        g->blocks = blocks;
        if (!(g->blocks[g->num_blocks] = malloc(size * sizeof(int64_t))))
            return -1;
        g->block_next = g->blocks[g->num_blocks++];
        g->block_end = g->block_next + size;
    }
    int64_t *ids = g->block_next;
    g->block_next += cap;
    memcpy(ids, p->ids ? p->ids : g->order + g->pool_lo[s], p->len * sizeof(int64_t));
    p->ids = ids;
    p->cap = cap;
    return 1;
}

/* Moves the last `count` ids of slot src's pool to the end of slot dst's,
 * of table `table`: their table in out until a later move takes them on. */
static int
move_tail(Greedy *g, int64_t src, int64_t dst, int64_t count, int64_t table)
{
    if (count > g->pools[src].len) {
        g->error = "a move takes more samples than its column holds";
        return 0;
    }
    if (pool_reserve(g, src, 0) < 0 || pool_reserve(g, dst, count) < 0)
        return -1;
    Pool *from = &g->pools[src], *to = &g->pools[dst];
    memcpy(to->ids + to->len, from->ids + from->len - count, count * sizeof(int64_t));
    for (int64_t i = to->len; i < to->len + count; i++) {
        if (to->ids[i] < 0 || to->ids[i] >= g->num_out) {
            g->error = "order names a sample outside out";
            return 0;
        }
        g->out[to->ids[i]] = table;
    }
    to->len += count;
    from->len -= count;
    return 1;
}

/* Is some column of the child's slots [lo, hi) but `skip` no fuller than `held`? */
static int
short_of_full(const Greedy *g, int64_t lo, int64_t hi, int64_t skip, int64_t held)
{
    for (int64_t u = lo; u < hi; u++)
        if (u != skip && g->cnt[u] <= held)
            return 1;
    return 0;
}

/* _reduce_table of coding_py for the parent of edges [lo, hi); its moves applied to the pools. */
static int
reduce_table(Greedy *g, int64_t lo, int64_t hi)
{
    int64_t p = g->parent[lo], s, k, m, rows = 0, nmoved = 0;
    int64_t first = g->slot_start[p], last = g->slot_start[p + 1];
    int64_t need = 4 * (last - first) * (hi - lo);
    if (need > g->moved_cap) {
        int64_t *moved = realloc(g->moved, need * sizeof(int64_t));
        int64_t *targets = realloc(g->targets, 3 * (last - first) * (hi - lo) * sizeof(int64_t) + 3);
        if (moved)
            g->moved = moved;
        if (targets)
            g->targets = targets;
        if (!moved || !targets)
            return -1;
        g->moved_cap = need;
    }
    for (s = first; s < last; s++)
        if (g->cnt[s] > rows)
            rows = g->cnt[s];
    while (rows) {
        int64_t nt = 0, stuck = 0;
        for (s = first; s < last && !stuck; s++) {
            if (g->cnt[s] != rows)
                continue;
            int64_t column = g->slot_node[s], best = -1, best_table = -1, best_short = 0, best_gap = 0;
            for (k = lo; k < hi; k++) {
                int64_t c = g->child[k];
                if (g->member[k] == column)
                    continue;
                int64_t cs = find_slot(g, c, column);
                if (cs < 0) {
                    g->error = "a child lacks a member of its parent other than the one left out";
                    return 0;
                }
                int64_t held = g->cnt[cs], gap = g->rows0[c] - held;
                if (gap <= 0)
                    continue;
                int64_t is_short = short_of_full(g, g->slot_start[c], g->slot_start[c + 1], cs, held);
                if (is_short > best_short || (is_short == best_short && gap > best_gap)) {
                    best_short = is_short;
                    best_gap = gap;
                    best = cs;
                    best_table = c;
                }
            }
            if (best < 0)
                stuck = 1;
            else {
                g->targets[3 * nt] = s;
                g->targets[3 * nt + 1] = best;
                g->targets[3 * nt + 2] = best_table;
                nt++;
            }
        }
        if (stuck)
            break;
        for (int64_t i = 0; i < nt; i++) {
            int64_t from = g->targets[3 * i], to = g->targets[3 * i + 1];
            g->cnt[from]--;
            g->cnt[to]++;
            for (m = 0; m < nmoved; m++)
                if (g->moved[4 * m] == from && g->moved[4 * m + 1] == to)
                    break;
            if (m == nmoved) {
                g->moved[4 * m] = from;
                g->moved[4 * m + 1] = to;
                g->moved[4 * m + 2] = 0;
                g->moved[4 * m + 3] = g->targets[3 * i + 2];
                nmoved++;
            }
            g->moved[4 * m + 2]++;
        }
        rows--;
    }
    for (m = 0; m < nmoved; m++) {
        int done = move_tail(g, g->moved[4 * m], g->moved[4 * m + 1], g->moved[4 * m + 2], g->moved[4 * m + 3]);
        if (done <= 0)
            return done;
    }
    return 1;
}

static int
run(Greedy *g)
{
    int done = build_slots(g);
    if (done <= 0)
        return done;
    for (int64_t lo = 0, hi; lo < g->edges; lo = hi) {
        for (hi = lo + 1; hi < g->edges && g->parent[hi] == g->parent[lo]; hi++)
            ;
        done = reduce_table(g, lo, hi);
        if (done <= 0)
            return done;
    }
    return 1;
}

static void
release(Greedy *g)
{
    for (int64_t k = 0; k < g->num_blocks; k++)
        free(g->blocks[k]);
    free(g->blocks);
    free(g->pools);
    free(g->slot_start);
    free(g->slot_node);
    free(g->cnt);
    free(g->rows0);
    free(g->pool_lo);
    free(g->targets);
    free(g->moved);
}

static int
is_int64(const Py_buffer *view)
{
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    return view->itemsize == 8 && f[0] && !f[1] && strchr("qQlL", f[0]) != NULL;
}

/* Takes the buffers of args[0..nargs) (those from `writable` on writable),
 * each C-contiguous 64-bit integers; on failure sets the error and releases
 * what it took. */
static int
get_views(const char *name, PyObject *const *args, Py_ssize_t nargs, int expected, int writable, Py_buffer *views)
{
    int got = 0;
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s takes %d arrays, not %zd", name, expected, nargs);
        return -1;
    }
    for (; got < expected; got++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (got >= writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(args[got], &views[got], flags) < 0)
            break;
        if (!is_int64(&views[got])) {
            PyErr_Format(PyExc_ValueError, "%s's array %d is not of 64-bit integers", name, got);
            got++;
            break;
        }
    }
    if (got == expected && !PyErr_Occurred())
        return 0;
    while (got--)
        PyBuffer_Release(&views[got]);
    return -1;
}

static void
release_views(Py_buffer *views, int count)
{
    while (count--)
        PyBuffer_Release(&views[count]);
}

/* Sets the error of a run: -1 out of memory, 0 the message, 1 none. */
static PyObject *
finish(int done, const char *error, Py_buffer *views, int count, PyObject *result)
{
    release_views(views, count);
    if (done < 0)
        PyErr_NoMemory();
    else if (!done)
        PyErr_SetString(PyExc_ValueError, error);
    if (done <= 0) {
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}

PyDoc_STRVAR(greedy_doc,
"greedy(keys, table_start, decoders, counts, order, starts, parents, members, children, out, /) -> None\n\n"
"UberShuffle's moves of rows down the table DAG, applied to ``out`` (each\n"
"needed sample's table, on entry Lee et al.'s): see dataquay.server._coding_py.greedy.\n\n"
"Raises ValueError for arrays that are not int64 (keys: uint64) or that\n"
"contradict each other.");

static PyObject *
greedy(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[NUM_ARRAYS];
    int done = 0;
    Greedy g;
    memset(&g, 0, sizeof(g));
    if (get_views("greedy", args, nargs, NUM_ARRAYS, NUM_ARRAYS - 1, views) < 0)
        return NULL;
    g.keys = views[0].buf;
    g.table_start = views[1].buf;
    g.decoder = views[2].buf;
    g.count = views[3].buf;
    g.order = views[4].buf;
    g.starts = views[5].buf;
    g.parent = views[6].buf;
    g.member = views[7].buf;
    g.child = views[8].buf;
    g.out = views[9].buf;
    g.tables = views[1].len / 8 - 1;
    g.groups = views[2].len / 8;
    g.num_order = views[4].len / 8;
    g.edges = views[6].len / 8;
    g.num_out = views[9].len / 8;
    if (g.tables < 0 || views[3].len != views[2].len || views[5].len != views[2].len || views[7].len != views[6].len
        || views[8].len != views[6].len || views[0].ndim != 2 || views[0].shape[0] != g.tables) {
        g.error = "greedy's arrays disagree on the numbers of tables, groups or edges";
    } else {
        g.words = views[0].shape[1];
        Py_BEGIN_ALLOW_THREADS
        done = run(&g);
        Py_END_ALLOW_THREADS
    }
    release(&g);
    return finish(done, g.error, views, NUM_ARRAYS, Py_NewRef(Py_None));
}

/* A needed sample as its table's rows order it: by column, largest first, then by id. */
typedef struct {
    int64_t decoder, size, index;
} Part;

static int
part_before(const Part *a, const Part *b)
{
    if (a->decoder != b->decoder)
        return a->decoder < b->decoder;
    if (a->size != b->size)
        return a->size > b->size;
    return a->index < b->index;
}

static int
compare_parts(const void *a, const void *b)
{
    return part_before(a, b) ? -1 : part_before(b, a) ? 1 : 0;
}

static void
sort_parts(Part *parts, int64_t n)
{
    if (n > 24) {
        qsort(parts, n, sizeof(Part), compare_parts);
        return;
    }
    for (int64_t i = 1; i < n; i++) {
        Part p = parts[i];
        int64_t j = i;
        for (; j > 0 && part_before(&p, &parts[j - 1]); j--)
            parts[j] = parts[j - 1];
        parts[j] = p;
    }
}

/* packet_rows: a counting sort by table, each table's parts sorted by column,
 * then its rows dealt out: row r takes the r-th part of every column that has one. */
static int
packet_rows_run(const int64_t *tables, const int64_t *decoders, const int64_t *sizes, int64_t n, int64_t *parts,
                int64_t *start, int64_t *packets, const char **error)
{
    int64_t i, t, num_tables = 0, widest = 0, p = 0, k = 0;
    for (i = 0; i < n; i++) {
        if (tables[i] < 0) {
            *error = "a table number is negative";
            return 0;
        }
        if (tables[i] >= num_tables)
            num_tables = tables[i] + 1;
    }
    int64_t *table_start = calloc(num_tables + 1, sizeof(int64_t));
    if (!table_start)
        return -1;
    for (i = 0; i < n; i++)
        table_start[tables[i] + 1]++;
    for (t = 0; t < num_tables; t++) {
        if (table_start[t + 1] > widest)
            widest = table_start[t + 1];
        table_start[t + 1] += table_start[t];
    }
    int64_t *fill = malloc((num_tables + 1) * sizeof(int64_t)), *order = malloc((n + 1) * sizeof(int64_t));
    Part *buffer = malloc((widest + 1) * sizeof(Part));
    int64_t *runs = malloc(2 * (widest + 1) * sizeof(int64_t));
    if (!fill || !order || !buffer || !runs) {
        free(table_start);
        free(fill);
        free(order);
        free(buffer);
        free(runs);
        return -1;
    }
    memcpy(fill, table_start, num_tables * sizeof(int64_t));
    for (i = 0; i < n; i++)
        order[fill[tables[i]]++] = i;
    for (t = 0; t < num_tables; t++) {
        int64_t lo = table_start[t], hi = table_start[t + 1], nruns = 0, row;
        if (hi - lo > 1) {
            for (i = lo; i < hi; i++) {
                buffer[i - lo].decoder = decoders[order[i]];
                buffer[i - lo].size = sizes[order[i]];
                buffer[i - lo].index = order[i];
            }
            sort_parts(buffer, hi - lo);
            for (i = lo; i < hi; i++)
                order[i] = buffer[i - lo].index;
        }
        for (i = lo; i < hi; i++) {
            if (i == lo || decoders[order[i]] != decoders[order[i - 1]]) {
                runs[2 * nruns] = i;
                runs[2 * nruns + 1] = 0;
                nruns++;
            }
            runs[2 * nruns - 1]++;
        }
        for (row = 0; nruns; row++) {
            int64_t kept = 0;
            start[p++] = k;
            for (i = 0; i < nruns; i++) {
                parts[k++] = order[runs[2 * i] + row];
                if (runs[2 * i + 1] > row + 1) {
                    runs[2 * kept] = runs[2 * i];
                    runs[2 * kept + 1] = runs[2 * i + 1];
                    kept++;
                }
            }
            nruns = kept;
        }
    }
    start[p] = k;
    *packets = p;
    free(table_start);
    free(fill);
    free(order);
    free(buffer);
    free(runs);
    return 1;
}

PyDoc_STRVAR(packet_rows_doc,
"packet_rows(tables, decoders, sizes, parts, start, /) -> int\n\n"
"The packets of the needed samples' tables: see dataquay.server._coding_py.packet_rows.\n\n"
"Raises ValueError for arrays that are not int64 or of lengths that disagree.");

static PyObject *
packet_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[5];
    int64_t packets = 0;
    const char *error = NULL;
    int done = 0;
    if (get_views("packet_rows", args, nargs, 5, 3, views) < 0)
        return NULL;
    int64_t n = views[0].len / 8;
    if (views[1].len != views[0].len || views[2].len != views[0].len || views[3].len != views[0].len
        || views[4].len != views[0].len + 8) {
        error = "packet_rows' arrays disagree on the number of samples";
    } else {
        Py_BEGIN_ALLOW_THREADS
        done = packet_rows_run(views[0].buf, views[1].buf, views[2].buf, n, views[3].buf, views[4].buf, &packets,
                               &error);
        Py_END_ALLOW_THREADS
    }
    return finish(done, error, views, 5, done > 0 ? PyLong_FromLongLong(packets) : NULL);
}

/* The rank-th (from 0) set bit of a word that has more. */
static int64_t
select_bit(uint64_t word, int64_t rank)
{
    int64_t position = 0;
    for (int64_t below; rank >= (below = popcount64(word & 0xff)); word >>= 8, position += 8)
        rank -= below;
    while (rank--)
        word &= word - 1;
    return position + __builtin_ctzll(word);
}

static int
pick_bits_run(const uint64_t *holders, int64_t rows, int64_t words, const int64_t *start, int64_t groups,
              const int64_t *samples, int64_t num_samples, const int64_t *spread, int64_t *out, const char **error)
{
    uint64_t *whole = malloc((words + 1) * sizeof(uint64_t));
    if (!whole)
        return -1;
    for (int64_t g = 0; g < groups; g++) {
        int64_t count = 0, w, k;
        if (start[g] < 0 || start[g] >= start[g + 1] || start[g + 1] > num_samples || spread[g] < 0) {
            *error = "a group is empty, outside samples, or its spread negative";
            free(whole);
            return 0;
        }
        for (w = 0; w < words; w++)
            whole[w] = ~(uint64_t)0;
        for (k = start[g]; k < start[g + 1]; k++) {
            /* The parts' rows lie all over holders: ask for those a few groups on meanwhile. */
            if (k + PREFETCH < num_samples && samples[k + PREFETCH] >= 0 && samples[k + PREFETCH] < rows)
                __builtin_prefetch(holders + samples[k + PREFETCH] * words);
            if (samples[k] < 0 || samples[k] >= rows) {
                *error = "a sample is outside holders";
                free(whole);
                return 0;
            }
            const uint64_t *row = holders + samples[k] * words;
            for (w = 0; w < words; w++)
                whole[w] &= row[w];
        }
        for (w = 0; w < words; w++)
            count += popcount64(whole[w]);
        if (!count) {
            out[g] = -1;
            continue;
        }
        int64_t rank = spread[g] % count;
        for (w = 0; rank >= popcount64(whole[w]); w++)
            rank -= popcount64(whole[w]);
        out[g] = w * 64 + select_bit(whole[w], rank);
    }
    free(whole);
    return 1;
}

PyDoc_STRVAR(pick_bits_doc,
"pick_bits(holders, start, samples, spread, out, /) -> None\n\n"
"A node that caches every sample of each group: see dataquay.server._coding_py.pick_bits.\n\n"
"Raises ValueError for arrays that are not int64 (holders: uint64) or that\n"
"contradict each other.");

static PyObject *
pick_bits(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[5];
    const char *error = NULL;
    int done = 0;
    if (get_views("pick_bits", args, nargs, 5, 4, views) < 0)
        return NULL;
    int64_t groups = views[4].len / 8;
    if (views[0].ndim != 2 || views[1].len != views[4].len + 8 || views[3].len != views[4].len) {
        error = "pick_bits' arrays disagree on the number of groups, or holders is not a matrix";
    } else {
        Py_BEGIN_ALLOW_THREADS
        done = pick_bits_run(views[0].buf, views[0].shape[0], views[0].shape[1], views[1].buf, groups, views[2].buf,
                             views[2].len / 8, views[3].buf, views[4].buf, &error);
        Py_END_ALLOW_THREADS
    }
    return finish(done, error, views, 5, Py_NewRef(Py_None));
}

static int
table_hashes_run(const uint64_t *holders, int64_t rows, int64_t words, const int64_t *samples,
                 const int64_t *decoders, int64_t n, const int64_t *lookup, int64_t *out, const char **error)
{
    uint64_t *key = malloc((words + 1) * sizeof(uint64_t));
    if (!key)
        return -1;
    for (int64_t i = 0; i < n; i++) {
        if (samples[i] < 0 || samples[i] >= rows || decoders[i] >= words * 64) {
            *error = "a sample is outside holders or a decoder outside its bitset";
            free(key);
            return 0;
        }
        for (int64_t w = 0; w < words; w++)
            key[w] = holders[samples[i] * words + w];
        if (decoders[i] >= 0)
            key[decoders[i] / 64] |= (uint64_t)1 << (decoders[i] % 64);
        int64_t hash = 0;
        const unsigned char *bytes = (const unsigned char *)key;
        for (int64_t b = 0; b < words * 8; b++)
            if (bytes[b])
                hash ^= lookup[b * 256 + bytes[b]];
        out[i] = hash;
    }
    free(key);
    return 1;
}

PyDoc_STRVAR(table_hashes_doc,
"table_hashes(holders, samples, decoders, lookup, out, /) -> None\n\n"
"The set hash of each sample's table: see dataquay.server._coding_py.table_hashes.\n\n"
"Raises ValueError for arrays that are not int64 (holders: uint64) or that\n"
"contradict each other.");

static PyObject *
table_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[5];
    const char *error = NULL;
    int done = 0;
    if (get_views("table_hashes", args, nargs, 5, 4, views) < 0)
        return NULL;
    if (views[0].ndim != 2 || views[1].len != views[2].len || views[4].len != views[1].len
        || views[3].len != views[0].shape[1] * 8 * 256 * 8) {
        error = "table_hashes' arrays disagree on the number of samples or of bitset bytes";
    } else {
        Py_BEGIN_ALLOW_THREADS
        done = table_hashes_run(views[0].buf, views[0].shape[0], views[0].shape[1], views[1].buf, views[2].buf,
                                views[1].len / 8, views[3].buf, views[4].buf, &error);
        Py_END_ALLOW_THREADS
    }
    return finish(done, error, views, 5, Py_NewRef(Py_None));
}

/* set_numbers: each needed sample's table key, holders[sample] with its
 * decoder's bit, in the order of the key's bytes (memcmp, as numpy's unique
 * over the rows' bytes orders them). */
typedef struct {
    const uint64_t *holders;
    int64_t rows, words;
    const int64_t *samples, *decoders;
} Keys;

static void
key_of(const Keys *k, int64_t i, uint64_t *key)
{
    const uint64_t *row = k->holders + k->samples[i] * k->words;
    for (int64_t w = 0; w < k->words; w++)   /* a few words: a loop, not a call to memcpy */
        key[w] = row[w];
    if (k->decoders[i] >= 0)
        key[k->decoders[i] / 64] |= (uint64_t)1 << (k->decoders[i] % 64);
}

/* A 64-bit number that orders keys as their bytes do, ties left for a full
 * comparison: a key's bytes compare by the first member of their symmetric
 * difference in the order byte by byte, highest bit first; the key that holds
 * it is the larger. So each member m counts as 64 * words - (its position in
 * that order), the first few such numbers packed from the top, and a key
 * that runs out packs zeros. One word of bits: its bytes big-endian, exact. */
static uint64_t
order_prefix(const Keys *k, int64_t i)
{
    const uint64_t *row = k->holders + k->samples[i] * k->words;
    int64_t words = k->words, decoder = k->decoders[i];
    if (words == 1)
        return __builtin_bswap64(row[0] | (decoder >= 0 ? (uint64_t)1 << decoder : 0));
    int64_t width = 64 - __builtin_clzll((uint64_t)(64 * words)), room = 64 / width, packed = 0;
    uint64_t prefix = 0;
    for (int64_t w = 0; w < words && packed < room; w++) {
        uint64_t x = row[w] | (decoder >= 0 && decoder / 64 == w ? (uint64_t)1 << (decoder % 64) : 0);
        /* Each byte's bits reversed: the lowest set bit is then the member that comes first. */
        x = ((x >> 1) & 0x5555555555555555ull) | ((x & 0x5555555555555555ull) << 1);
        x = ((x >> 2) & 0x3333333333333333ull) | ((x & 0x3333333333333333ull) << 2);
        x = ((x >> 4) & 0x0F0F0F0F0F0F0F0Full) | ((x & 0x0F0F0F0F0F0F0F0Full) << 4);
        for (; x && packed < room; x &= x - 1, packed++)
            prefix = prefix << width | (uint64_t)(64 * words - (64 * w + __builtin_ctzll(x)));
    }
    return prefix << (width * (room - packed));
}

/* The order of two keys' bytes (memcmp's): their words compared big-endian. */
static int
compare_rows(const uint64_t *a, const uint64_t *b, int64_t words)
{
    for (int64_t w = 0; w < words; w++)
        if (a[w] != b[w])
            return __builtin_bswap64(a[w]) < __builtin_bswap64(b[w]) ? -1 : 1;
    return 0;
}

/* Sorts positions by the rows they name, stably. */
static void
sort_positions(int64_t *at, int64_t *scratch, int64_t n, const uint64_t *rows, int64_t words)
{
    if (n < 2)
        return;
    int64_t half = n / 2, i = 0, j = half, o = 0;
    sort_positions(at, scratch, half, rows, words);
    sort_positions(at + half, scratch, n - half, rows, words);
    while (i < half && j < n)
        scratch[o++] = compare_rows(rows + at[j] * words, rows + at[i] * words, words) < 0 ? at[j++] : at[i++];
    while (i < half)
        scratch[o++] = at[i++];
    while (j < n)
        scratch[o++] = at[j++];
    memcpy(at, scratch, n * sizeof(int64_t));
}

/* Sorts n rows, and their ids along, by their bytes, stably. */
static int
sort_rows(uint64_t *rows, int64_t *ids, int64_t n, int64_t words)
{
    int64_t *at = malloc(n * sizeof(int64_t)), *scratch = malloc(n * sizeof(int64_t));
    int64_t *ids_copy = malloc(n * sizeof(int64_t));
    uint64_t *rows_copy = malloc(n * words * sizeof(uint64_t));
    int done = at && scratch && ids_copy && rows_copy ? 1 : -1;
    if (done > 0) {
        for (int64_t i = 0; i < n; i++)
            at[i] = i;
        sort_positions(at, scratch, n, rows, words);
        memcpy(ids_copy, ids, n * sizeof(int64_t));
        memcpy(rows_copy, rows, n * words * sizeof(uint64_t));
        for (int64_t i = 0; i < n; i++) {
            ids[i] = ids_copy[at[i]];
            memcpy(rows + i * words, rows_copy + at[i] * words, words * sizeof(uint64_t));
        }
    }
    free(at);
    free(scratch);
    free(ids_copy);
    free(rows_copy);
    return done;
}

/* Sorts ids by prefix, 11 bits a pass from the least significant, stably;
 * the sorted arrays end in *prefix and *ids (either buffer of each pair). */
static int
radix_sort(uint64_t **prefix, int64_t **ids, uint64_t **prefix_tmp, int64_t **ids_tmp, int64_t n)
{
    enum { BITS = 11, DIGITS = 1 << BITS, PASSES = (64 + BITS - 1) / BITS };
    int64_t (*count)[DIGITS] = calloc(PASSES, sizeof(*count));
    if (!count)
        return -1;
    for (int64_t i = 0; i < n; i++)
        for (int pass = 0; pass < PASSES; pass++)
            count[pass][(*prefix)[i] >> (BITS * pass) & (DIGITS - 1)]++;
    for (int pass = 0; pass < PASSES; pass++) {
        int shift = BITS * pass;
        int64_t *at = count[pass], sum = 0;
        if (at[(*prefix)[0] >> shift & (DIGITS - 1)] == n)
            continue;
        for (int d = 0; d < DIGITS; d++) {
            int64_t c = at[d];
            at[d] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; i++) {
            int64_t to = at[(*prefix)[i] >> shift & (DIGITS - 1)]++;
            (*prefix_tmp)[to] = (*prefix)[i];
            (*ids_tmp)[to] = (*ids)[i];
        }
        uint64_t *p = *prefix;
        int64_t *q = *ids;
        *prefix = *prefix_tmp;
        *ids = *ids_tmp;
        *prefix_tmp = p;
        *ids_tmp = q;
    }
    free(count);
    return 1;
}

/* Sorts ids by their decoders, stably. */
static void
sort_by_decoder(int64_t *ids, int64_t *scratch, int64_t n, const int64_t *decoders)
{
    if (n <= 32) {
        for (int64_t i = 1; i < n; i++) {
            int64_t id = ids[i], j = i;
            for (; j > 0 && decoders[ids[j - 1]] > decoders[id]; j--)
                ids[j] = ids[j - 1];
            ids[j] = id;
        }
        return;
    }
    int64_t half = n / 2, i = 0, j = half, o = 0;
    sort_by_decoder(ids, scratch, half, decoders);
    sort_by_decoder(ids + half, scratch, n - half, decoders);
    while (i < half && j < n)
        scratch[o++] = decoders[ids[j]] < decoders[ids[i]] ? ids[j++] : ids[i++];
    while (i < half)
        scratch[o++] = ids[i++];
    while (j < n)
        scratch[o++] = ids[j++];
    memcpy(ids, scratch, n * sizeof(int64_t));
}

static int
set_numbers_run(const Keys *k, int64_t n, int64_t *out, uint64_t *keys_out, int64_t *order, int64_t *tables,
                const char **error)
{
    int64_t i, lo, hi, number = -1, words = k->words;
    uint64_t *prefix = malloc((n + 1) * sizeof(uint64_t)), *prefix_tmp = malloc((n + 1) * sizeof(uint64_t));
    int64_t *ids = malloc((n + 1) * sizeof(int64_t)), *ids_tmp = malloc((n + 1) * sizeof(int64_t));
    int done = 1;
    if (!prefix || !prefix_tmp || !ids || !ids_tmp) {
        done = -1;
        goto out;
    }
    for (i = 0; i < n; i++) {
        if (k->samples[i] < 0 || k->samples[i] >= k->rows || k->decoders[i] >= words * 64) {
            *error = "a sample is outside holders or a decoder outside its bitset";
            done = 0;
            goto out;
        }
        prefix[i] = order_prefix(k, i);
        ids[i] = i;
    }
    if (n && radix_sort(&prefix, &ids, &prefix_tmp, &ids_tmp, n) < 0) {
        done = -1;
        goto out;
    }
    /* The keys in sorted order, into keys_out: the samples' rows lie all
     * over holders, so each is asked for ahead, after its sample's id. */
    for (i = 0; i < n; i++) {
        if (i + 4 * AHEAD < n) {
            __builtin_prefetch(&k->samples[ids[i + 4 * AHEAD]]);
            __builtin_prefetch(&k->decoders[ids[i + 4 * AHEAD]]);
        }
        if (i + 2 * AHEAD < n)
            __builtin_prefetch(k->holders + k->samples[ids[i + 2 * AHEAD]] * words);
        key_of(k, ids[i], keys_out + i * words);
    }
    /* Runs of one prefix hold one table but where prefixes tie: those are
     * sorted bit for bit. Each table's key moves up to its number's row
     * (never past rows still to read), and its samples are sorted by
     * column for the greedy's groups (ids is by (table, id) already). */
    for (lo = 0; lo < n; lo = hi) {
        for (hi = lo + 1; hi < n && prefix[hi] == prefix[lo]; hi++)
            ;
        for (i = lo + 1; i < hi && !compare_rows(keys_out + lo * words, keys_out + i * words, words); i++)
            ;
        if (i < hi && sort_rows(keys_out + lo * words, ids + lo, hi - lo, words) < 0) {
            done = -1;
            goto out;
        }
        for (int64_t first = lo, end; first < hi; first = end) {
            for (end = first + 1;
                 end < hi && !compare_rows(keys_out + first * words, keys_out + end * words, words); end++)
                ;
            if (++number != first)
                memcpy(keys_out + number * words, keys_out + first * words, words * sizeof(uint64_t));
            for (i = first; i < end; i++)
                out[ids[i]] = number;
            sort_by_decoder(ids + first, ids_tmp, end - first, k->decoders);
        }
    }
    *tables = number + 1;
    memcpy(order, ids, n * sizeof(int64_t));
out:
    free(prefix);
    free(prefix_tmp);
    free(ids);
    free(ids_tmp);
    return done;
}

PyDoc_STRVAR(set_numbers_doc,
"set_numbers(holders, samples, decoders, out, keys, order, /) -> int\n\n"
"Each sample's table, numbered in the order of the tables' bytes, their bitsets\n"
"and the samples by table and column: see\n"
"dataquay.server._coding_py.set_numbers.\n\n"
"Raises ValueError for arrays that are not int64 (holders: uint64) or that\n"
"contradict each other.");

static PyObject *
set_numbers(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[6];
    const char *error = NULL;
    int64_t tables = 0;
    int done = 0;
    if (get_views("set_numbers", args, nargs, 6, 3, views) < 0)
        return NULL;
    if (views[0].ndim != 2 || views[0].shape[1] < 1 || views[1].len != views[2].len || views[3].len != views[1].len
        || views[4].len != views[1].len * views[0].shape[1] || views[5].len != views[1].len) {
        error = "set_numbers' arrays disagree on the number of samples, or holders is not a matrix";
    } else {
        Keys k = {views[0].buf, views[0].shape[0], views[0].shape[1], views[1].buf, views[2].buf};
        Py_BEGIN_ALLOW_THREADS
        done = set_numbers_run(&k, views[1].len / 8, views[3].buf, views[4].buf, views[5].buf, &tables, &error);
        Py_END_ALLOW_THREADS
    }
    return finish(done, error, views, 6, done > 0 ? PyLong_FromLongLong(tables) : NULL);
}

/* dag_edges: every (parent, member, child) with child = parent less member, a
 * table of each size looked up in an open-addressing set of the tables one
 * member smaller. A key's hash is the XOR of a mix of each word, so that
 * dropping a member updates it from one word. A child agrees with its parent
 * on the even or on the odd members, so a parent whose halves' hashes are no
 * smaller table's halves has none: two lookups rule out most parents where
 * tables have dozens of members. */
typedef struct {
    uint64_t hash;
    int64_t table;
} Slot;

typedef struct {
    Slot *slots;
    int64_t mask;
} HashSet;

typedef struct {
    int64_t *items;
    int64_t len, cap;
} Edges;

/* A child that a parent may have: the hash it would have, and its first slot. */
typedef struct {
    uint64_t hash;
    int64_t parent, member, slot;
} Lookup;

typedef struct {
    const uint64_t *keys;
    int64_t tables, words, groups;
    const int64_t *table_start, *decoder, *count;
    int64_t *rows;   /* each table's fullest column */
    const char *error;
} Dag;

static uint64_t
mix_word(uint64_t word, int64_t w)
{
    uint64_t x = word + (uint64_t)(w + 1) * 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static int64_t
slot_of(const HashSet *set, uint64_t hash)
{
    return (int64_t)((hash * 0x9E3779B97F4A7C15ull) >> 20) & set->mask;
}

static int
set_reset(HashSet *set, int64_t entries)
{
    int64_t size = 1;
    while (size < 2 * entries)
        size <<= 1;
    Slot *slots = realloc(set->slots, size * sizeof(Slot));
    if (!slots)
        return -1;
    set->slots = slots;
    set->mask = size - 1;
    for (int64_t i = 0; i < size; i++)
        slots[i].table = -1;
    return 1;
}

/* Adds hash (of table); `once`: unless the set has it (halves of many tables are alike). */
static void
set_add(HashSet *set, uint64_t hash, int64_t table, int once)
{
    int64_t at = slot_of(set, hash);
    for (; set->slots[at].table >= 0; at = (at + 1) & set->mask)
        if (once && set->slots[at].hash == hash)
            return;
    set->slots[at].hash = hash;
    set->slots[at].table = table;
}

static int
set_has(const HashSet *set, uint64_t hash)
{
    for (int64_t at = slot_of(set, hash); set->slots[at].table >= 0; at = (at + 1) & set->mask)
        if (set->slots[at].hash == hash)
            return 1;
    return 0;
}

static int
push_edge(Edges *e, int64_t parent, int64_t member, int64_t child)
{
    if (e->len + 3 > e->cap) {
        int64_t cap = e->cap ? 2 * e->cap : 3 * 4096;
        int64_t *items = realloc(e->items, cap * sizeof(int64_t));
        if (!items)
            return -1;
        e->items = items;
        e->cap = cap;
    }
    e->items[e->len++] = parent;
    e->items[e->len++] = member;
    e->items[e->len++] = child;
    return 1;
}

/* Samples of table t's column `column` (0 if it has none). */
static int64_t
column_count(const Dag *d, int64_t t, int64_t column)
{
    int64_t lo = d->table_start[t], hi = d->table_start[t + 1];
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (d->decoder[mid] < column)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < d->table_start[t + 1] && d->decoder[lo] == column ? d->count[lo] : 0;
}

/* _Initial.may_move of coding_py: whether every full column of the parent of
 * edges [first, end) has a child, other than its own, with a gap in it;
 * else the greedy would stop at once on that parent. */
static int
may_move(const Dag *d, const Edges *e, int64_t first, int64_t end)
{
    int64_t parent = e->items[first];
    for (int64_t k = d->table_start[parent]; k < d->table_start[parent + 1]; k++) {
        int served = 0;
        if (d->count[k] != d->rows[parent])
            continue;
        for (int64_t i = first; i < end && !served; i += 3) {
            int64_t child = e->items[i + 2];
            served = e->items[i + 1] != d->decoder[k] && column_count(d, child, d->decoder[k]) < d->rows[child];
        }
        if (!served)
            return 0;
    }
    return 1;
}

static int
dag_edges_run(Dag *d, Edges *e)
{
    int64_t t, w, size, max_size = 0, done = 1, words = d->words;
    int64_t *sizes = malloc((d->tables + 1) * sizeof(int64_t)), *by_size = malloc((d->tables + 1) * sizeof(int64_t));
    uint64_t *even = malloc((d->tables + 1) * sizeof(uint64_t)), *odd = malloc((d->tables + 1) * sizeof(uint64_t));
    uint64_t *full = malloc((d->tables + 1) * sizeof(uint64_t)), *child_key = malloc((words + 1) * sizeof(uint64_t));
    Lookup *look = NULL;
    int64_t look_cap = 0;
    int64_t *size_start = NULL;
    HashSet tables = {NULL, 0}, halves = {NULL, 0};
    d->rows = calloc(d->tables + 1, sizeof(int64_t));
    if (!sizes || !by_size || !even || !odd || !full || !child_key || !d->rows) {
        done = -1;
        goto out;
    }
    for (t = 0; t < d->tables; t++) {
        if (d->table_start[t] < 0 || d->table_start[t] >= d->table_start[t + 1] || d->table_start[t + 1] > d->groups) {
            d->error = "table_start is not ascending within the groups, or a table has no column";
            done = 0;
            goto out;
        }
        for (int64_t k = d->table_start[t]; k < d->table_start[t + 1]; k++)
            if (d->count[k] > d->rows[t])
                d->rows[t] = d->count[k];
        sizes[t] = 0;
        full[t] = even[t] = odd[t] = 0;
        for (w = 0; w < words; w++) {
            uint64_t bits = d->keys[t * words + w];
            sizes[t] += popcount64(bits);
            full[t] ^= mix_word(bits, w);
        }
        for (w = 0; sizes[t] >= HALVES_FROM && w < words; w++) {
            even[t] ^= mix_word(d->keys[t * words + w] & EVEN_BITS, w);
            odd[t] ^= mix_word(d->keys[t * words + w] & ~EVEN_BITS, w);
        }
        if (sizes[t] > max_size)
            max_size = sizes[t];
    }
    size_start = calloc(max_size + 2, sizeof(int64_t));
    if (!size_start) {
        done = -1;
        goto out;
    }
    for (t = 0; t < d->tables; t++)
        size_start[sizes[t] + 1]++;
    for (size = 0; size <= max_size; size++)
        size_start[size + 1] += size_start[size];
    for (t = 0; t < d->tables; t++)
        by_size[size_start[sizes[t]]++] = t;
    for (size = max_size; size > 0; size--)
        size_start[size] = size_start[size - 1];
    size_start[0] = 0;
    for (size = max_size; size >= 3; size--) {
        int64_t lo = size_start[size - 1], hi = size_start[size], i;
        if (lo == hi || size_start[size] == size_start[size + 1])
            continue;
        /* The halves rule out parents at a cost of about four lookups each: worth it past a few members. */
        int by_halves = size > HALVES_FROM;
        if (set_reset(&tables, hi - lo) < 0 || (by_halves && set_reset(&halves, 2 * (hi - lo)) < 0)) {
            done = -1;
            goto out;
        }
        for (i = lo; i < hi; i++) {
            if (i + AHEAD < hi)
                __builtin_prefetch(&tables.slots[slot_of(&tables, full[by_size[i + AHEAD]])]);
            t = by_size[i];
            set_add(&tables, full[t], t, 0);
            if (by_halves) {
                set_add(&halves, even[t], t, 1);
                set_add(&halves, odd[t], t, 1);
            }
        }
        /* Lookups miss the caches: each loop below asks for the memory of
         * the item AHEAD on while it works on this one, over a CHUNK of
         * parents at a time. First the parents that may have a child, and
         * the hash of each child they may have. */
        for (int64_t chunk = size_start[size], parents_hi = size_start[size + 1], chunk_hi; chunk < parents_hi;
             chunk = chunk_hi) {
            int64_t n = 0, k, first = e->len, kept, group, next;
            chunk_hi = chunk + CHUNK < parents_hi ? chunk + CHUNK : parents_hi;
            for (i = chunk; i < chunk_hi; i++) {
                if (i + 2 * AHEAD < parents_hi) {
                    __builtin_prefetch(d->keys + by_size[i + 2 * AHEAD] * words);
                    __builtin_prefetch(&full[by_size[i + 2 * AHEAD]]);
                    __builtin_prefetch(&even[by_size[i + 2 * AHEAD]]);
                    __builtin_prefetch(&odd[by_size[i + 2 * AHEAD]]);
                }
                if (by_halves && i + AHEAD < parents_hi) {
                    __builtin_prefetch(&halves.slots[slot_of(&halves, even[by_size[i + AHEAD]])]);
                    __builtin_prefetch(&halves.slots[slot_of(&halves, odd[by_size[i + AHEAD]])]);
                }
                int64_t parent = by_size[i];
                const uint64_t *key = d->keys + parent * words;
                if (by_halves && !set_has(&halves, even[parent]) && !set_has(&halves, odd[parent]))
                    continue;
                if (n + 64 * words > look_cap) {
                    look_cap = 2 * (n + 64 * words);
                    Lookup *grown_look = realloc(look, look_cap * sizeof(Lookup));
                    if (!grown_look) {
                        done = -1;
                        goto out;
                    }
                    look = grown_look;
                }
                for (w = 0; w < words; w++) {
                    uint64_t rest = full[parent] ^ mix_word(key[w], w);
                    for (uint64_t bits = key[w]; bits; bits &= bits - 1) {
                        int64_t member = w * 64 + __builtin_ctzll(bits);
                        look[n].hash = rest ^ mix_word(key[w] & ~((uint64_t)1 << (member % 64)), w);
                        look[n].parent = parent;
                        look[n].member = member;
                        n++;
                    }
                }
            }
            /* Then the first slot of each child's hash. */
            for (k = 0; k < n; k++) {
                if (k + AHEAD < n)
                    __builtin_prefetch(&tables.slots[slot_of(&tables, look[k + AHEAD].hash)]);
                int64_t at = slot_of(&tables, look[k].hash);
                for (; tables.slots[at].table >= 0 && tables.slots[at].hash != look[k].hash;
                     at = (at + 1) & tables.mask)
                    ;
                look[k].slot = tables.slots[at].table >= 0 ? at : -1;
            }
            /* Then the children bit for bit, the edges in the parents' and members' order. */
            for (k = 0; k < n; k++) {
                if (k + AHEAD < n && look[k + AHEAD].slot >= 0)
                    __builtin_prefetch(d->keys + tables.slots[look[k + AHEAD].slot].table * words);
                const uint64_t *key = d->keys + look[k].parent * words;
                for (int64_t at = look[k].slot; at >= 0 && tables.slots[at].table >= 0; at = (at + 1) & tables.mask) {
                    if (tables.slots[at].hash != look[k].hash)
                        continue;
                    const uint64_t *child = d->keys + tables.slots[at].table * words;
                    for (w = 0; w < words; w++)
                        child_key[w] = key[w] ^ child[w];
                    child_key[look[k].member / 64] ^= (uint64_t)1 << (look[k].member % 64);
                    for (w = 0; w < words && !child_key[w]; w++)
                        ;
                    if (w == words) {
                        if (push_edge(e, look[k].parent, look[k].member, tables.slots[at].table) < 0) {
                            done = -1;
                            goto out;
                        }
                        break;
                    }
                }
            }
            /* Last, the edges of the parents the greedy would not move a row of left out. */
            for (kept = group = first; group < e->len; group = next) {
                for (next = group + 3; next < e->len && e->items[next] == e->items[group]; next += 3)
                    ;
                if (!may_move(d, e, group, next))
                    continue;
                memmove(e->items + kept, e->items + group, (next - group) * sizeof(int64_t));
                kept += next - group;
            }
            e->len = kept;
        }
    }
out:
    free(sizes);
    free(by_size);
    free(even);
    free(odd);
    free(full);
    free(child_key);
    free(look);
    free(size_start);
    free(tables.slots);
    free(halves.slots);
    free(d->rows);
    return (int)done;
}

PyDoc_STRVAR(dag_edges_doc,
"dag_edges(keys, table_start, decoders, counts, /) -> bytearray\n\n"
"The DAG's edges of UberShuffle that the greedy may move rows along, as int64\n"
"triples: see dataquay.server._coding_py.dag_edges.\n\n"
"Raises ValueError for arrays that are not int64 (keys: uint64) or that\n"
"contradict each other.");

static PyObject *
dag_edges(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[4];
    Edges e = {NULL, 0, 0};
    Dag d;
    int done = 0;
    memset(&d, 0, sizeof(d));
    if (get_views("dag_edges", args, nargs, 4, 4, views) < 0)
        return NULL;
    if (views[0].ndim != 2 || views[1].len != (views[0].shape[0] + 1) * 8 || views[2].len != views[3].len) {
        d.error = "dag_edges' arrays disagree on the numbers of tables or groups";
    } else {
        d.keys = views[0].buf;
        d.tables = views[0].shape[0];
        d.words = views[0].shape[1];
        d.table_start = views[1].buf;
        d.decoder = views[2].buf;
        d.count = views[3].buf;
        d.groups = views[2].len / 8;
        Py_BEGIN_ALLOW_THREADS
        done = dag_edges_run(&d, &e);
        Py_END_ALLOW_THREADS
    }
    PyObject *result = done > 0 ? PyByteArray_FromStringAndSize((const char *)e.items, e.len * 8) : NULL;
    free(e.items);
    return finish(done, d.error, views, 4, result);
}

static PyMethodDef methods[] = {
    {"greedy", (PyCFunction)(void (*)(void))greedy, METH_FASTCALL, greedy_doc},
    {"packet_rows", (PyCFunction)(void (*)(void))packet_rows, METH_FASTCALL, packet_rows_doc},
    {"pick_bits", (PyCFunction)(void (*)(void))pick_bits, METH_FASTCALL, pick_bits_doc},
    {"table_hashes", (PyCFunction)(void (*)(void))table_hashes, METH_FASTCALL, table_hashes_doc},
    {"set_numbers", (PyCFunction)(void (*)(void))set_numbers, METH_FASTCALL, set_numbers_doc},
    {"dag_edges", (PyCFunction)(void (*)(void))dag_edges, METH_FASTCALL, dag_edges_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef coding_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dataquay.server._coding",
    .m_doc = "The loops of dataquay.server.node.exchange.coding's planner, in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__coding(void)
{
    return PyModuleDef_Init(&coding_module);
}
