/* kvtool.ops._segcheck: the clean-segment check of `kvtool validate` (kvtool/ops/clean_segments.py,
 * which is the only caller and documents the rules) for a batch of segment files, in C.
 *
 * read(ns_fd, names, limits, buf): each segment file `<name[:2]>/<name>.safetensors` below the
 * namespace directory `ns_fd`, resolved without following symlinks (the fan-out directory opened
 * O_DIRECTORY | O_NOFOLLOW, the file looked at with fstatat(AT_SYMLINK_NOFOLLOW) before it is
 * opened O_NOFOLLOW | O_NONBLOCK, then fstat: a FIFO or device is never opened, a swapped-in one
 * never read), read whole into `buf` one after the other, until one does not fit in what is left
 * of `buf`. Per file: offset in `buf`, size (-1: absent, not a regular file, unreadable, of 8 bytes
 * or less or larger than its `limits` entry (int64 bytes); -2: not read, because it or a file
 * before it did not fit), the header length (the u64 at its start; for the file that did not
 * fit, its size) and where the creation time's text lies (`segment_template.created_span`; -1
 * where there is none).
 *
 * judge(...): for files of one template (`segment_template.Template`), the verdicts
 * `clean_segments._judge` computes with numpy: every fixed byte of the header as the template
 * has it; the creation time of allowed characters only; every digest field of 32 lowercase hex
 * digits; each slot's hash and parent equal to its row's; each record's token digest (xxh3-128 of
 * its token ids) equal to its row's; with `deep` each record's checksum (xxh3-128 of the record)
 * equal to its slot's; the header checksum (xxh3-128 of the header with its own value zeroed)
 * equal to the stored one. xxh3-128 is libxxhash's (linked as libxxhash.so.0; its stable ABI,
 * declared below), the same function the `xxhash` package wraps.
 *
 * Both run without the GIL. The module is optional (setup.py): without it, the Python path checks.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    unsigned long long low64, high64;
} XXH128_hash_t;
XXH128_hash_t XXH3_128bits(const void *data, size_t len); /* libxxhash >= 0.8, stable ABI */

#define MAX_HEADER_BYTES (1 << 26) /* segment.MAX_HEADER_BYTES */
static const char CREATED_KEY[] = "\"created\":\"";
static signed char hexval[256];
static unsigned char created_ok[256];

static void init_tables(void) {
    for (int c = 0; c < 256; c++) hexval[c] = -1;
    for (int c = '0'; c <= '9'; c++) hexval[c] = (signed char)(c - '0');
    for (int c = 'a'; c <= 'f'; c++) hexval[c] = (signed char)(c - 'a' + 10);
    const char *chars = "0123456789.eE+-infaINFA"; /* segment_template.CREATED_CHARS */
    for (const char *p = chars; *p; p++) created_ok[(unsigned char)*p] = 1;
}

/* ------------------------------------------------------------------ read */

/* The size read (-1: not a regular file of 9..limit bytes, or unreadable; -2: it would not fit
 * in `room` bytes, its size in *need). */
static int64_t read_one(int sub, const char *leaf, char *dst, int64_t room, int64_t limit, int64_t *need) {
    struct stat st;
    if (fstatat(sub, leaf, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) return -1;
    int fd = openat(sub, leaf, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return -1;
    int64_t size = -1;
    int usable = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 8 && st.st_size <= limit;
    if (usable && st.st_size > room) {
        *need = st.st_size;
        size = -2;
    } else if (usable) {
        int64_t got = 0;
        while (got < st.st_size) {
            ssize_t r = pread(fd, dst + got, (size_t)(st.st_size - got), got);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;
            got += r;
        }
        if (got == st.st_size) size = got;
    }
    close(fd);
    return size;
}

static PyObject *segcheck_read(PyObject *self, PyObject *args) {
    (void)self;
    int ns_fd;
    PyObject *names, *limits_obj;
    Py_buffer buf, limits = {0};
    if (!PyArg_ParseTuple(args, "iO!Ow*", &ns_fd, &PyList_Type, &names, &limits_obj, &buf)) return NULL;
    Py_ssize_t k = PyList_GET_SIZE(names);
    PyObject *out = NULL;
    char(*leaf)[48] = PyMem_Malloc((size_t)(k ? k : 1) * 48);
    int64_t *rows = PyMem_Malloc((size_t)(k ? k : 1) * 5 * sizeof(int64_t)); /* offset, size, hlen, span start, end */
    if (leaf == NULL || rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyObject_GetBuffer(limits_obj, &limits, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (limits.len != (Py_ssize_t)(k * (Py_ssize_t)sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "one int64 limit per name");
        goto done;
    }
    const int64_t *limit = limits.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t len;
        const char *s = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(names, i), &len);
        if (s == NULL) goto done;
        int good = len == 32;
        for (int j = 0; good && j < 32; j++) good = hexval[(unsigned char)s[j]] >= 0;
        if (!good) {
            PyErr_SetString(PyExc_ValueError, "not a segment name");
            goto done;
        }
        memcpy(leaf[i], s, 32);
        memcpy(leaf[i] + 32, ".safetensors", 13);
    }
    Py_BEGIN_ALLOW_THREADS
    char sub_name[3] = {0, 0, 0};
    int sub = -1;
    int64_t used = 0;
    int full = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t *r = rows + 5 * i;
        r[0] = used, r[1] = full ? -2 : -1, r[2] = 0, r[3] = -1, r[4] = -1;
        if (full) continue;
        if (sub < 0 || sub_name[0] != leaf[i][0] || sub_name[1] != leaf[i][1]) {
            if (sub >= 0) close(sub);
            sub_name[0] = leaf[i][0], sub_name[1] = leaf[i][1];
            sub = openat(ns_fd, sub_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        }
        if (sub < 0) continue;
        char *dst = (char *)buf.buf + used;
        int64_t need = 0, size = read_one(sub, leaf[i], dst, (int64_t)buf.len - used, limit[i], &need);
        if (size == -2) {
            r[1] = -2, r[2] = need, full = 1;
            continue;
        }
        if (size < 0) continue;
        r[1] = size;
        uint64_t hlen;
        memcpy(&hlen, dst, 8);
        r[2] = (int64_t)hlen;
        size_t lim = (size_t)(size < 8 + MAX_HEADER_BYTES ? size : 8 + MAX_HEADER_BYTES);
        char *at = memmem(dst + 8, lim - 8, CREATED_KEY, sizeof CREATED_KEY - 1);
        if (at != NULL) { /* as created_span: the closing quote within 64 bytes of the key */
            int64_t start = at - dst + (int64_t)(sizeof CREATED_KEY - 1), stop = at - dst + 64;
            if (stop > (int64_t)lim) stop = (int64_t)lim;
            char *end = start < stop ? memchr(dst + start, '"', (size_t)(stop - start)) : NULL;
            if (end != NULL) r[3] = start, r[4] = end - dst;
        }
        used += size;
    }
    if (sub >= 0) close(sub);
    Py_END_ALLOW_THREADS
    out = PyBytes_FromStringAndSize((const char *)rows, (Py_ssize_t)(k * 5 * (Py_ssize_t)sizeof(int64_t)));
done:
    PyMem_Free(leaf);
    PyMem_Free(rows);
    if (limits.obj != NULL) PyBuffer_Release(&limits);
    PyBuffer_Release(&buf);
    return out;
}

/* ------------------------------------------------------------------ judge */

static int hex_key(const unsigned char *s, uint64_t *hi, uint64_t *lo) {
    int bad = 0;
    uint64_t v[2] = {0, 0};
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 16; i++) {
            int d = hexval[s[16 * h + i]];
            bad |= d;
            v[h] = (v[h] << 4) | (uint64_t)(d & 15);
        }
    *hi = v[0], *lo = v[1];
    return bad >= 0;
}

typedef struct {
    Py_buffer buf, offs, rows, hash, parent, digest, header, fixed, fields, tokens, records;
} Views;

static int get_buffers(PyObject *objs[11], Views *v) {
    Py_buffer *bufs[11] = {&v->buf, &v->offs, &v->rows, &v->hash, &v->parent, &v->digest,
                           &v->header, &v->fixed, &v->fields, &v->tokens, &v->records};
    for (int i = 0; i < 11; i++) {
        if (PyObject_GetBuffer(objs[i], bufs[i], PyBUF_C_CONTIGUOUS) < 0) {
            for (int j = 0; j < i; j++) PyBuffer_Release(bufs[j]);
            return 0;
        }
    }
    return 1;
}

static void release_buffers(Views *v) {
    Py_buffer *bufs[11] = {&v->buf, &v->offs, &v->rows, &v->hash, &v->parent, &v->digest,
                           &v->header, &v->fixed, &v->fields, &v->tokens, &v->records};
    for (int i = 0; i < 11; i++) PyBuffer_Release(bufs[i]);
}

/* judge(buf, offs, rows, hash, parent, digest, header, fixed, fields, tokens, records,
 *       created_start, created_len, hck_at, file_size, deep) -> bytes of k verdicts (1: clean).
 * offs: int64[k] file offsets in buf; rows: int64[k, n] positions into hash, parent, digest:
 * uint64[M, 2] keys (the rows' keys, gathered in slot order by the caller: read in order here);
 * header: the template's header bytes (placeholders included);
 * fixed: int64[r, 2] runs of fixed header bytes; fields: int64[n, 3] header positions of each
 * slot's hash, parent and checksum (32 hex digits each); tokens, records: int64[n, 2] (file
 * offset, length) of each slot's token ids and record; created_start/len, hck_at: header
 * positions of the creation time and the header checksum. Header positions count from the
 * header's first byte (file offset 8); every file of the group is `file_size` bytes long. */
static PyObject *segcheck_judge(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[11];
    long long created_start, created_len, hck_at, file_size;
    int deep;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOLLLLp", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7], &objs[8], &objs[9], &objs[10], &created_start, &created_len, &hck_at,
                          &file_size, &deep))
        return NULL;
    Views v;
    if (!get_buffers(objs, &v)) return NULL;
    Py_ssize_t k = v.offs.len / 8, n = v.fields.len / 24, r_runs = v.fixed.len / 16, rows_n = v.hash.len / 16;
    int64_t hlen = (int64_t)v.header.len;
    PyObject *out = PyBytes_FromStringAndSize(NULL, k);
    unsigned char *scratch = PyMem_Malloc((size_t)(hlen ? hlen : 1));
    if (out == NULL || scratch == NULL || v.rows.len != (Py_ssize_t)(k * n * 8) || v.tokens.len != n * 16 ||
        v.parent.len != v.hash.len || v.digest.len != v.hash.len || v.fields.len != n * 24 ||
        v.records.len != n * 16 || created_start < 0 || created_start + created_len > hlen || hck_at < 0 ||
        hck_at + 32 > hlen) {
        if (out != NULL && scratch != NULL) PyErr_SetString(PyExc_ValueError, "inconsistent judge arguments");
        else if (scratch == NULL) PyErr_NoMemory();
        Py_XDECREF(out);
        PyMem_Free(scratch);
        release_buffers(&v);
        return NULL;
    }
    unsigned char *verdict = (unsigned char *)PyBytes_AS_STRING(out);
    const unsigned char *all = v.buf.buf, *tpl = v.header.buf;
    const int64_t *offs = v.offs.buf, *rows = v.rows.buf, *fixed = v.fixed.buf, *fields = v.fields.buf;
    const int64_t *tokens = v.tokens.buf, *records = v.records.buf;
    const uint64_t *hash = v.hash.buf, *parent = v.parent.buf, *digest = v.digest.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t f = 0; f < k; f++) {
        int ok = offs[f] >= 0 && offs[f] + file_size <= (int64_t)v.buf.len && 8 + hlen <= file_size;
        const unsigned char *file = all + (ok ? offs[f] : 0), *head = file + 8;
        for (Py_ssize_t i = 0; ok && i < r_runs; i++) {
            int64_t a = fixed[2 * i], b = fixed[2 * i + 1];
            ok = a >= 0 && b <= hlen && a <= b && memcmp(head + a, tpl + a, (size_t)(b - a)) == 0;
        }
        for (int64_t i = 0; ok && i < created_len; i++) ok = created_ok[head[created_start + i]];
        for (Py_ssize_t s = 0; ok && s < n; s++) {
            int64_t row = rows[f * n + s];
            const int64_t *pos = fields + 3 * s, *tok = tokens + 2 * s, *rec = records + 2 * s;
            uint64_t hi, lo, ck_hi, ck_lo;
            ok = row >= 0 && row < rows_n && pos[0] >= 0 && pos[0] + 32 <= hlen && pos[1] >= 0 && pos[1] + 32 <= hlen &&
                 pos[2] >= 0 && pos[2] + 32 <= hlen && tok[0] >= 8 && tok[1] >= 0 && tok[0] + tok[1] <= file_size &&
                 rec[0] >= 8 && rec[1] >= 0 && rec[0] + rec[1] <= file_size;
            ok = ok && hex_key(head + pos[0], &hi, &lo) && hi == hash[2 * row] && lo == hash[2 * row + 1];
            ok = ok && hex_key(head + pos[1], &hi, &lo) && hi == parent[2 * row] && lo == parent[2 * row + 1];
            ok = ok && hex_key(head + pos[2], &ck_hi, &ck_lo);
            if (ok) {
                XXH128_hash_t d = XXH3_128bits(file + tok[0], (size_t)tok[1]);
                ok = d.high64 == digest[2 * row] && d.low64 == digest[2 * row + 1];
            }
            if (ok && deep) {
                XXH128_hash_t d = XXH3_128bits(file + rec[0], (size_t)rec[1]);
                ok = d.high64 == ck_hi && d.low64 == ck_lo;
            }
        }
        if (ok) { /* the header checksum: of the header with its own value zeroed */
            uint64_t hi, lo;
            ok = hex_key(head + hck_at, &hi, &lo);
            if (ok) {
                memcpy(scratch, head, (size_t)hlen);
                memset(scratch + hck_at, '0', 32);
                XXH128_hash_t d = XXH3_128bits(scratch, (size_t)hlen);
                ok = d.high64 == hi && d.low64 == lo;
            }
        }
        verdict[f] = (unsigned char)ok;
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(scratch);
    release_buffers(&v);
    return out;
}

static PyMethodDef methods[] = {
    {"read", segcheck_read, METH_VARARGS, "read(ns_fd, names, limits, buf) -> bytes of int64 [k, 5]."},
    {"judge", segcheck_judge, METH_VARARGS, "judge(...) -> bytes of k verdicts (see the module comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_segcheck", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__segcheck(void) {
    init_tables();
    return PyModule_Create(&module);
}
