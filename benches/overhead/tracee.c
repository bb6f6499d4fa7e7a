/* The benchmark's tracee. It times its own loop (CLOCK_MONOTONIC) and prints
 * `loop_ns <ns>` on stdout, so start-up and the tracer's end-of-trace work
 * are not counted as per-call cost, then `sleeps <n>`: the voluntary context
 * switches of the loop (getrusage), i.e. how often a thread slept in it (a
 * ptrace stop, or a jump probe waiting for room in its ring). With
 * LOOP_NS_FILE set, the lines go to that file instead: heaptrack and ltrace
 * print lines of their own.
 *
 *   tracee int3 N FILE  N int3 instructions: the bare cost of a ptrace stop
 *                       (loop_ns goes to FILE: this tracee shares the
 *                       bench's stdout)
 *   tracee st N         N x (malloc through 8 frames, free through 8 frames)
 *   tracee mt T N       T threads, each N x (malloc, free of an older block),
 *                       through 8 frames, with a few live blocks per thread
 *   tracee fair T MS    T threads, started together, each doing malloc + free
 *                       through 8 frames for MS milliseconds, flat out; prints
 *                       `iterations <n1> <n2> ...`, one count per thread
 *
 * Built with -O1 -g -fno-optimize-sibling-calls: every function below stays
 * on the stack, so each call has main + 8 frames + libc's start frames. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))

void *volatile bench_sink;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Eight frames down to malloc... */
NOINLINE void *alloc8(size_t n) { void *p = malloc(n); bench_sink = p; return p; }
NOINLINE void *alloc7(size_t n) { void *p = alloc8(n); bench_sink = p; return p; }
NOINLINE void *alloc6(size_t n) { void *p = alloc7(n); bench_sink = p; return p; }
NOINLINE void *alloc5(size_t n) { void *p = alloc6(n); bench_sink = p; return p; }
NOINLINE void *alloc4(size_t n) { void *p = alloc5(n); bench_sink = p; return p; }
NOINLINE void *alloc3(size_t n) { void *p = alloc4(n); bench_sink = p; return p; }
NOINLINE void *alloc2(size_t n) { void *p = alloc3(n); bench_sink = p; return p; }
NOINLINE void *alloc1(size_t n) { void *p = alloc2(n); bench_sink = p; return p; }

/* ...and eight down to free. */
NOINLINE void release8(void *p) { free(p); bench_sink = NULL; }
NOINLINE void release7(void *p) { release8(p); bench_sink = NULL; }
NOINLINE void release6(void *p) { release7(p); bench_sink = NULL; }
NOINLINE void release5(void *p) { release6(p); bench_sink = NULL; }
NOINLINE void release4(void *p) { release5(p); bench_sink = NULL; }
NOINLINE void release3(void *p) { release4(p); bench_sink = NULL; }
NOINLINE void release2(void *p) { release3(p); bench_sink = NULL; }
NOINLINE void release1(void *p) { release2(p); bench_sink = NULL; }

NOINLINE void int3_loop(long n)
{
    for (long i = 0; i < n; i++)
        __asm__ volatile("int3");
}

/* 40 KiB of stack above the int3s, so that a 32 KiB copy of the stack reads
 * 32 KiB (the bench prices the copy memptrace makes at each entry). */
NOINLINE void int3_deep(long n)
{
    volatile char pad[40 << 10];
    pad[0] = 1;
    int3_loop(n);
    pad[sizeof pad - 1] = pad[0];
}

static void single(long n)
{
    for (long i = 0; i < n; i++)
        release1(alloc1(16 + (size_t)(i * 37) % 1000));
}

static long per_thread;

static void *worker(void *arg)
{
    uintptr_t id = (uintptr_t)arg;
    void *held[8] = {0};
    for (long i = 0; i < per_thread; i++) {
        int slot = (int)(i % 8);
        if (held[slot])
            release1(held[slot]);
        held[slot] = alloc1(16 + (size_t)(i * 37 + id) % 2000);
    }
    for (int slot = 0; slot < 8; slot++)
        if (held[slot])
            release1(held[slot]);
    return NULL;
}

static void multi(int threads, long n)
{
    pthread_t tids[64];
    per_thread = n;
    for (int t = 0; t < threads; t++)
        pthread_create(&tids[t], NULL, worker, (void *)(uintptr_t)t);
    for (int t = 0; t < threads; t++)
        pthread_join(tids[t], NULL);
}

static atomic_int fair_stop;
static pthread_barrier_t fair_start;

static void *fair_worker(void *arg)
{
    long *count = arg;
    pthread_barrier_wait(&fair_start);
    while (!atomic_load_explicit(&fair_stop, memory_order_relaxed)) {
        release1(alloc1(16 + (size_t)(*count * 37) % 1000));
        (*count)++;
    }
    return NULL;
}

/* Every thread is created and waiting before the clock starts, so the time
 * a tracer takes over each new thread does not count against it. */
static void fair(int threads, long ms, long *counts)
{
    pthread_t tids[64];
    pthread_barrier_init(&fair_start, NULL, (unsigned)threads + 1);
    for (int t = 0; t < threads; t++)
        pthread_create(&tids[t], NULL, fair_worker, &counts[t]);
    pthread_barrier_wait(&fair_start);
    struct timespec span = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&span, NULL);
    atomic_store(&fair_stop, 1);
    for (int t = 0; t < threads; t++)
        pthread_join(tids[t], NULL);
}

static long sleeps(void)
{
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    return usage.ru_nvcsw;
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    long counts[64] = {0};
    int threads = argc >= 4 ? atoi(argv[2]) : 0;
    long slept = sleeps();
    uint64_t start = now_ns();
    if (strcmp(argv[1], "int3") == 0 && argc >= 4)
        int3_deep(atol(argv[2]));
    else if (strcmp(argv[1], "st") == 0)
        single(atol(argv[2]));
    else if (strcmp(argv[1], "mt") == 0 && argc >= 4 && threads > 0 && threads <= 64)
        multi(threads, atol(argv[3]));
    else if (strcmp(argv[1], "fair") == 0 && argc >= 4 && threads > 0 && threads <= 64)
        fair(threads, atol(argv[3]), counts);
    else
        return 2;
    uint64_t took = now_ns() - start;
    slept = sleeps() - slept;
    /* No stdio: its buffers would be allocations of their own. */
    char text[2048];
    int len = snprintf(text, sizeof text, "loop_ns %llu\nsleeps %ld\n", (unsigned long long)took, slept);
    if (strcmp(argv[1], "fair") == 0) {
        len += snprintf(text + len, sizeof text - (size_t)len, "iterations");
        for (int t = 0; t < threads; t++)
            len += snprintf(text + len, sizeof text - (size_t)len, " %ld", counts[t]);
        len += snprintf(text + len, sizeof text - (size_t)len, "\n");
    }
    const char *path = strcmp(argv[1], "int3") == 0 ? argv[3] : getenv("LOOP_NS_FILE");
    int fd = path ? open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644) : 1;
    if (fd < 0 || write(fd, text, (size_t)len) != len)
        return 3;
    return 0;
}
