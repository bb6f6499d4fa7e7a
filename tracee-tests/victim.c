/* A long-running multithreaded process for memptrace to attach to and detach
 * from, again and again, that checks itself for damage. Workers allocate
 * blocks of many sizes (some big enough to be mmap'd, so threads are often
 * inside the allocator when memptrace stops them), fill each with a pattern
 * and check the pattern before freeing it; one thread sleeps and reads a pipe
 * in a loop, and must never see a system call fail; the code of the
 * allocator functions must read the same at the end as at the start (no
 * int3 left behind once no tracer is attached). It prints "ready PID" once running, runs until SIGTERM
 * or SIGINT (or 300 s), then prints its verdict and its truth (every call it
 * made) and exits 0 only if nothing was damaged. With `count-int`, SIGINT
 * is counted instead of ending it: `interrupt N` is printed once the Nth
 * has arrived, so a test can wait for it before sending the next. With
 * `leader-exits`, the main thread exits once "ready" is printed and the
 * other threads run on (a zombie leader) until SIGKILL (or 300 s).
 *
 * usage: victim [THREADS [count-int|leader-exits]]      (default 4 threads) */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "truth.h"

#define RING 64
#define MAX_THREADS 64

void *volatile truth_sink;
static volatile sig_atomic_t stop;
static volatile long damage, allocations, frees, bytes, syscalls;
static volatile sig_atomic_t interrupts;
static int pipefd[2];

static void on_term(int sig)
{
    (void)sig;
    stop = 1;
}

static void on_int(int sig)
{
    (void)sig;
    interrupts++;
}

/* The pid of the process tracing this one, 0 for none. */
static void complain(const char *what, long a, long b)
{
    fprintf(stderr, "victim: %s (%ld, %ld)\n", what, a, b);
    __atomic_add_fetch(&damage, 1, __ATOMIC_SEQ_CST);
}

NOINLINE void *victim_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void victim_free(void *p)
{
    free(p);
    truth_sink = NULL;
}

static unsigned char pattern(uintptr_t id, long seq, size_t i)
{
    return (unsigned char)(id * 31 + seq * 7 + i);
}

static void *worker(void *arg)
{
    uintptr_t id = (uintptr_t)arg;
    struct { unsigned char *p; size_t n; long seq; } ring[RING] = {{0}};
    static const size_t sizes[] = {16, 40, 100, 500, 4000, 70000, 300000};
    for (long seq = 0; !stop; seq++) {
        int slot = seq % RING;
        if (ring[slot].p) {
            for (size_t i = 0; i < ring[slot].n; i += 97)
                if (ring[slot].p[i] != pattern(id, ring[slot].seq, i)) {
                    complain("block damaged", (long)id, ring[slot].seq);
                    break;
                }
            victim_free(ring[slot].p);
            __atomic_add_fetch(&frees, 1, __ATOMIC_RELAXED);
        }
        size_t n = sizes[(seq + id) % 7] + seq % 13;
        unsigned char *p = victim_alloc(n);
        if (!p) {
            complain("malloc failed", (long)id, (long)n);
            continue;
        }
        for (size_t i = 0; i < n; i += 97)
            p[i] = pattern(id, seq, i);
        ring[slot].p = p;
        ring[slot].n = n;
        ring[slot].seq = seq;
        __atomic_add_fetch(&allocations, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&bytes, n, __ATOMIC_RELAXED);
    }
    for (int slot = 0; slot < RING; slot++) {
        victim_free(ring[slot].p);
        __atomic_add_fetch(&frees, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

/* System calls that must not fail because a tracer came and went: no signal
 * handler runs in this thread (SIGTERM is blocked in it), so POSIX allows no
 * EINTR here. */
static void *sleeper(void *arg)
{
    (void)arg;
    char c;
    while (!stop) {
        struct timespec t = {0, 1000000};
        if (nanosleep(&t, NULL) != 0)
            complain("nanosleep failed", errno, 0);
        if (write(pipefd[1], "x", 1) != 1)
            complain("write failed", errno, 0);
        if (read(pipefd[0], &c, 1) != 1)
            complain("read failed", errno, 0);
        __atomic_add_fetch(&syscalls, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    int threads = argc > 1 ? atoi(argv[1]) : 4;
    if (threads < 1 || threads > MAX_THREADS)
        return 2;
    /* The allocator's first bytes, to compare at the end. */
    unsigned char *code[] = {(unsigned char *)malloc, (unsigned char *)free,
                             (unsigned char *)calloc, (unsigned char *)realloc};
    unsigned char before[4][16];
    for (int i = 0; i < 4; i++)
        memcpy(before[i], code[i], 16);
    int traced_at_start = tracer_pid() != 0;
    if (pipe(pipefd) != 0)
        return 2;

    int count_int = argc > 2 && strcmp(argv[2], "count-int") == 0;
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    sigaddset(&term, SIGINT);
    pthread_sigmask(SIG_BLOCK, &term, NULL);
    pthread_t tids[MAX_THREADS + 1];
    for (int t = 0; t < threads; t++)
        pthread_create(&tids[t], NULL, worker, (void *)(uintptr_t)t);
    pthread_create(&tids[threads], NULL, sleeper, NULL);
    signal(SIGTERM, on_term);
    signal(SIGINT, count_int ? on_int : on_term);
    pthread_sigmask(SIG_UNBLOCK, &term, NULL);

    printf("ready %d\n", (int)getpid());
    if (argc > 2 && strcmp(argv[2], "leader-exits") == 0) {
        alarm(300);
        pthread_exit(NULL);
    }
    int reported = 0;
    for (int i = 0; i < 300000 && !stop; i++) {
        usleep(1000);
        if (interrupts != reported) {
            reported = interrupts;
            printf("interrupt %d\n", reported);
        }
    }
    stop = 1;
    for (int t = 0; t <= threads; t++)
        pthread_join(tids[t], NULL);
    /* Untraced now: no int3 may be left, and code seen untraced at the start
     * must read the same. (Traced from the start, the first bytes were int3s.) */
    if (tracer_pid() == 0)
        for (int i = 0; i < 4; i++) {
            if (code[i][0] == 0xcc)
                complain("int3 left in the allocator", i, code[i][0]);
            if (!traced_at_start && memcmp(before[i], code[i], 16) != 0)
                complain("allocator code changed", i, code[i][0]);
        }
    printf("victim: %ld allocations, %ld system call rounds, %d interrupts, %ld damaged\n",
           allocations, syscalls, (int)interrupts, damage);
    truth("victim_alloc", "malloc", allocations, (unsigned long)bytes);
    truth("victim_free", "free", frees, 0);
    return damage == 0 ? 0 : 1;
}
