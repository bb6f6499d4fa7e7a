/* One thread allocating as fast as it can, N times malloc then free
 * (outrun_alloc, outrun_release): with jump probes it records calls faster
 * than memptrace can read and store them, so its ring fills up and it must
 * wait (meta.ring_waits), and every call must still be there.
 *
 * usage: outrun [N]     (default 1000000) */
#include "truth.h"

void *volatile truth_sink;

NOINLINE void *outrun_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void outrun_release(void *p)
{
    free(p);
    truth_sink = NULL;
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    unsigned long bytes = 0;
    for (long i = 0; i < n; i++) {
        size_t size = 8 + (size_t)(i % 64) * 8;
        outrun_release(outrun_alloc(size));
        bytes += size;
    }
    truth("outrun_alloc", "malloc", n, bytes);
    truth("outrun_release", "free", n, 0);
    return 0;
}
