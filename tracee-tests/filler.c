/* Fills a trace: ROUNDS (argument 1, default 200) rounds of 5000 malloc
 * and free pairs from stacks of 1 to 32 frames (fill_alloc and
 * fill_release under fill_deeper), then prints `done <calls>` and its
 * TracerPid (`tracer <pid>`: 0 once memptrace let it go) and exits 3:
 * a trace that --max-size or a full disk ends while the program runs on
 * (tests/integration/full.rs). With `wait` it prints `ready <pid>` and
 * goes on until SIGTERM, then prints the same and exits 3. */
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "truth.h"

static volatile sig_atomic_t stop;

static void on_term(int sig)
{
    (void)sig;
    stop = 1;
}

void *volatile truth_sink;

NOINLINE void *fill_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void fill_release(void *p)
{
    free(p);
    truth_sink = NULL;
}

NOINLINE void fill_deeper(int depth, int i)
{
    if (depth > 1) {
        fill_deeper(depth - 1, i);
        truth_sink = NULL;
        return;
    }
    fill_release(fill_alloc(16 + (size_t)(i % 512)));
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    int wait = argc > 1 && strcmp(argv[1], "wait") == 0;
    long rounds = argc > 1 && !wait ? atol(argv[1]) : 200;
    long calls = 0;
    if (wait) {
        signal(SIGTERM, on_term);
        printf("ready %d\n", (int)getpid());
    }
    for (long r = 0; wait ? !stop : r < rounds; r++) {
        for (int i = 0; i < 5000; i++) {
            fill_deeper(1 + i % 32, i);
            calls += 2;
        }
    }
    printf("done %ld\n", calls);
    printf("tracer %d\n", tracer_pid());
    return 3;
}
