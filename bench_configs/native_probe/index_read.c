/* The compiled floor of reading a kvtool index: every `blocks` row through SQLite's C API, each
 * value type-checked as `IndexRow.from_db` does (names: TEXT of 32 lowercase hex digits, decoded
 * to 16 bytes; slot/num_tokens/nbytes: INTEGER; created/last_access: REAL or INTEGER, finite,
 * >= 0), into columns. A measurement, not part of kvtool: see README.md beside it.
 *
 * Usage: index_read INDEX.sqlite   ->  "rows N bad M T s" (T: wall seconds of the read) */
#include <math.h>
#include <sqlite3.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int16_t lut[256]; /* hex digit value, -1: not a lowercase hex digit */

static int unhex32(const unsigned char *s, int n, uint8_t *out) {
    if (n != 32) return 0;
    int bad = 0;
    for (int i = 0; i < 16; i++) {
        int a = lut[s[2 * i]], b = lut[s[2 * i + 1]];
        bad |= a | b;
        out[i] = (uint8_t)((a << 4) | b);
    }
    return bad >= 0;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    for (int c = 0; c < 256; c++) lut[c] = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    double t0 = now();
    sqlite3 *db;
    sqlite3_stmt *st;
    if (sqlite3_open_v2(argv[1], &db, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) return 1;
    const char *sql = "SELECT hash, parent, tokens_digest, segment, slot, num_tokens, nbytes, created, last_access FROM blocks";
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK) return 1;
    size_t cap = 1 << 16, n = 0;
    uint8_t *names = malloc(cap * 64);
    int32_t *ints = malloc(cap * 12);
    double *times = malloc(cap * 16);
    long bad = 0;
    while (sqlite3_step(st) == SQLITE_ROW) {
        if (n == cap) {
            cap *= 2;
            names = realloc(names, cap * 64);
            ints = realloc(ints, cap * 12);
            times = realloc(times, cap * 16);
        }
        for (int c = 0; c < 4; c++)
            bad += sqlite3_column_type(st, c) != SQLITE_TEXT ||
                   !unhex32(sqlite3_column_text(st, c), sqlite3_column_bytes(st, c), names + n * 64 + c * 16);
        for (int c = 0; c < 3; c++) {
            sqlite3_int64 v = sqlite3_column_int64(st, 4 + c);
            bad += sqlite3_column_type(st, 4 + c) != SQLITE_INTEGER || v < 0;
            ints[n * 3 + c] = (int32_t)(v > INT32_MAX ? INT32_MAX : v);
        }
        for (int c = 0; c < 2; c++) {
            int ty = sqlite3_column_type(st, 7 + c);
            double v = sqlite3_column_double(st, 7 + c);
            bad += (ty != SQLITE_FLOAT && ty != SQLITE_INTEGER) || !isfinite(v) || v < 0;
            times[n * 2 + c] = v;
        }
        n++;
    }
    sqlite3_finalize(st);
    sqlite3_close(db);
    printf("rows %zu bad %ld %.3f s\n", n, bad, now() - t0);
    return 0;
}
