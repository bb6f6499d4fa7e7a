/* The scale workload of issue 19: 2 threads making CALLS allocator calls in
 * all (default 1,000,000), from 200 call stacks of 6 to 13 frames, 5 % of
 * the blocks leaked. Each thread keeps 64 blocks live, replacing a random
 * one at each step (free, then malloc from one of the 200 stacks); one
 * block in 20 is leaked instead of freed. At the end each thread frees the
 * blocks it still holds (but not the leaked ones).
 *
 * The stacks: scale_a, scale_b and scale_c call each other, DEPTH levels
 * deep below the first (2 to 9), the path chosen by the stack's number in
 * base 3, its last digit choosing the first function; with the worker,
 * start_thread and clone that is 6 to 13 frames. Stack k: depth 2 + k % 8,
 * path k / 8 (25 paths, distinct at every depth: 3^3 = 27).
 *
 * Prints, on stdout, its ground truth for the whole process:
 *
 *     truth scale mallocs <n> frees <n> bytes <n>
 *     leak scale <blocks> <bytes>
 *     cpu_us <user + system CPU time of this process, microseconds>
 *
 * The last line lets a benchmark take the program's own CPU time out of
 * the tracer's (a tracer's rusage includes the children it waited for).
 * usage: scale [CALLS] */
#include <pthread.h>
#include <stdint.h>
#include <sys/resource.h>

#include "truth.h"

#define THREADS 2
#define STACKS 200
#define LIVE 64

void *volatile truth_sink;

static long calls_per_thread = 500000;

struct tally {
    long mallocs, frees, leaked;
    unsigned long bytes, leaked_bytes;
};

NOINLINE void *scale_a(int depth, unsigned path, size_t n);
NOINLINE void *scale_b(int depth, unsigned path, size_t n);
NOINLINE void *scale_c(int depth, unsigned path, size_t n);

/* One level: malloc at the bottom, else the next level chosen by the path's
 * last base-3 digit (three call sites, three return addresses). */
#define LEVEL(name)                                                        \
    NOINLINE void *name(int depth, unsigned path, size_t n)               \
    {                                                                      \
        void *p;                                                           \
        if (depth == 0)                                                    \
            p = malloc(n);                                                 \
        else if (path % 3 == 0)                                            \
            p = scale_a(depth - 1, path / 3, n);                           \
        else if (path % 3 == 1)                                            \
            p = scale_b(depth - 1, path / 3, n);                           \
        else                                                               \
            p = scale_c(depth - 1, path / 3, n);                           \
        truth_sink = p;                                                    \
        return p;                                                          \
    }

LEVEL(scale_a)
LEVEL(scale_b)
LEVEL(scale_c)

static void *(*const first[3])(int, unsigned, size_t) = {scale_a, scale_b, scale_c};

NOINLINE void scale_release(void *p)
{
    free(p);
    truth_sink = NULL;
}

static uint64_t next(uint64_t *state)
{
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

static void *worker(void *arg)
{
    struct tally *t = arg;
    uint64_t state = 0x9e3779b97f4a7c15u ^ (uint64_t)(uintptr_t)arg;
    void *live[LIVE] = {0};
    size_t sizes[LIVE] = {0};
    long calls = 0;
    while (calls < calls_per_thread) {
        uint64_t r = next(&state);
        unsigned slot = r % LIVE;
        unsigned stack = (r >> 8) % STACKS;
        if (live[slot] != NULL) {
            if ((r >> 20) % 20 == 0) {
                t->leaked++;
                t->leaked_bytes += sizes[slot];
            } else {
                scale_release(live[slot]);
                t->frees++;
                calls++;
            }
            live[slot] = NULL;
        }
        size_t n = 16 + (stack * 37 + (r >> 32) % 8 * 8) % 1000;
        unsigned path = stack / 8;
        live[slot] = first[path % 3](2 + stack % 8, path / 3, n);
        sizes[slot] = n;
        t->bytes += n;
        t->mallocs++;
        calls++;
    }
    for (unsigned slot = 0; slot < LIVE; slot++) {
        if (live[slot] != NULL) {
            scale_release(live[slot]);
            t->frees++;
        }
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        calls_per_thread = atol(argv[1]) / THREADS;
    pthread_t threads[THREADS];
    static struct tally tallies[THREADS];
    for (int i = 0; i < THREADS; i++)
        pthread_create(&threads[i], NULL, worker, &tallies[i]);
    struct tally all = {0};
    for (int i = 0; i < THREADS; i++) {
        pthread_join(threads[i], NULL);
        all.mallocs += tallies[i].mallocs;
        all.frees += tallies[i].frees;
        all.bytes += tallies[i].bytes;
        all.leaked += tallies[i].leaked;
        all.leaked_bytes += tallies[i].leaked_bytes;
    }
    printf("truth scale mallocs %ld frees %ld bytes %lu\n", all.mallocs, all.frees, all.bytes);
    printf("leak scale %ld %lu\n", all.leaked, all.leaked_bytes);
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    printf("cpu_us %ld\n", (long)(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) * 1000000 +
                               usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
    return 0;
}
