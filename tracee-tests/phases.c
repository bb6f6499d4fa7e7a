/* Allocations in three phases separated by sleeps of 300 ms, so that a time
 * window can be placed around phase B and every block classified against
 * it; and a known peak and known temporary blocks.
 *
 *   A: phase_a_drop 10 x 1000 (freed in B), phase_a_keep 10 x 2000 (freed
 *      in C), phase_a_leak 5 x 300 (never freed)
 *   B: the phase_a_drop blocks freed; phase_b_temp 20 x 40, each freed by
 *      the next call (temporary); phase_b_short 10 x 500, all allocated and
 *      then all freed (not temporary); phase_b_keep 10 x 3000 (freed in C);
 *      phase_b_leak 4 x 700 (never freed)
 *   C: the phase_a_keep and phase_b_keep blocks freed; phase_c_peak 3 x
 *      100000 allocated, then freed: the peak, 304300 bytes in use.
 *
 * Besides the truth lines it prints, for the window from the first sleep to
 * the second,
 *     window <class> <function> <blocks> <bytes>
 * and `peak <bytes>`, `temporary <function> <blocks>`. stdout has a buffer
 * of the program's own (setvbuf), so the C library allocates nothing for
 * printing: a dynamic build's trace holds the program's calls only, and its
 * report reads the same whatever the C library's build (golden files). */
#include <time.h>

#include "truth.h"

void *volatile truth_sink;

#define ALLOCATOR(name, size)          \
    NOINLINE void *name(void)          \
    {                                  \
        void *p = malloc(size);        \
        truth_sink = p;                \
        return p;                      \
    }

ALLOCATOR(phase_a_drop, 1000)
ALLOCATOR(phase_a_keep, 2000)
ALLOCATOR(phase_a_leak, 300)
ALLOCATOR(phase_b_temp, 40)
ALLOCATOR(phase_b_short, 500)
ALLOCATOR(phase_b_keep, 3000)
ALLOCATOR(phase_b_leak, 700)
ALLOCATOR(phase_c_peak, 100000)

NOINLINE void phase_free(void *p)
{
    free(p);
    truth_sink = NULL;
}

static void pause_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0) {
    }
}

static void *drop[10], *keep_a[10], *leak_a[5], *short_b[10], *keep_b[10], *leak_b[4], *peak[3];
static char out_buffer[BUFSIZ];

int main(void)
{
    setvbuf(stdout, out_buffer, _IOFBF, sizeof out_buffer);
    for (int i = 0; i < 10; i++)
        drop[i] = phase_a_drop();
    for (int i = 0; i < 10; i++)
        keep_a[i] = phase_a_keep();
    for (int i = 0; i < 5; i++)
        leak_a[i] = phase_a_leak();

    pause_ms(300);
    for (int i = 0; i < 10; i++)
        phase_free(drop[i]);
    for (int i = 0; i < 20; i++)
        phase_free(phase_b_temp());
    for (int i = 0; i < 10; i++)
        short_b[i] = phase_b_short();
    for (int i = 0; i < 10; i++)
        phase_free(short_b[i]);
    for (int i = 0; i < 10; i++)
        keep_b[i] = phase_b_keep();
    for (int i = 0; i < 4; i++)
        leak_b[i] = phase_b_leak();

    pause_ms(300);
    for (int i = 0; i < 10; i++)
        phase_free(keep_a[i]);
    for (int i = 0; i < 10; i++)
        phase_free(keep_b[i]);
    for (int i = 0; i < 3; i++)
        peak[i] = phase_c_peak();
    for (int i = 0; i < 3; i++)
        phase_free(peak[i]);

    truth("phase_a_drop", "malloc", 10, 10000);
    truth("phase_a_keep", "malloc", 10, 20000);
    truth("phase_a_leak", "malloc", 5, 1500);
    truth("phase_b_temp", "malloc", 20, 800);
    truth("phase_b_short", "malloc", 10, 5000);
    truth("phase_b_keep", "malloc", 10, 30000);
    truth("phase_b_leak", "malloc", 4, 2800);
    truth("phase_c_peak", "malloc", 3, 300000);
    truth("phase_free", "free", 63, 0);
    truth_leak("phase_a_leak", 5, 1500);
    truth_leak("phase_b_leak", 4, 2800);
    truth_leak("phase_a_keep", 0, 0);
    printf("window allocated-before/freed-inside phase_a_drop 10 10000\n");
    printf("window allocated-before/outstanding phase_a_keep 10 20000\n");
    printf("window allocated-before/outstanding phase_a_leak 5 1500\n");
    printf("window allocated-inside/freed-inside phase_b_temp 20 800\n");
    printf("window allocated-inside/freed-inside phase_b_short 10 5000\n");
    printf("window allocated-inside/outstanding phase_b_keep 10 30000\n");
    printf("window allocated-inside/outstanding phase_b_leak 4 2800\n");
    printf("peak 304300\n");
    printf("temporary phase_b_temp 20\n");
    return 0;
}
