/* Every allocator function memptrace hooks, and its edge cases, each called
 * from a function of its own. */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "truth.h"

void *volatile truth_sink;

/* NULL, hidden from the compiler, which turns realloc(NULL, n) into
 * malloc(n) and drops free(NULL). */
static void *volatile null_block;

NOINLINE void *api_malloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void api_free(void *p)
{
    free(p);
    truth_sink = NULL;
}

NOINLINE void *api_calloc(size_t n, size_t m)
{
    void *p = calloc(n, m);
    truth_sink = p;
    return p;
}

/* calloc(SIZE_MAX, 2): n*m overflows; calloc fails with NULL. */
static volatile size_t huge = SIZE_MAX;

NOINLINE void *api_calloc_overflow(void)
{
    void *p = calloc(huge, 2);
    truth_sink = p;
    return p;
}

NOINLINE void *api_realloc(void *p, size_t n)
{
    void *q = realloc(p, n);
    truth_sink = q;
    return q;
}

/* realloc(NULL, n) is malloc(n): one event, realloc. */
NOINLINE void *api_realloc_null(size_t n)
{
    void *q = realloc(null_block, n);
    truth_sink = q;
    return q;
}

/* realloc(p, 0) frees p (glibc returns NULL; musl returns a new block). */
NOINLINE void *api_realloc_zero(void *p)
{
    void *q = realloc(p, 0);
    truth_sink = q;
    return q;
}

NOINLINE void api_free_null(void)
{
    free(null_block);
    truth_sink = NULL;
}

NOINLINE void *api_posix_memalign(size_t align, size_t n)
{
    void *p = NULL;
    int err = posix_memalign(&p, align, n);
    truth_sink = p;
    return err == 0 ? p : NULL;
}

NOINLINE void *api_aligned_alloc(size_t align, size_t n)
{
    void *p = aligned_alloc(align, n);
    truth_sink = p;
    return p;
}

NOINLINE void *api_memalign(size_t align, size_t n)
{
    void *p = memalign(align, n);
    truth_sink = p;
    return p;
}

NOINLINE void *api_valloc(size_t n)
{
    void *p = valloc(n);
    truth_sink = p;
    return p;
}

#ifdef __GLIBC__
NOINLINE void *api_pvalloc(size_t n)
{
    void *p = pvalloc(n);
    truth_sink = p;
    return p;
}
#endif

NOINLINE void *api_reallocarray(void *p, size_t n, size_t m)
{
    void *q = reallocarray(p, n, m);
    truth_sink = q;
    return q;
}

int main(void)
{
    /* Print before tracing anything else: stdout's buffer is libc's own
     * allocation, from libc's own frames. */
    setvbuf(stdout, NULL, _IOLBF, 0);

    void *a = api_malloc(100);
    void *b = api_malloc(3000);
    void *big = api_malloc(1 << 20);
    truth("api_malloc", "malloc", 3, 100 + 3000 + (1 << 20));

    void *c = api_calloc(10, 24);
    truth("api_calloc", "calloc", 1, 240);
    if (api_calloc_overflow() != NULL)
        return 2;
    /* n*m does not fit in 64 bits: size is NULL (0 bytes in the sum). */
    truth("api_calloc_overflow", "calloc", 1, 0);

    a = api_realloc(a, 200);
    a = api_realloc(a, 100000); /* moves */
    truth("api_realloc", "realloc", 2, 200 + 100000);
    void *d = api_realloc_null(64);
    truth("api_realloc_null", "realloc", 1, 64);
    void *z = api_realloc_zero(d);
    truth("api_realloc_zero", "realloc", 1, 0);

    api_free_null();
    truth("api_free_null", "free", 1, 0);

    void *e = api_posix_memalign(64, 1000);
    truth("api_posix_memalign", "posix_memalign", 1, 1000);
    void *f = api_aligned_alloc(128, 256);
    truth("api_aligned_alloc", "aligned_alloc", 1, 256);
    void *g = api_memalign(32, 48);
    truth("api_memalign", "memalign", 1, 48);
    void *h = api_valloc(10);
    truth("api_valloc", "valloc", 1, 10);
#ifdef __GLIBC__
    void *i = api_pvalloc(5000);
    truth("api_pvalloc", "pvalloc", 1, 5000);
#else
    void *i = NULL;
#endif
    void *j = api_reallocarray(null_block, 4, 8);
    j = api_reallocarray(j, 8, 8);
    truth("api_reallocarray", "reallocarray", 2, 32 + 64);

    api_free(a);
    api_free(b);
    api_free(big);
    api_free(c);
    api_free(z); /* NULL under glibc, a block under musl */
    api_free(e);
    api_free(f);
    api_free(g);
    api_free(h);
    api_free(i); /* NULL under musl */
    api_free(j);
    truth("api_free", "free", 11, 0);
    return 0;
}
