/* How long this program stands still: it allocates BLOCKS blocks (default
 * 200 000, sizes 16 to 512 bytes) and frees every fourth,
 * prints `ready PID`, then loops: a malloc and a free, then a spin reading
 * CLOCK_MONOTONIC for 50 µs. Any stop of the thread (memptrace attaching or
 * detaching, the scheduler) shows as a gap between two readings.
 *
 * On SIGUSR1 it prints `gaps <longest µs>@<ms> <second>@<ms> <third>@<ms>`:
 * the three longest gaps since the last report, each with when it ended
 * (ms since that report), and starts again; on SIGTERM
 * or SIGINT it prints the same and exits 0.
 *
 * usage: gaps [BLOCKS] */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "truth.h"

void *volatile truth_sink;

static volatile sig_atomic_t report, stop;

static void on_usr1(int sig)
{
    (void)sig;
    report = 1;
}

static void on_term(int sig)
{
    (void)sig;
    stop = 1;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

NOINLINE static void gaps_build(void **blocks, long n)
{
    for (long i = 0; i < n; i++)
        blocks[i] = malloc(16 + (size_t)(i * 37 % 497));
    for (long i = 0; i < n; i += 4) {
        free(blocks[i]);
        blocks[i] = NULL;
    }
}

NOINLINE static void gaps_step(void)
{
    void *p = malloc(64);
    truth_sink = p;
    free(p);
}

/* The three longest gaps, in µs, and when each ended (ns). */
static uint64_t top[3], top_at[3], since;

static void note(uint64_t gap, uint64_t at)
{
    for (int i = 0; i < 3; i++)
        if (gap > top[i]) {
            for (int j = 2; j > i; j--) {
                top[j] = top[j - 1];
                top_at[j] = top_at[j - 1];
            }
            top[i] = gap;
            top_at[i] = at;
            return;
        }
}

static void say(void)
{
    printf("gaps");
    for (int i = 0; i < 3; i++)
        printf(" %lu@%lu", (unsigned long)top[i],
               (unsigned long)(top[i] ? (top_at[i] - since) / 1000000 : 0));
    printf("\n");
    fflush(stdout);
    top[0] = top[1] = top[2] = 0;
    since = now_ns();
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 200000;
    void **blocks = malloc(sizeof *blocks * (size_t)(n > 0 ? n : 1));
    gaps_build(blocks, n);
    signal(SIGUSR1, on_usr1);
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    uint64_t last = now_ns();
    since = last;
    while (!stop) {
        gaps_step();
        uint64_t step_start = now_ns();
        uint64_t t = step_start;
        /* The malloc and free: a gap too, if memptrace stopped them. */
        note((t - last) / 1000, t);
        last = t;
        while (t - step_start < 50000) {
            t = now_ns();
            note((t - last) / 1000, t);
            last = t;
        }
        if (report) {
            report = 0;
            say();
            last = now_ns();
        }
    }
    say();
    return 0;
}
