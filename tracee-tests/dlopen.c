/* Loads libplugin.so (path in argv[1]) with dlopen and calls into it. The
 * program is linked against libneeded.so, whose constructor allocates before
 * main runs; so does the program's own constructor. */
#include <dlfcn.h>

#include "truth.h"

void *volatile truth_sink;
int needed_ready(void);

NOINLINE void *main_ctor_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

__attribute__((constructor)) static void main_init(void)
{
    main_ctor_alloc(21);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) {
        fprintf(stderr, "usage: dlopen PATH-TO-libplugin.so\n");
        return 2;
    }
    if (!needed_ready()) {
        fprintf(stderr, "dlopen: libneeded.so was not constructed\n");
        return 1;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 1;
    }
    void (*work)(int) = (void (*)(int))dlsym(lib, "plugin_work");
    if (!work)
        return 1;
    work(7);
    truth("main_ctor_alloc", "malloc", 1, 21);
    truth("needed_ctor_alloc", "malloc", 2, 33 + 44);
    truth("plugin_ctor_alloc", "malloc", 4, 200);
    truth("plugin_alloc", "calloc", 7, 4 * (1 + 2 + 3 + 4 + 5 + 6 + 7));
    truth_leak("plugin_ctor_alloc", 4, 200);
    truth_leak("needed_ctor_alloc", 2, 77);
    truth_leak("plugin_alloc", 0, 0);
    return 0;
}
