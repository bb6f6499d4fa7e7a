/* Eight threads (or argv[1]), each making exactly 10 000 allocator calls
 * (5 000 malloc, 5 000 free; or 2 * argv[2]) from thread_alloc /
 * thread_release, all at the same time. */
#include <pthread.h>
#include <stdint.h>

#include "truth.h"

#define MAX_THREADS 256
static int THREADS = 8, PAIRS = 5000;

void *volatile truth_sink;
static pthread_barrier_t start;

NOINLINE void *thread_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void thread_release(void *p)
{
    free(p);
    truth_sink = NULL;
}

static void *worker(void *arg)
{
    uintptr_t id = (uintptr_t)arg;
    void *held[16] = {0};
    pthread_barrier_wait(&start);
    for (int i = 0; i < PAIRS; i++) {
        int slot = i % 16;
        if (held[slot])
            thread_release(held[slot]);
        held[slot] = thread_alloc(16 + (i * 7 + id) % 1000);
    }
    for (int slot = 0; slot < 16; slot++)
        thread_release(held[slot]);
    return NULL;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc > 1)
        THREADS = atoi(argv[1]);
    if (argc > 2)
        PAIRS = atoi(argv[2]);
    if (THREADS < 1 || THREADS > MAX_THREADS || PAIRS < 16)
        return 2;
    pthread_t threads[MAX_THREADS];
    pthread_barrier_init(&start, NULL, THREADS);
    for (uintptr_t t = 0; t < THREADS; t++)
        pthread_create(&threads[t], NULL, worker, (void *)t);
    for (int t = 0; t < THREADS; t++)
        pthread_join(threads[t], NULL);

    unsigned long bytes = 0;
    for (uintptr_t id = 0; id < (uintptr_t)THREADS; id++)
        for (int i = 0; i < PAIRS; i++)
            bytes += 16 + (i * 7 + id) % 1000;
    truth("thread_alloc", "malloc", (long)THREADS * PAIRS, bytes);
    truth("thread_release", "free", (long)THREADS * PAIRS, 0);
    printf("threads %d %d\n", THREADS, 2 * PAIRS);
    return 0;
}
