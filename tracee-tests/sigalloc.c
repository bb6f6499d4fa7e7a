/* Signal handlers that allocate, landing anywhere: inside the allocator,
 * inside memptrace's code on the way in or out of it. The program brings
 * its own allocator (a bump allocator, safe to call from a handler that
 * interrupted it), which memptrace hooks like any other: malloc, free,
 * calloc and realloc are defined here and interpose the C library's.
 *
 * The main thread allocates in a tight loop (outer_alloc, outer_release)
 * while an interval timer fires SIGALRM every 50 us (or as told); the handler allocates,
 * grows and frees (handler_alloc, handler_resize, handler_release) and counts
 * its calls, and the calls realloc makes inside itself (one malloc each:
 * never recorded, always counted in meta.nested_calls). The main thread's
 * calls are all outermost: each is recorded. With int3 probes a handler's
 * call is always recorded (a level of its own while the call it interrupted
 * is pending), so meta.nested_calls is exactly the inner calls. With jump
 * probes a handler's call is recorded unless it interrupted one of the
 * thread's allocator functions, when it is counted in meta.nested_calls
 * instead (a call inside a probe is recorded: the thread's signal slot):
 * recorded calls and nested_calls add up exactly. Nothing may be lost or
 * corrupted.
 *
 * usage: sigalloc [ITERATIONS [INTERVAL_US]]     (default 200000, 50) */
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/time.h>

#include "truth.h"

void *volatile truth_sink;
static volatile long handler_calls, handler_inner;

static char arena[96 << 20] __attribute__((aligned(16)));
static atomic_size_t used;
static atomic_long freed;

/* noinline: the program's calls must be calls, as they are to a C
 * library's allocator. */
NOINLINE void *malloc(size_t n)
{
    size_t size = (n + 15) & ~(size_t)15;
    size_t at = atomic_fetch_add(&used, size ? size : 16);
    if (at + size > sizeof arena)
        return NULL;
    return arena + at;
}

NOINLINE void free(void *p)
{
    if (p)
        atomic_fetch_add(&freed, 1);
}

NOINLINE void *calloc(size_t n, size_t m)
{
    return n && m > (size_t)-1 / n ? NULL : malloc(n * m); /* never reused: zero */
}

NOINLINE void *realloc(void *p, size_t n)
{
    char *q = malloc(n);
    if (p && q) {
        size_t room = (size_t)(arena + sizeof arena - (char *)p);
        memcpy(q, p, n < room ? n : room);
    }
    return q;
}

NOINLINE void *outer_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void outer_release(void *p)
{
    free(p);
    truth_sink = NULL;
}

NOINLINE void *handler_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void *handler_resize(void *p, size_t n)
{
    void *q = realloc(p, n);
    truth_sink = q;
    return q;
}

NOINLINE void handler_release(void *p)
{
    free(p);
    truth_sink = NULL;
}

static void on_alarm(int sig)
{
    (void)sig;
    handler_release(handler_resize(handler_alloc(24), 48));
    handler_calls += 3;
    handler_inner += 1; /* realloc's malloc */
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 200000;
    long interval = argc > 2 ? atol(argv[2]) : 50;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval every = {{0, interval}, {0, interval}};
    setitimer(ITIMER_REAL, &every, NULL);
    unsigned long bytes = 0;
    for (long i = 0; i < n; i++) {
        size_t size = 16 + (size_t)(i % 200);
        void *p = outer_alloc(size);
        bytes += size;
        outer_release(p);
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &off, NULL);
    truth("outer_alloc", "malloc", n, bytes);
    truth("outer_release", "free", n, 0);
    printf("handler_calls %ld\n", handler_calls);
    printf("handler_inner %ld\n", handler_inner);
    return 0;
}
