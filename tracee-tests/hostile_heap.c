/* A program whose memory misleads a heap walker, then allocates and exits 0.
 *
 * Before it states `ready <pid>` it lays out, in its own memory only:
 *   - an anonymous mapping of 3 pages whose first page begins with the words
 *     0, 0xfffffffffffff002 (prev_size 0, a size of 2^64 - 4096 with
 *     IS_MMAPPED: the size wraps the address space), and whose last page
 *     begins with the same words (there `p + size` wraps to below the end);
 *   - an anonymous mapping of 2 pages that looks like one block glibc
 *     mapped (prev_size 0, size 8192 | IS_MMAPPED), with an aligned
 *     block's header at 0xff0 whose lead is 2^64 - 16: glibc counts no
 *     such block;
 *   - (glibc) a thread arena whose `next` points at a fake arena (zeros, in
 *     an anonymous page) whose `next` points back at it: the list of arenas
 *     no longer returns to main_arena. glibc follows `next` only at fork,
 *     in malloc_trim/mallinfo/malloc_stats and when threads outnumber the
 *     arenas: this program does none of these. It prints `corrupted arena`.
 *
 * Then, with `wait`, it waits for a line on stdin (memptrace attaches
 * meanwhile); then it makes its own calls, prints their truth and exits 0.
 *
 * usage: hostile_heap [wait] */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "truth.h"

void *volatile truth_sink;

#define BLOCKS 100
#define PAGE 4096UL

static char out[1 << 16];
static char in[256];

static void *anon(size_t len)
{
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(2);
    }
    return p;
}

static void fake_mmapped(void)
{
    uint64_t *wrap = anon(3 * PAGE);
    wrap[0] = 0;
    wrap[1] = 0xfffffffffffff002UL;
    wrap[2 * PAGE / 8] = 0;
    wrap[2 * PAGE / 8 + 1] = 0xfffffffffffff002UL;
    uint64_t *fits = anon(2 * PAGE);
    fits[0] = 0;
    fits[1] = 2 * PAGE | 2;
    fits[0xff0 / 8] = 0xfffffffffffffff0UL;
    fits[0xff8 / 8] = 0x10 | 2;
}

#ifdef __GLIBC__
/* glibc 2.27+ on x86-64: offsets in struct malloc_state. */
#define ARENA_NEXT 0x870
#define ARENA_SYSTEM_MEM 0x888
#define HEAP_MAX (64UL << 20)

static int corrupted;

static void *corrupt_arena(void *arg)
{
    (void)arg;
    /* The first block of a new thread: in its own arena, whose first heap
     * begins with heap_info (ar_ptr, prev, size, ...). */
    char *p = malloc(64);
    uintptr_t heap = (uintptr_t)p & ~(HEAP_MAX - 1);
    uintptr_t arena = *(uintptr_t *)heap;
    /* Only if it reads as glibc's layout: the arena right after heap_info,
     * its system_mem the heap's size. */
    if (arena > heap && arena < heap + 64 &&
        *(uint64_t *)(arena + ARENA_SYSTEM_MEM) == *(uint64_t *)(heap + 16)) {
        uintptr_t *fake = anon(PAGE);
        fake[ARENA_NEXT / 8] = arena;
        *(uintptr_t *)(arena + ARENA_NEXT) = (uintptr_t)fake;
        corrupted = 1;
    }
    free(p);
    return NULL;
}
#endif

NOINLINE static void hostile_alloc(void **blocks)
{
    for (int i = 0; i < BLOCKS; i++) {
        blocks[i] = malloc(24 + 8 * i);
        memset(blocks[i], i, 24 + 8 * i);
        truth_sink = blocks[i];
    }
}

NOINLINE static void hostile_free(void **blocks)
{
    for (int i = 0; i < BLOCKS; i++)
        free(blocks[i]);
    truth_sink = NULL;
}

int main(int argc, char **argv)
{
    int wait = argc > 1 && strcmp(argv[1], "wait") == 0;
    setvbuf(stdout, out, _IOFBF, sizeof out);
    setvbuf(stdin, in, _IOFBF, sizeof in);
    fake_mmapped();
#ifdef __GLIBC__
    pthread_t t;
    pthread_create(&t, NULL, corrupt_arena, NULL);
    pthread_join(t, NULL);
    if (corrupted)
        printf("corrupted arena\n");
#endif
    if (wait) {
        printf("ready %d\n", (int)getpid());
        fflush(stdout);
        char line[16];
        if (!fgets(line, sizeof line, stdin))
            return 3;
    }
    void *blocks[BLOCKS];
    hostile_alloc(blocks);
    hostile_free(blocks);
    unsigned long bytes = 0;
    for (int i = 0; i < BLOCKS; i++)
        bytes += 24 + 8 * i;
    truth("hostile_alloc", "malloc", BLOCKS, bytes);
    truth("hostile_free", "free", BLOCKS, 0);
    return 0;
}
