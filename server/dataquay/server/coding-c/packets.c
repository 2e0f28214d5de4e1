/* The packets' rows of each table (packet_rows), and a node that caches every
 * sample of a group (pick_bits). */
#include "coding.h"

/* Rows of a bitset matrix asked for ahead of a gather over it. */
#define PREFETCH 16

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

const char dq_coding_packet_rows_doc[] = PyDoc_STR(
"packet_rows(tables, decoders, sizes, parts, start, /) -> int\n\n"
"The packets of the needed samples' tables: see dataquay.server._coding_py.packet_rows.\n\n"
"Raises ValueError for arrays that are not int64 or of lengths that disagree.");

PyObject *
dq_coding_packet_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[5];
    int64_t packets = 0;
    const char *error = NULL;
    int done = 0;
    if (dq_coding_get_views("packet_rows", args, nargs, 5, 3, views) < 0)
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
    return dq_coding_finish(done, error, views, 5, done > 0 ? PyLong_FromLongLong(packets) : NULL);
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

const char dq_coding_pick_bits_doc[] = PyDoc_STR(
"pick_bits(holders, start, samples, spread, out, /) -> None\n\n"
"A node that caches every sample of each group: see dataquay.server._coding_py.pick_bits.\n\n"
"Raises ValueError for arrays that are not int64 (holders: uint64) or that\n"
"contradict each other.");

PyObject *
dq_coding_pick_bits(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[5];
    const char *error = NULL;
    int done = 0;
    if (dq_coding_get_views("pick_bits", args, nargs, 5, 4, views) < 0)
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
    return dq_coding_finish(done, error, views, 5, Py_NewRef(Py_None));
}
