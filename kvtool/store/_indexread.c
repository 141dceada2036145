/* kvtool.store._indexread: a namespace index's `blocks` and `segments` rows, in one read
 * transaction, through SQLite's C API straight into column buffers (see
 * kvtool/store/rowtable_native.py, which is the only caller and documents the contract).
 *
 * Every value is checked as `IndexRow.from_db` / `SegmentRow.from_db` check it: names are TEXT of
 * exactly 32 lowercase hex digits; slot is an INTEGER >= 0, num_tokens, nbytes and n_blocks
 * INTEGERs >= 1; times are REAL or INTEGER, finite and >= 0. The first value that is anything
 * else ends the read with `None`: the caller then reads the index the slower ways, which decide
 * row by row. Nothing here decides a malformed row. SQLite runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <sqlite3.h>
#include <stdint.h>
#include <string.h>

#define NAME_HEX 32

static signed char hexval[256];

static void init_hex(void) {
    for (int c = 0; c < 256; c++) hexval[c] = -1;
    for (int c = '0'; c <= '9'; c++) hexval[c] = (signed char)(c - '0');
    for (int c = 'a'; c <= 'f'; c++) hexval[c] = (signed char)(c - 'a' + 10);
}

/* A TEXT value of 32 lowercase hex digits as a key: two uint64, the big-endian halves of its
 * 16 bytes (kvtool.store.chains' keys). Returns 0 for anything else. */
static int name_key(sqlite3_stmt *st, int col, uint64_t *out) {
    if (sqlite3_column_type(st, col) != SQLITE_TEXT) return 0;
    const unsigned char *s = sqlite3_column_text(st, col);
    if (s == NULL || sqlite3_column_bytes(st, col) != NAME_HEX) return 0;
    int bad = 0;
    for (int half = 0; half < 2; half++) {
        uint64_t v = 0;
        for (int i = 0; i < 16; i++) {
            int d = hexval[s[half * 16 + i]];
            bad |= d;
            v = (v << 4) | (uint64_t)(d & 15);
        }
        out[half] = v;
    }
    return bad >= 0;
}

static int int_at_least(sqlite3_stmt *st, int col, sqlite3_int64 lo, sqlite3_int64 *out) {
    if (sqlite3_column_type(st, col) != SQLITE_INTEGER) return 0;
    *out = sqlite3_column_int64(st, col);
    return *out >= lo;
}

static int32_t clip32(sqlite3_int64 v) { return v > INT32_MAX ? INT32_MAX : (int32_t)v; }

static int time_of(sqlite3_stmt *st, int col, double *out) {
    int ty = sqlite3_column_type(st, col);
    if (ty != SQLITE_FLOAT && ty != SQLITE_INTEGER) return 0;
    *out = sqlite3_column_double(st, col);
    return isfinite(*out) && *out >= 0.0;
}

typedef struct {
    sqlite3_int64 n;  /* rows counted */
    sqlite3_int64 got;
    uint64_t *hash, *parent, *digest; /* [n, 2] */
    int32_t *run, *slot, *num_tokens, *nbytes; /* [n] */
    double *created, *last_access;
    uint64_t *runs; /* [runs, 2]: the segment of each run of rows with one segment */
    sqlite3_int64 n_runs, runs_cap;
} Blocks;

typedef struct {
    sqlite3_int64 n, cap;
    sqlite3_int64 *rowid, *nbytes, *n_blocks;
    uint64_t *name; /* [n, 2] */
    double *created;
} Segments;

/* 1: every row read and well-formed; 0: a row that is not (or more rows than counted);
 * -1: an SQLite error or no memory. Runs without the GIL. */
static int read_blocks(sqlite3 *db, Blocks *b) {
    static const char *sql =
        "SELECT hash, parent, tokens_digest, segment, slot, num_tokens, nbytes, created, last_access FROM blocks";
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK) return -1;
    int rc, ok = 1;
    uint64_t seg[2];
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        sqlite3_int64 i = b->got, slot, ntok, nbytes;
        if (i >= b->n) { ok = 0; break; }
        if (!name_key(st, 0, b->hash + 2 * i) || !name_key(st, 1, b->parent + 2 * i) ||
            !name_key(st, 2, b->digest + 2 * i) || !name_key(st, 3, seg) ||
            !int_at_least(st, 4, 0, &slot) || !int_at_least(st, 5, 1, &ntok) || !int_at_least(st, 6, 1, &nbytes) ||
            !time_of(st, 7, b->created + i) || !time_of(st, 8, b->last_access + i)) {
            ok = 0;
            break;
        }
        b->slot[i] = clip32(slot);
        b->num_tokens[i] = clip32(ntok);
        b->nbytes[i] = clip32(nbytes);
        if (b->n_runs == 0 || b->runs[2 * (b->n_runs - 1)] != seg[0] || b->runs[2 * (b->n_runs - 1) + 1] != seg[1]) {
            if (b->n_runs == b->runs_cap) {
                sqlite3_int64 cap = b->runs_cap ? 2 * b->runs_cap : 1024;
                uint64_t *grown = realloc(b->runs, (size_t)cap * 2 * sizeof(uint64_t));
                if (grown == NULL) { ok = -1; break; }
                b->runs_cap = cap;
                b->runs = grown;
            }
            b->runs[2 * b->n_runs] = seg[0];
            b->runs[2 * b->n_runs + 1] = seg[1];
            b->n_runs++;
        }
        b->run[i] = (int32_t)(b->n_runs - 1);
        b->got++;
    }
    if (ok == 1 && rc != SQLITE_DONE) ok = -1;
    sqlite3_finalize(st);
    return ok;
}

static int read_segments(sqlite3 *db, Segments *s) {
    static const char *sql = "SELECT rowid, name, nbytes, n_blocks, created FROM segments ORDER BY name";
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK) return -1;
    int rc, ok = 1;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (s->n == s->cap) {
            sqlite3_int64 cap = s->cap ? 2 * s->cap : 1024;
            sqlite3_int64 *r = realloc(s->rowid, (size_t)cap * sizeof *r);
            if (r) s->rowid = r;
            sqlite3_int64 *nb = r ? realloc(s->nbytes, (size_t)cap * sizeof *nb) : NULL;
            if (nb) s->nbytes = nb;
            sqlite3_int64 *bl = nb ? realloc(s->n_blocks, (size_t)cap * sizeof *bl) : NULL;
            if (bl) s->n_blocks = bl;
            uint64_t *nm = bl ? realloc(s->name, (size_t)cap * 2 * sizeof *nm) : NULL;
            if (nm) s->name = nm;
            double *cr = nm ? realloc(s->created, (size_t)cap * sizeof *cr) : NULL;
            if (cr == NULL) { ok = -1; break; }
            s->created = cr;
            s->cap = cap;
        }
        sqlite3_int64 i = s->n;
        s->rowid[i] = sqlite3_column_int64(st, 0);
        if (!name_key(st, 1, s->name + 2 * i) || !int_at_least(st, 2, 1, s->nbytes + i) ||
            !int_at_least(st, 3, 1, s->n_blocks + i) || !time_of(st, 4, s->created + i)) {
            ok = 0;
            break;
        }
        s->n++;
    }
    if (ok == 1 && rc != SQLITE_DONE) ok = -1;
    sqlite3_finalize(st);
    return ok;
}

static int count_of(sqlite3 *db, const char *sql, sqlite3_int64 *out) {
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK) return 0;
    int ok = sqlite3_step(st) == SQLITE_ROW && sqlite3_column_type(st, 0) == SQLITE_INTEGER;
    if (ok) *out = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return ok;
}

static PyObject *bytes_of(const void *data, sqlite3_int64 n) {
    return PyByteArray_FromStringAndSize(data ? (const char *)data : "", data ? (Py_ssize_t)n : 0);
}

static const char *COLUMNS[] = {"hash", "parent", "digest", "run", "slot", "num_tokens", "nbytes", "created", "last_access"};
static const int WIDTH[] = {16, 16, 16, 4, 4, 4, 4, 8, 8}; /* bytes per row of each column */
#define N_COLUMNS 9

/* read(uri, fixed) -> None, or a dict of bytearrays (see rowtable_native.read_snapshot). */
static PyObject *indexread_read(PyObject *self, PyObject *args) {
    (void)self;
    const char *uri;
    PyObject *fixed;
    if (!PyArg_ParseTuple(args, "sO", &uri, &fixed)) return NULL;
    sqlite3 *db = NULL;
    Blocks b;
    Segments s;
    memset(&b, 0, sizeof b);
    memset(&s, 0, sizeof s);
    PyObject *out = PyDict_New(), *col[N_COLUMNS] = {NULL};
    if (out == NULL) return NULL;
    int rc = SQLITE_OK, ok = 1;
    sqlite3_int64 meta = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = sqlite3_open_v2(uri, &db, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI | SQLITE_OPEN_NOMUTEX, NULL); /* one thread */
    if (rc == SQLITE_OK) rc = sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
    /* the first read fixes the snapshot; every statement below reads that one */
    if (rc == SQLITE_OK && !count_of(db, "SELECT COUNT(*) FROM meta", &meta)) rc = SQLITE_ERROR;
    if (rc == SQLITE_OK && (!count_of(db, "SELECT COUNT(*) FROM blocks", &b.n) || b.n < 0)) rc = SQLITE_ERROR;
    Py_END_ALLOW_THREADS
    if (rc != SQLITE_OK) goto unusable;
    if (fixed != Py_None) {
        PyObject *r = PyObject_CallNoArgs(fixed);
        if (r == NULL) goto fail;
        Py_DECREF(r);
    }
    for (int k = 0; k < N_COLUMNS; k++) { /* the columns, filled in place below (no copy) */
        col[k] = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(b.n * WIDTH[k]));
        if (col[k] == NULL || PyDict_SetItemString(out, COLUMNS[k], col[k]) < 0) goto fail;
    }
    b.hash = (uint64_t *)PyByteArray_AS_STRING(col[0]);
    b.parent = (uint64_t *)PyByteArray_AS_STRING(col[1]);
    b.digest = (uint64_t *)PyByteArray_AS_STRING(col[2]);
    b.run = (int32_t *)PyByteArray_AS_STRING(col[3]);
    b.slot = (int32_t *)PyByteArray_AS_STRING(col[4]);
    b.num_tokens = (int32_t *)PyByteArray_AS_STRING(col[5]);
    b.nbytes = (int32_t *)PyByteArray_AS_STRING(col[6]);
    b.created = (double *)PyByteArray_AS_STRING(col[7]);
    b.last_access = (double *)PyByteArray_AS_STRING(col[8]);
    Py_BEGIN_ALLOW_THREADS /* the bytearrays are this call's alone until it returns */
    ok = read_blocks(db, &b);
    if (ok == 1 && b.got != b.n) ok = 0;
    if (ok == 1) ok = read_segments(db, &s);
    sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
    Py_END_ALLOW_THREADS
    if (ok != 1) goto unusable;
    PyObject *items[] = {
        PyLong_FromLongLong(b.n), bytes_of(b.runs, b.n_runs * 16), PyLong_FromLongLong(s.n),
        bytes_of(s.rowid, s.n * 8), bytes_of(s.name, s.n * 16), bytes_of(s.nbytes, s.n * 8),
        bytes_of(s.n_blocks, s.n * 8), bytes_of(s.created, s.n * 8)};
    const char *keys[] = {"rows", "runs", "segment_rows", "segment_rowid", "segment_name", "segment_nbytes",
                          "segment_n_blocks", "segment_created"};
    for (int k = 0; k < 8; k++) {
        int bad = items[k] == NULL || PyDict_SetItemString(out, keys[k], items[k]) < 0;
        Py_XDECREF(items[k]);
        if (bad) {
            for (int j = k + 1; j < 8; j++) Py_XDECREF(items[j]);
            goto fail;
        }
    }
    goto cleanup;
unusable:
    Py_DECREF(out);
    out = Py_None;
    Py_INCREF(out);
    goto cleanup;
fail:
    Py_CLEAR(out);
cleanup:
    for (int k = 0; k < N_COLUMNS; k++) Py_XDECREF(col[k]);
    free(b.runs);
    free(s.rowid);
    free(s.nbytes);
    free(s.n_blocks);
    free(s.name);
    free(s.created);
    if (db != NULL) sqlite3_close(db);
    return out;
}

/* argsort(keys) -> bytearray of int64 [N]: the stable order of `keys` (a C-contiguous buffer of
 * N uint64), by LSD radix sort on RADIX_BITS-bit digits (a pass whose digit is the same for every
 * key is skipped). What `RowTable` sorts by: the high halves of the hashes, (segment << 32 | slot). */
#define RADIX_BITS 11 /* 6 passes for 64 bits; 2,048 buckets stay in cache */
#define RADIX_SIZE (1 << RADIX_BITS)
#define RADIX_MASK (RADIX_SIZE - 1)

static PyObject *indexread_argsort(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer in;
    if (!PyArg_ParseTuple(args, "y*", &in)) return NULL;
    Py_ssize_t n = in.len / 8;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * 8);
    uint64_t *ka = malloc((size_t)(n ? n : 1) * 8), *kb = malloc((size_t)(n ? n : 1) * 8);
    int64_t *ib = malloc((size_t)(n ? n : 1) * 8);
    size_t *count = malloc(RADIX_SIZE * sizeof(size_t));
    if (out == NULL || !ka || !kb || !ib || !count) {
        Py_XDECREF(out);
        free(ka), free(kb), free(ib), free(count);
        PyBuffer_Release(&in);
        return out == NULL ? NULL : PyErr_NoMemory();
    }
    int64_t *ia = (int64_t *)PyByteArray_AS_STRING(out), *result = ia;
    Py_BEGIN_ALLOW_THREADS
    memcpy(ka, in.buf, (size_t)n * 8);
    for (Py_ssize_t i = 0; i < n; i++) ia[i] = i;
    for (int shift = 0; shift < 64; shift += RADIX_BITS) {
        memset(count, 0, RADIX_SIZE * sizeof(size_t));
        for (Py_ssize_t i = 0; i < n; i++) count[(ka[i] >> shift) & RADIX_MASK]++;
        if (n == 0 || count[(ka[0] >> shift) & RADIX_MASK] == (size_t)n) continue; /* one digit: order kept */
        size_t at = 0;
        for (int d = 0; d < RADIX_SIZE; d++) {
            size_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            size_t j = count[(ka[i] >> shift) & RADIX_MASK]++;
            kb[j] = ka[i];
            ib[j] = ia[i];
        }
        uint64_t *kt = ka; ka = kb; kb = kt;
        int64_t *it = ia; ia = ib; ib = it;
    }
    if (ia != result) memcpy(result, ia, (size_t)n * 8); /* an odd number of passes left it in `ib`'s buffer */
    Py_END_ALLOW_THREADS
    if (ia != result) ib = ia; /* free the scratch buffer, never `out`'s */
    free(ka), free(kb), free(ib), free(count);
    PyBuffer_Release(&in);
    return out;
}

static PyMethodDef methods[] = {
    {"argsort", indexread_argsort, METH_VARARGS, "argsort(uint64 keys) -> bytearray of the stable int64 order."},
    {"read", indexread_read, METH_VARARGS,
     "read(uri, fixed) -> dict of column bytearrays, or None (a value that is not well-formed, an SQLite error)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_indexread", NULL, -1, methods};

PyMODINIT_FUNC PyInit__indexread(void) {
    init_hex();
    return PyModule_Create(&module);
}
