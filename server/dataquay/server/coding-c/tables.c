/* The needed samples' tables: their set hashes (table_hashes), and their
 * numbers in the order of their keys' bytes (set_numbers), with the sorts
 * that order them. */
#include "coding.h"

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

const char dq_coding_table_hashes_doc[] = PyDoc_STR(
"table_hashes(holders, samples, decoders, lookup, out, /) -> None\n\n"
"The set hash of each sample's table: see dataquay.server._coding_py.table_hashes.\n\n"
"Raises ValueError for arrays that are not int64 (holders: uint64) or that\n"
"contradict each other.");

PyObject *
dq_coding_table_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[5];
    const char *error = NULL;
    int done = 0;
    if (dq_coding_get_views("table_hashes", args, nargs, 5, 4, views) < 0)
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
    return dq_coding_finish(done, error, views, 5, Py_NewRef(Py_None));
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

const char dq_coding_set_numbers_doc[] = PyDoc_STR(
"set_numbers(holders, samples, decoders, out, keys, order, /) -> int\n\n"
"Each sample's table, numbered in the order of the tables' bytes, their bitsets\n"
"and the samples by table and column: see\n"
"dataquay.server._coding_py.set_numbers.\n\n"
"Raises ValueError for arrays that are not int64 (holders: uint64) or that\n"
"contradict each other.");

PyObject *
dq_coding_set_numbers(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[6];
    const char *error = NULL;
    int64_t tables = 0;
    int done = 0;
    if (dq_coding_get_views("set_numbers", args, nargs, 6, 3, views) < 0)
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
    return dq_coding_finish(done, error, views, 6, done > 0 ? PyLong_FromLongLong(tables) : NULL);
}
