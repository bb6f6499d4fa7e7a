/* Built without unwind tables (-fno-asynchronous-unwind-tables
 * -fno-unwind-tables) and with frame pointers: no CFI covers these
 * functions, and the unwinders must fall back to the frame-pointer chain to
 * get from nocfi_inner to main. */
#include "truth.h"

void *volatile truth_sink;

NOINLINE void *nocfi_inner(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void *nocfi_middle(size_t n)
{
    void *p = nocfi_inner(n + 1);
    truth_sink = p;
    return p;
}

NOINLINE void *nocfi_outer(size_t n)
{
    void *p = nocfi_middle(n + 1);
    truth_sink = p;
    return p;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 0; i < 3; i++)
        free(nocfi_outer(10));
    truth("nocfi_inner", "malloc", 3, 36);
    printf("stack nocfi_inner nocfi_middle nocfi_outer main\n");
    return 0;
}
