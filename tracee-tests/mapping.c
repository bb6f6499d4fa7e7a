/* Mapping calls with a known pattern, from uniquely named functions: the
 * program's own mmap, munmap, mremap, madvise (DONTNEED and FREE), mprotect
 * and sbrk; and the allocator's, made inside malloc and free of blocks big
 * enough to be mapped on their own (1 MiB and more, above any allocator's
 * threshold). It prints one line per (function, op) of its own calls:
 *
 *     map <function> <op> <calls>
 *
 * and `big <blocks>` for the blocks whose mapping the allocator made. With
 * the argument `wait` it first prints "ready PID" and waits for a line on
 * stdin, so that memptrace can attach before any of it.
 *
 * usage: mapping [wait] */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "truth.h"

void *volatile truth_sink;

#define ROUNDS 20
#define BIG 8

NOINLINE void *map_region(size_t len)
{
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    truth_sink = p;
    return p;
}

NOINLINE void *map_grow(void *p, size_t len, size_t new_len)
{
    void *q = mremap(p, len, new_len, MREMAP_MAYMOVE);
    truth_sink = q;
    return q;
}

NOINLINE void map_advise(void *p, size_t len, int advice)
{
    madvise(p, len, advice);
    truth_sink = p;
}

NOINLINE void map_protect(void *p, size_t len)
{
    mprotect(p, len, PROT_READ);
    truth_sink = p;
}

NOINLINE void map_release(void *p, size_t len)
{
    munmap(p, len);
    truth_sink = NULL;
}

NOINLINE void map_break(intptr_t delta)
{
    truth_sink = sbrk(delta);
}

/* Called through a pointer, as programs with pluggable allocators do
 * (Python's PyMem_RawMalloc): no call instruction names malloc. */
void *(*volatile allocate)(size_t) = malloc;

NOINLINE void *big_alloc(size_t n)
{
    void *p = allocate(n);
    truth_sink = p;
    return p;
}

NOINLINE void big_release(void *p)
{
    free(p);
    truth_sink = NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "wait") == 0) {
        char line[16];
        printf("ready %d\n", (int)getpid());
        fflush(stdout);
        if (!fgets(line, sizeof line, stdin))
            return 2;
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (int i = 0; i < ROUNDS; i++) {
        char *p = map_region(4 * page);
        p[0] = 1;
        map_advise(p, page, MADV_DONTNEED);
        map_advise(p + page, page, MADV_FREE);
        char *q = map_grow(p, 4 * page, 64 * page);
        map_protect(q, page);
        map_release(q, 64 * page);
    }
    map_break(4096);
    map_break(-4096);
    void *big[BIG];
    for (int i = 0; i < BIG; i++)
        big[i] = big_alloc((size_t)(1 + i) << 20);
    for (int i = 0; i < BIG; i++)
        big_release(big[i]);
    printf("map map_region mmap %d\n", ROUNDS);
    printf("map map_advise madvise %d\n", 2 * ROUNDS);
    printf("map map_grow mremap %d\n", ROUNDS);
    printf("map map_protect mprotect %d\n", ROUNDS);
    printf("map map_release munmap %d\n", ROUNDS);
    printf("map map_break sbrk 2\n");
    printf("big %d\n", BIG);
    truth("big_alloc", "malloc", BIG, (unsigned long)BIG * (BIG + 1) / 2 << 20);
    truth("big_release", "free", BIG, 0);
    return 0;
}
