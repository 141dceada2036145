/* The compiled floor of `validate --deep`'s file work: list a share of a namespace's fan-out
 * directories, open each segment file confined (O_NOFOLLOW | O_NONBLOCK, then fstat: regular
 * files only), read it whole, and take the xxh3-128 digests `validate --deep` needs (every
 * record, every record's token ids, the header). Records are assumed to be the synthetic ones of
 * `million_blocks.py` (16 a file, RECORD bytes each, TOKENS token ids): the cost under test is
 * per file and per record, not the parsing. A measurement, not part of kvtool: see README.md.
 *
 * Usage: segment_read NAMESPACE_DIR PART PARTS  ->  "part P files F bytes B T s"
 * (fan-out directories PART, PART + PARTS, ...: run PARTS of them at once, one per core) */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define RECORD 1088
#define TOKENS 16
#define MAX_FILE (1 << 20)

/* libxxhash's stable ABI (xxHash 0.8): linked as libxxhash.so.0, no header needed */
typedef struct {
    unsigned long long low64, high64;
} XXH128_hash_t;
XXH128_hash_t XXH3_128bits(const void *data, size_t len);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    double t0 = now();
    int part = atoi(argv[2]), parts = atoi(argv[3]);
    int ns = open(argv[1], O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (ns < 0) return 1;
    DIR *top = fdopendir(dup(ns));
    struct dirent *e;
    char subs[256][3];
    int nsub = 0;
    while ((e = readdir(top)) && nsub < 256)
        if (strlen(e->d_name) == 2) memcpy(subs[nsub++], e->d_name, 3);
    closedir(top);
    static unsigned char buf[MAX_FILE];
    long files = 0, bytes = 0;
    unsigned long long fold = 0; /* keeps the digests from being optimised away */
    for (int s = part; s < nsub; s += parts) {
        int sfd = openat(ns, subs[s], O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (sfd < 0) continue;
        DIR *d = fdopendir(sfd);
        while ((e = readdir(d))) {
            if (strlen(e->d_name) != 44 || e->d_type != DT_REG) continue;
            int fd = openat(sfd, e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
            if (fd < 0) continue;
            struct stat st;
            if (fstat(fd, &st) || !S_ISREG(st.st_mode) || st.st_size > MAX_FILE || st.st_size < 8) {
                close(fd);
                continue;
            }
            ssize_t got = pread(fd, buf, st.st_size, 0);
            close(fd);
            if (got != st.st_size) continue;
            uint64_t hlen;
            memcpy(&hlen, buf, 8);
            if (8 + hlen + 16 * RECORD > (uint64_t)got) continue;
            for (int k = 0; k < 16; k++) {
                const unsigned char *rec = buf + 8 + hlen + (size_t)k * RECORD;
                fold += XXH3_128bits(rec, RECORD).low64 ^ XXH3_128bits(rec, 4 * TOKENS).high64;
            }
            fold += XXH3_128bits(buf + 8, hlen).low64;
            files++;
            bytes += got;
        }
        closedir(d);
    }
    printf("part %d files %ld bytes %ld %.3f s (%llx)\n", part, files, bytes, now() - t0, fold & 0xff);
    return 0;
}
