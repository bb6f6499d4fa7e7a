/* A library the dlopen tracee is linked against (DT_NEEDED): its constructor
 * runs before main, right after the dynamic linker mapped it and libc. */
#include "truth.h"

__attribute__((visibility("hidden"))) void *volatile truth_sink;

NOINLINE void *needed_ctor_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

static int constructed;

__attribute__((constructor)) static void needed_init(void)
{
    needed_ctor_alloc(33);
    needed_ctor_alloc(44);
    constructed = 1;
}

/* The program calls this, so the linker keeps the library (--as-needed). */
int needed_ready(void)
{
    return constructed;
}
