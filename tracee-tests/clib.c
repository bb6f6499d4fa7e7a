/* The C library allocating for its caller: stdout's buffer at the first
 * output (glibc; musl's stdout has a static one), a strdup'd string and an
 * fopen'd FILE, all three kept (leaked). The C library's functions are part
 * of the allocator, in a static build as in a dynamic one: each block is
 * charged to the function that called the C library, as its lines
 *     site <function> <op> <calls> <bytes>
 * state (bytes "-" where the C library decides them; glibc: musl's code has
 * no unwind tables, so its stacks end in it). stdout is written
 * first by say_hello, and only then by truth lines. */
#include <string.h>

#include "truth.h"

void *volatile truth_sink;

NOINLINE void say_hello(void)
{
    fputs("hello from say_hello\n", stdout);
}

NOINLINE void copy_name(void)
{
    truth_sink = strdup("copy_name");
}

NOINLINE void open_self(void)
{
    truth_sink = fopen("/proc/self/stat", "r");
}

int main(void)
{
    say_hello();
    copy_name();
    open_self();
#ifdef __GLIBC__
    printf("site say_hello malloc 1 -\n");
#endif
    printf("site copy_name malloc 1 10\n");
    printf("site open_self malloc 1 -\n");
    return 0;
}
