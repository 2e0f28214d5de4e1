/* The edges of UberShuffle's table DAG that the greedy may move rows along
 * (dag_edges). */
#include "coding.h"

/* Parents of more members than this are first looked up by their halves (dag_edges). */
#define HALVES_FROM 8
/* Parents whose lookups dag_edges makes at a time: their few MB stay in the caches. */
#define CHUNK 4096
#define EVEN_BITS 0x5555555555555555ull

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
    int64_t at = find_sorted(d->decoder, d->table_start[t], d->table_start[t + 1], column);
    return at < 0 ? 0 : d->count[at];
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

const char dq_coding_dag_edges_doc[] = PyDoc_STR(
"dag_edges(keys, table_start, decoders, counts, /) -> bytearray\n\n"
"The DAG's edges of UberShuffle that the greedy may move rows along, as int64\n"
"triples: see dataquay.server._coding_py.dag_edges.\n\n"
"Raises ValueError for arrays that are not int64 (keys: uint64) or that\n"
"contradict each other.");

PyObject *
dq_coding_dag_edges(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[4];
    Edges e = {NULL, 0, 0};
    Dag d;
    int done = 0;
    memset(&d, 0, sizeof(d));
    if (dq_coding_get_views("dag_edges", args, nargs, 4, 4, views) < 0)
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
    return dq_coding_finish(done, d.error, views, 4, result);
}
