/* A process that must outlive the memptrace attached to it (SIGKILL, OOM, a
 * crash). Workers allocate blocks of many sizes, fill each with a pattern
 * and check it before freeing it, and new threads come and go all the time
 * (each one's first call finds no slot in the jump probes' memory). It
 * prints "ready PID", then waits for a line on stdin ("go", sent once the
 * test has killed or stopped memptrace), and then:
 *   - prints "tracer PID" (0: none);
 *   - makes BURST malloc/free pairs in one thread (1,000,000 unless told) (its ring in the
 *     jump probes' memory fills if nobody reads it), then prints "burst";
 *   - starts 16 new threads that allocate (no slot: the probes' miss path);
 *   - loads libplugin.so (path in argv[1]) with dlopen, calls into it and
 *     unloads it (the dynamic linker's _dl_debug_state, which memptrace
 *     hooks to see images come and go);
 * then stops the workers and prints its verdict and its calls. It exits 0
 * only if every block read back as written and every call returned what it
 * must.
 *
 * usage: failopen PATH-TO-libplugin.so [BURST] */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "truth.h"

#define RING 32
#define WORKERS 3
#define LATE_THREADS 16

void *volatile truth_sink;
static volatile int stop;
static volatile long damage, allocations, frees, bytes, threads_made;

static void complain(const char *what, long a, long b)
{
    fprintf(stderr, "failopen: %s (%ld, %ld)\n", what, a, b);
    __atomic_add_fetch(&damage, 1, __ATOMIC_SEQ_CST);
}

NOINLINE void *failopen_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void failopen_free(void *p)
{
    free(p);
    truth_sink = NULL;
}

static unsigned char pattern(uintptr_t id, long seq, size_t i)
{
    return (unsigned char)(id * 31 + seq * 7 + i);
}

/* `rounds` blocks through a ring, each checked before it is freed (forever
 * with rounds < 0, until `stop`). */
static void churn(uintptr_t id, long rounds)
{
    struct { unsigned char *p; size_t n; long seq; } ring[RING] = {{0}};
    static const size_t sizes[] = {16, 40, 100, 500, 4000, 70000};
    for (long seq = 0; rounds < 0 ? !stop : seq < rounds; seq++) {
        int slot = seq % RING;
        if (ring[slot].p) {
            for (size_t i = 0; i < ring[slot].n; i += 61)
                if (ring[slot].p[i] != pattern(id, ring[slot].seq, i)) {
                    complain("block damaged", (long)id, ring[slot].seq);
                    break;
                }
            failopen_free(ring[slot].p);
            __atomic_add_fetch(&frees, 1, __ATOMIC_RELAXED);
        }
        size_t n = sizes[(seq + id) % 6] + seq % 11;
        unsigned char *p = failopen_alloc(n);
        if (!p) {
            complain("malloc failed", (long)id, (long)n);
            ring[slot].p = NULL;
            continue;
        }
        for (size_t i = 0; i < n; i += 61)
            p[i] = pattern(id, seq, i);
        ring[slot] = (typeof(ring[slot])){p, n, seq};
        __atomic_add_fetch(&allocations, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&bytes, n, __ATOMIC_RELAXED);
    }
    for (int slot = 0; slot < RING; slot++)
        if (ring[slot].p) {
            failopen_free(ring[slot].p);
            __atomic_add_fetch(&frees, 1, __ATOMIC_RELAXED);
        }
}

static void *worker(void *arg)
{
    churn((uintptr_t)arg, -1);
    return NULL;
}

static void *short_lived(void *arg)
{
    churn((uintptr_t)arg, 200);
    __atomic_add_fetch(&threads_made, 1, __ATOMIC_RELAXED);
    return NULL;
}

/* New threads, one after the other, while the workers run. */
static void *spawner(void *arg)
{
    (void)arg;
    for (uintptr_t id = 100; !stop; id++) {
        pthread_t t;
        if (pthread_create(&t, NULL, short_lived, (void *)id) != 0) {
            complain("pthread_create failed", (long)id, 0);
            break;
        }
        pthread_join(t, NULL);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) {
        fprintf(stderr, "usage: failopen PATH-TO-libplugin.so\n");
        return 2;
    }
    long burst = argc > 2 ? atol(argv[2]) : 1000000;
    pthread_t workers[WORKERS], spawn;
    for (uintptr_t t = 0; t < WORKERS; t++)
        pthread_create(&workers[t], NULL, worker, (void *)t);
    pthread_create(&spawn, NULL, spawner, NULL);
    printf("ready %d\n", (int)getpid());

    char line[64];
    if (!fgets(line, sizeof line, stdin))
        return 2;
    printf("tracer %d\n", tracer_pid());

    /* One thread's ring fills up, with nobody to read it. */
    for (long i = 0; i < burst; i++) {
        void *p = failopen_alloc(24 + i % 8);
        if (!p) {
            complain("malloc failed in the burst", i, 0);
            break;
        }
        failopen_free(p);
    }
    __atomic_add_fetch(&allocations, burst, __ATOMIC_RELAXED);
    __atomic_add_fetch(&frees, burst, __ATOMIC_RELAXED);
    printf("burst\n");

    pthread_t late[LATE_THREADS];
    for (uintptr_t t = 0; t < LATE_THREADS; t++)
        if (pthread_create(&late[t], NULL, short_lived, (void *)(1000 + t)) != 0)
            complain("pthread_create failed", (long)t, 0);
    for (int t = 0; t < LATE_THREADS; t++)
        pthread_join(late[t], NULL);

    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) {
        complain("dlopen failed", 0, 0);
        fprintf(stderr, "failopen: %s\n", dlerror());
    } else {
        void (*work)(int) = (void (*)(int))dlsym(lib, "plugin_work");
        if (work)
            work(10);
        else
            complain("no plugin_work", 0, 0);
        if (dlclose(lib) != 0)
            complain("dlclose failed", 0, 0);
    }

    stop = 1;
    for (int t = 0; t < WORKERS; t++)
        pthread_join(workers[t], NULL);
    pthread_join(spawn, NULL);
    if (allocations != frees)
        complain("blocks not freed", allocations, frees);
    printf("failopen: %ld allocations, %ld frees, %ld short-lived threads, %ld damaged\n",
           allocations, frees, threads_made, damage);
    return damage == 0 ? 0 : 1;
}
