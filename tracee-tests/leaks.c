/* Known leaks, beside blocks that are freed: leak_small leaks 10 blocks of
 * 100 bytes, leak_big 3 blocks of 1 MiB (mmap'd chunks in glibc), and
 * churn allocates and frees 1000 blocks, leaking none. */
#include <string.h>

#include "truth.h"

void *volatile truth_sink;
static void *keep[16];

NOINLINE void *leak_small(void)
{
    void *p = malloc(100);
    truth_sink = p;
    return p;
}

NOINLINE void *leak_big(void)
{
    void *p = malloc(1 << 20);
    memset(p, 1, 64);
    truth_sink = p;
    return p;
}

NOINLINE void *churn_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void churn_free(void *p)
{
    free(p);
    truth_sink = NULL;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 0; i < 10; i++)
        keep[i] = leak_small();
    for (int i = 10; i < 13; i++)
        keep[i] = leak_big();
    for (int i = 0; i < 1000; i++)
        churn_free(churn_alloc(32 + i));
    truth("leak_small", "malloc", 10, 1000);
    truth("leak_big", "malloc", 3, 3 << 20);
    truth("churn_alloc", "malloc", 1000, 1000 * 32 + 999 * 1000 / 2);
    truth("churn_free", "free", 1000, 0);
    truth_leak("leak_small", 10, 1000);
    truth_leak("leak_big", 3, 3 << 20);
    truth_leak("churn_alloc", 0, 0);
    return 0;
}
