/* A program that runs for a while: every 5 ms for DURATION_MS milliseconds
 * (argument 1, default 3000) ticker_step allocates a 64-byte block and
 * frees the one before, so a trace keeps growing while the program runs.
 * The last block is freed at the end. */
#include <time.h>

#include "truth.h"

void *volatile truth_sink;

NOINLINE void *ticker_step(void *previous)
{
    void *p = malloc(64);
    free(previous);
    truth_sink = p;
    return p;
}

static long now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

int main(int argc, char **argv)
{
    long duration = argc > 1 ? atol(argv[1]) : 3000;
    long start = now_ms();
    long steps = 0;
    void *block = NULL;
    struct timespec pause = {0, 5 * 1000000L};
    while (now_ms() - start < duration) {
        block = ticker_step(block);
        steps++;
        nanosleep(&pause, NULL);
    }
    free(block);
    truth("ticker_step", "malloc", steps, (unsigned long)steps * 64);
    /* The first free is free(NULL). */
    truth("ticker_step", "free", steps, 0);
    return 0;
}
