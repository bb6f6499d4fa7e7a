/* A known call chain: main -> deep_outer -> deep_middle -> deep_inner ->
 * malloc, and the same for free. The tests check the order of the function
 * names along the recorded stacks. */
#include "truth.h"

void *volatile truth_sink;

NOINLINE void *deep_inner(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void *deep_middle(size_t n)
{
    void *p = deep_inner(n + 1);
    truth_sink = p;
    return p;
}

NOINLINE void *deep_outer(size_t n)
{
    void *p = deep_middle(n + 1);
    truth_sink = p;
    return p;
}

NOINLINE void deep_release(void *p)
{
    free(p);
    truth_sink = NULL;
}

/* Inlined into its caller: the frame is deep_inlined_caller's code. */
static inline __attribute__((always_inline)) void *deep_wrap(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void *deep_inlined_caller(size_t n)
{
    void *p = deep_wrap(n * 2);
    truth_sink = p;
    return p;
}

/* Recursion: 20 frames of deep_recurse above the malloc. */
NOINLINE void *deep_recurse(int levels)
{
    void *p = levels == 0 ? malloc(77) : deep_recurse(levels - 1);
    truth_sink = p;
    return p;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 0; i < 5; i++)
        deep_release(deep_outer(10));
    deep_release(deep_recurse(19));
    deep_release(deep_inlined_caller(4));
    truth("deep_inner", "malloc", 5, 5 * 12);
    truth("deep_release", "free", 7, 0);
    truth("deep_recurse", "malloc", 1, 77);
    truth("deep_inlined_caller", "malloc", 1, 8);
    printf("stack deep_inner deep_middle deep_outer main\n");
    return 0;
}
