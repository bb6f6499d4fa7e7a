/* Allocations through wrappers of the program's own, as C programs have
 * them: xmalloc and xcalloc (abort instead of returning NULL), and a pool
 * allocator on top of xmalloc (a wrapper of a wrapper). Traced with
 *     --wrapper '^xmalloc$' --wrapper '^xcalloc$' --wrapper '^pool_alloc$'
 * each call is charged to the function that called the wrappers, as it
 * states in lines
 *     site <function> <op> <calls> <bytes>
 * beside its usual truth (the innermost frame: the wrappers themselves). */
#include "truth.h"

void *volatile truth_sink;

NOINLINE void *xmalloc(size_t n)
{
    void *p = malloc(n);
    if (!p)
        abort();
    return p;
}

NOINLINE void *xcalloc(size_t n, size_t m)
{
    void *p = calloc(n, m);
    if (!p)
        abort();
    return p;
}

NOINLINE void *pool_alloc(size_t n)
{
    void *p = xmalloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void make_names(void)
{
    for (int i = 0; i < 10; i++) {
        truth_sink = xmalloc(32);
        free(truth_sink);
    }
}

NOINLINE void make_table(void)
{
    for (int i = 0; i < 5; i++)
        truth_sink = pool_alloc(100); /* leaked */
}

NOINLINE void make_zeroes(void)
{
    for (int i = 0; i < 3; i++) {
        truth_sink = xcalloc(4, 16);
        free(truth_sink);
    }
}

static void site(const char *function, const char *op, long calls, unsigned long bytes)
{
    printf("site %s %s %ld %lu\n", function, op, calls, bytes);
}

int main(void)
{
    make_names();
    make_table();
    make_zeroes();
    truth("xmalloc", "malloc", 15, 820);
    truth("xcalloc", "calloc", 3, 192);
    site("make_names", "malloc", 10, 320);
    site("make_table", "malloc", 5, 500);
    site("make_zeroes", "calloc", 3, 192);
    return 0;
}
