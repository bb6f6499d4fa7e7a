/* A library loaded with dlopen by dlopen.c: it allocates in its constructor
 * (which runs inside dlopen) and in plugin_work. */
#include "truth.h"

__attribute__((visibility("hidden"))) void *volatile truth_sink;
static void *kept[8];

NOINLINE void *plugin_ctor_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

__attribute__((constructor)) static void plugin_init(void)
{
    for (int i = 0; i < 4; i++)
        kept[i] = plugin_ctor_alloc(50);
}

NOINLINE void *plugin_alloc(size_t n)
{
    void *p = calloc(n, 4);
    truth_sink = p;
    return p;
}

void plugin_work(int n)
{
    for (int i = 0; i < n; i++)
        free(plugin_alloc(i + 1));
}
