/* A program that runs for a while, so a trace keeps growing while the
 * program runs. ticker_step allocates a 64-byte block and frees the one
 * before; the last block is freed at the end.
 *
 *   ticker [DURATION_MS]   a step every 5 ms for DURATION_MS milliseconds
 *                          (default 3000)
 *   ticker stdin           a step for each line read on stdin, each followed
 *                          by `step N` on stdout once it is done; ends at EOF
 *
 * With `stdin`, a test decides when each call happens and knows when it
 * has: it can wait for a condition instead of sleeping. */
#include <string.h>
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
    setvbuf(stdout, NULL, _IOLBF, 0);
    long steps = 0;
    void *block = NULL;
    if (argc > 1 && strcmp(argv[1], "stdin") == 0) {
        int c;
        while ((c = getchar()) != EOF)
            if (c == '\n') {
                block = ticker_step(block);
                printf("step %ld\n", ++steps);
            }
    } else {
        long duration = argc > 1 ? atol(argv[1]) : 3000;
        long start = now_ms();
        struct timespec pause = {0, 5 * 1000000L};
        while (now_ms() - start < duration) {
            block = ticker_step(block);
            steps++;
            nanosleep(&pause, NULL);
        }
    }
    free(block);
    truth("ticker_step", "malloc", steps, (unsigned long)steps * 64);
    /* The first free is free(NULL). */
    truth("ticker_step", "free", steps, 0);
    return 0;
}
