/* Ends as asked: `status exit N` exits with N, `status signal N` kills itself
 * with signal N, `status abort` calls abort(), `status segv` writes through
 * a null pointer. It allocates first, so the trace is not empty. */
#include <signal.h>
#include <string.h>

#include "truth.h"

void *volatile truth_sink;
static void *volatile truth_sink_null;

NOINLINE void *status_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 0; i < 3; i++)
        status_alloc(8);
    truth("status_alloc", "malloc", 3, 24);
    if (argc >= 3 && strcmp(argv[1], "exit") == 0)
        exit(atoi(argv[2]));
    if (argc >= 3 && strcmp(argv[1], "signal") == 0) {
        signal(atoi(argv[2]), SIG_DFL);
        raise(atoi(argv[2]));
    }
    if (argc >= 2 && strcmp(argv[1], "abort") == 0)
        abort();
    if (argc >= 2 && strcmp(argv[1], "segv") == 0)
        *(volatile int *)truth_sink_null = 1;
    return 0;
}
