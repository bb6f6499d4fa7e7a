/* A heap with a known shape, for `memptrace heapmap` and the inventory at
 * attach: blocks live in the main arena and in two thread arenas, freed
 * blocks in the tcaches, the fastbins and the bins, a block large enough to
 * be mmapped and aligned blocks (posix_memalign, one of them mmapped).
 *
 * Once the heap is built (both threads wait, holding their arenas), it
 * prints every block it holds and glibc's own totals:
 *
 *     first <address>
 *     block <address> <malloc_usable_size>
 *     libc <address> <malloc_usable_size>
 *     mallinfo <arena> <ordblks> <smblks> <hblks> <hblkhd> <usmblks> <fsmblks> <uordblks> <fordblks> <keepcost>
 *     ready <pid>
 *
 * `first` is the first block main allocates: the blocks below it in the
 * main arena were allocated before main (a static glibc allocates some).
 * `libc` blocks are glibc's own: each thread's dynamic thread vector,
 * calloc'd by pthread_create (the thread pointer's second word points 16
 * bytes into it).
 *
 * (glibc only: musl has neither mallinfo2 nor these vectors.)
 *
 * `heapmap exit` then returns from main (the heap as printed is the heap at
 * exit); `heapmap wait` waits for a line on stdin, frees every block it
 * printed, says `freed <blocks> <bytes>` and exits.
 *
 * stdin and stdout have static buffers: reading and printing allocate
 * nothing. */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "truth.h"

void *volatile truth_sink;

#define MAX_BLOCKS 256

static void *blocks[MAX_BLOCKS];
static int nblocks;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_barrier_t built;
static pthread_barrier_t done;
static char out[1 << 16];
static char in[256];

static void keep(void *p)
{
    pthread_mutex_lock(&lock);
    blocks[nblocks++] = p;
    pthread_mutex_unlock(&lock);
    truth_sink = p;
}

/* A pattern of live and freed blocks in the calling thread's arena. */
static NOINLINE void heapmap_build(int seed)
{
    void *small[12], *medium[6], *large[4];
    for (int i = 0; i < 12; i++)
        small[i] = malloc(24 + seed);
    for (int i = 0; i < 6; i++)
        medium[i] = malloc(200 + 16 * i + seed);
    for (int i = 0; i < 4; i++)
        large[i] = malloc(2000 + 500 * i + seed);
    /* 7 into the tcache, 3 into a fastbin, 2 kept. */
    for (int i = 0; i < 10; i++)
        free(small[i]);
    keep(small[10]);
    keep(small[11]);
    /* Tcache. */
    free(medium[0]);
    free(medium[2]);
    for (int i = 3; i < 6; i++)
        keep(medium[i]);
    keep(medium[1]);
    /* Too large for the tcache, not next to each other: the bins. */
    free(large[0]);
    free(large[2]);
    keep(large[1]);
    keep(large[3]);
    /* A calloc and an aligned block. */
    keep(calloc(10, 33 + seed));
    void *aligned;
    if (posix_memalign(&aligned, 64, 100 + seed) == 0)
        keep(aligned);
}

static void *dtv_blocks[2];

static void *worker(void *arg)
{
    int i = (int)(intptr_t)arg / 8 - 1;
    void **tcb = __builtin_thread_pointer();
    dtv_blocks[i] = (char *)tcb[1] - 16;
    heapmap_build((int)(intptr_t)arg);
    pthread_barrier_wait(&built);
    pthread_barrier_wait(&done);
    return NULL;
}

/* Blocks glibc maps on their own: above the mmap threshold (128 KiB). */
static NOINLINE void heapmap_mmapped(void)
{
    keep(malloc(300 * 1024));
    void *aligned;
    if (posix_memalign(&aligned, 4096, 200 * 1024) == 0)
        keep(aligned);
}

int main(int argc, char **argv)
{
    int wait = argc > 1 && strcmp(argv[1], "wait") == 0;
    setvbuf(stdout, out, _IOFBF, sizeof out);
    setvbuf(stdin, in, _IOFBF, sizeof in);
    void *first = malloc(1);
    keep(first);
    pthread_barrier_init(&built, NULL, 3);
    pthread_barrier_init(&done, NULL, 3);
    pthread_t threads[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&threads[i], NULL, worker, (void *)(intptr_t)(8 * (i + 1)));
    heapmap_build(0);
    heapmap_mmapped();
    pthread_barrier_wait(&built);

    printf("first %#lx\n", (unsigned long)first);
    for (int i = 0; i < nblocks; i++)
        printf("block %#lx %zu\n", (unsigned long)blocks[i], malloc_usable_size(blocks[i]));
#ifdef __GLIBC__
    for (int i = 0; i < 2; i++)
        printf("libc %#lx %zu\n", (unsigned long)dtv_blocks[i], malloc_usable_size(dtv_blocks[i]));
#endif
#ifdef __GLIBC__
    struct mallinfo2 m = mallinfo2();
    printf("mallinfo %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\n", m.arena, m.ordblks, m.smblks,
           m.hblks, m.hblkhd, m.usmblks, m.fsmblks, m.uordblks, m.fordblks, m.keepcost);
#endif
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    if (!wait)
        return 0;

    char line[16];
    if (!fgets(line, sizeof line, stdin))
        return 1;
    size_t bytes = 0;
    for (int i = 0; i < nblocks; i++) {
        bytes += malloc_usable_size(blocks[i]);
        free(blocks[i]);
    }
    printf("freed %d %zu\n", nblocks, bytes);
    fflush(stdout);
    pthread_barrier_wait(&done);
    for (int i = 0; i < 2; i++)
        pthread_join(threads[i], NULL);
    return 0;
}
