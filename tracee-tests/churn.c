/* 1000 short-lived threads, at most 16 alive at once, each making 20
 * allocator calls from churn_alloc and churn_release, then exiting (glibc
 * then releases the thread's cached blocks through free: not the program's
 * calls). */
#include <pthread.h>

#include "truth.h"

#define THREADS 1000
#define BATCH 16
#define PAIRS 10

void *volatile truth_sink;

NOINLINE void *churn_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void churn_release(void *p)
{
    free(p);
    truth_sink = NULL;
}

static void *short_life(void *arg)
{
    (void)arg;
    for (int i = 0; i < PAIRS; i++)
        churn_release(churn_alloc(24 + i));
    return NULL;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    pthread_t batch[BATCH];
    for (int done = 0; done < THREADS; done += BATCH) {
        int n = THREADS - done < BATCH ? THREADS - done : BATCH;
        for (int t = 0; t < n; t++)
            pthread_create(&batch[t], NULL, short_life, NULL);
        for (int t = 0; t < n; t++)
            pthread_join(batch[t], NULL);
    }
    truth("churn_alloc", "malloc", THREADS * PAIRS, THREADS * (24 * PAIRS + PAIRS * (PAIRS - 1) / 2));
    truth("churn_release", "free", THREADS * PAIRS, 0);
    printf("threads %d\n", THREADS);
    return 0;
}
