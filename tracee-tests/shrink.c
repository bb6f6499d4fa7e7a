/* A thread whose stack mapping shrinks under it. Its stack is the top of a
 * region mapped as two adjacent halves, which the kernel merges into one
 * mapping; memptrace learns that mapping at the thread's first call. Then
 * the upper half is unmapped and the thread allocates again: a stack copy
 * bounded by the mapping as first seen runs into unmapped memory. memptrace
 * must read that copy itself and never let the program see the fault. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "truth.h"

#define HALF (256 * 1024)
#define CALLS 10

void *volatile truth_sink;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static int phase;

NOINLINE void *shrink_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void shrink_release(void *p)
{
    free(p);
    truth_sink = NULL;
}

static void wait_phase(int want)
{
    pthread_mutex_lock(&lock);
    while (phase < want)
        pthread_cond_wait(&cond, &lock);
    pthread_mutex_unlock(&lock);
}

static void set_phase(int now)
{
    pthread_mutex_lock(&lock);
    phase = now;
    pthread_cond_broadcast(&cond);
    pthread_mutex_unlock(&lock);
}

static void *worker(void *arg)
{
    (void)arg;
    shrink_release(shrink_alloc(100)); /* the mapping is learnt: both halves */
    set_phase(1);
    wait_phase(2); /* the upper half is gone */
    for (int i = 0; i < CALLS; i++)
        shrink_release(shrink_alloc(100));
    return NULL;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* Two halves, mapped one after the other: one mapping for the kernel. */
    char *low = mmap(NULL, 2 * HALF, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (low == MAP_FAILED)
        return 2;
    munmap(low + HALF, HALF);
    char *high = mmap(low + HALF, HALF, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (high != low + HALF)
        return 3;
    memset(high, 0, HALF);
    /* The thread's stack: the low half, whose top touches the high one. */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstack(&attr, low, HALF);
    pthread_t t;
    if (pthread_create(&t, &attr, worker, NULL) != 0)
        return 4;
    wait_phase(1);
    munmap(high, HALF);
    set_phase(2);
    pthread_join(t, NULL);
    truth("shrink_alloc", "malloc", CALLS + 1, (CALLS + 1) * 100);
    truth("shrink_release", "free", CALLS + 1, 0);
    return 0;
}
