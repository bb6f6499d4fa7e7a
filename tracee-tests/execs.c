/* Blocks live at an exec: before_exec allocates 5 blocks of 1000 bytes and
 * keeps them, then the program execs itself (`execs after`); the new image
 * allocates 3 blocks of 200 bytes in after_exec, frees one and leaks two.
 * The exec released the first image's blocks: they are not leaks. */
#include <string.h>
#include <unistd.h>

#include "truth.h"

void *volatile truth_sink;
static void *keep[8];

NOINLINE void *before_exec(void)
{
    void *p = malloc(1000);
    truth_sink = p;
    return p;
}

NOINLINE void *after_exec(void)
{
    void *p = malloc(200);
    truth_sink = p;
    return p;
}

NOINLINE void after_free(void *p)
{
    free(p);
    truth_sink = NULL;
}

int main(int argc, char **argv)
{
    /* Unbuffered: stdio allocates no buffer, in either image. */
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc > 1 && strcmp(argv[1], "after") == 0) {
        for (int i = 0; i < 3; i++)
            keep[i] = after_exec();
        after_free(keep[2]);
        truth("before_exec", "malloc", 5, 5000);
        truth("after_exec", "malloc", 3, 600);
        truth("after_free", "free", 1, 0);
        truth_leak("after_exec", 2, 400);
        return 0;
    }
    for (int i = 0; i < 5; i++)
        keep[i] = before_exec();
    execl("/proc/self/exe", argv[0], "after", (char *)NULL);
    return 1;
}
