/*
 * UberShuffle's greedy: its moves of rows down the table DAG, with the
 * tables' slots and the pools of sample ids they move.
 *
 * A table's columns are its members, in ascending node order ("slots"): a
 * column's count is 0 until a sample arrives in it.
 */
#include "coding.h"

/* The greedy's arguments. */
#define NUM_ARRAYS 10
/* Sample ids per block that the greedy's pools are carved from. */
#define BLOCK (1 << 16)

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
    return find_sorted(g->slot_node, g->slot_start[table], g->slot_start[table + 1], node);
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

const char dq_coding_greedy_doc[] = PyDoc_STR(
"greedy(keys, table_start, decoders, counts, order, starts, parents, members, children, out, /) -> None\n\n"
"UberShuffle's moves of rows down the table DAG, applied to ``out`` (each\n"
"needed sample's table, on entry Lee et al.'s): see dataquay.server._coding_py.greedy.\n\n"
"Raises ValueError for arrays that are not int64 (keys: uint64) or that\n"
"contradict each other.");

PyObject *
dq_coding_greedy(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[NUM_ARRAYS];
    int done = 0;
    Greedy g;
    memset(&g, 0, sizeof(g));
    if (dq_coding_get_views("greedy", args, nargs, NUM_ARRAYS, NUM_ARRAYS - 1, views) < 0)
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
    return dq_coding_finish(done, g.error, views, NUM_ARRAYS, Py_NewRef(Py_None));
}
