/* A large heap: blocks of mixed sizes, allocated until MIB MiB are asked
 * (default 1536), three quarters by the main thread in the main arena,
 * a quarter by a worker thread in its own arena (several 64 MiB heaps),
 * which then waits, holding its arena and tcache, until the process ends:
 * mostly small blocks (16 B to 1 KiB), some of 1-64 KiB, a few of
 * 64 KiB to 6 MiB (in the heap: larger than the 4 MiB window memptrace
 * reads a heap through) and a few of 9 to 24 MiB (mapped on their own:
 * glibc's mmap threshold is set to 8 MiB). Then every seventh block is
 * freed (into the tcaches, the fastbins and the bins, or unmapped). With
 * `touch`, every byte of every block is written (the heap is resident);
 * without, only glibc's headers are.
 *
 * Once built it prints every block it holds and glibc's own totals:
 *
 *     first <address>
 *     block <address> <malloc_usable_size>
 *     libc <address> <malloc_usable_size>     (the worker's thread vector)
 *     mallinfo <arena> <ordblks> <smblks> <hblks> <hblkhd> <usmblks> <fsmblks> <uordblks> <fordblks> <keepcost>
 *     held <blocks> <bytes>
 *     ready <pid>
 *
 * then exits (`exit`, the default) or waits (`wait`) for a line on stdin,
 * its end, or SIGTERM, and exits 0 without a call to the allocator.
 *
 * usage: bigheap [MIB] [touch] [exit|wait] */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "truth.h"

void *volatile truth_sink;

struct held {
    void **blocks;
    long n, cap;
    size_t target;
    unsigned seed;
    int touch;
};

static char out[1 << 16];
static char in[256];

static unsigned next_random(unsigned *seed)
{
    *seed = *seed * 1103515245u + 12345u;
    return *seed >> 8;
}

/* A size: of 5000, 4800 small, 175 of 1-64 KiB, 24 of 64 KiB-6 MiB, 1 of
 * 9-24 MiB (by bytes: about 3, 6, 74 and 17 %). */
static size_t pick_size(unsigned *seed)
{
    unsigned kind = next_random(seed) % 5000;
    unsigned r = next_random(seed);
    if (kind < 4800)
        return 16 + r % 1009;
    if (kind < 4975)
        return 1024 + r % (63 << 10);
    if (kind < 4999)
        return (64 << 10) + r % (6 << 20);
    return (9 << 20) + r % (15 << 20);
}

/* Allocate until `h->target` bytes are held, then free every seventh. */
static NOINLINE void bigheap_build(struct held *h)
{
    size_t total = 0;
    while (total < h->target) {
        size_t size = pick_size(&h->seed);
        void *p = malloc(size);
        if (!p) {
            perror("malloc");
            exit(2);
        }
        truth_sink = p;
        if (h->touch)
            memset(p, 0x5a, size);
        if (h->n == h->cap) {
            h->cap = h->cap ? 2 * h->cap : 4096;
            void **grown = realloc(h->blocks, (size_t)h->cap * sizeof *grown);
            if (!grown) {
                perror("realloc");
                exit(2);
            }
            h->blocks = grown;
        }
        h->blocks[h->n++] = p;
        total += size;
    }
    /* Every seventh block freed, between blocks held: it stays free. */
    long kept = 0;
    for (long i = 0; i < h->n; i++) {
        if (i % 7 == 3)
            free(h->blocks[i]);
        else
            h->blocks[kept++] = h->blocks[i];
    }
    h->n = kept;
}

static void *dtv_block;
static pthread_barrier_t built;

/* Builds its share in its own arena, then waits for the process to end
 * (its tcache and its thread vector stay). */
static void *worker(void *arg)
{
    void **tcb = __builtin_thread_pointer();
    dtv_block = (char *)tcb[1] - 16;
    bigheap_build(arg);
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &term, NULL);
    pthread_barrier_wait(&built);
    for (;;)
        pause();
    return NULL;
}

static volatile sig_atomic_t stop;

static void on_term(int sig)
{
    (void)sig;
    stop = 1;
}

static void print_blocks(const struct held *h, long *count, size_t *bytes)
{
    for (long i = 0; i < h->n; i++) {
        size_t usable = malloc_usable_size(h->blocks[i]);
        printf("block %#lx %zu\n", (unsigned long)h->blocks[i], usable);
        ++*count;
        *bytes += usable;
    }
}

int main(int argc, char **argv)
{
    long mib = 1536;
    int touch = 0, wait = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "touch") == 0)
            touch = 1;
        else if (strcmp(argv[i], "wait") == 0)
            wait = 1;
        else if (strcmp(argv[i], "exit") != 0)
            mib = atol(argv[i]);
    }
    setvbuf(stdout, out, _IOFBF, sizeof out);
    setvbuf(stdin, in, _IOFBF, sizeof in);
#ifdef __GLIBC__
    mallopt(M_MMAP_THRESHOLD, 8 << 20);
#endif
    size_t bytes = (size_t)mib << 20;
    struct held mine = {.target = bytes - bytes / 4, .seed = 1, .touch = touch};
    struct held theirs = {.target = bytes / 4, .seed = 2, .touch = touch};
    pthread_barrier_init(&built, NULL, 2);
    pthread_t thread;
    pthread_create(&thread, NULL, worker, &theirs);
    bigheap_build(&mine);
    pthread_barrier_wait(&built);

    long count = 0;
    size_t held = 0;
    printf("first %#lx\n", (unsigned long)mine.blocks[0]);
    print_blocks(&mine, &count, &held);
    print_blocks(&theirs, &count, &held);
    /* The lists of blocks themselves are blocks. */
    void *lists[] = {mine.blocks, theirs.blocks};
    for (int i = 0; i < 2; i++) {
        size_t usable = malloc_usable_size(lists[i]);
        printf("block %#lx %zu\n", (unsigned long)lists[i], usable);
        count++;
        held += usable;
    }
#ifdef __GLIBC__
    printf("libc %#lx %zu\n", (unsigned long)dtv_block, malloc_usable_size(dtv_block));
    struct mallinfo2 m = mallinfo2();
    printf("mallinfo %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\n", m.arena, m.ordblks, m.smblks,
           m.hblks, m.hblkhd, m.usmblks, m.fsmblks, m.uordblks, m.fordblks, m.keepcost);
#endif
    /* SIGTERM ends the wait (the worker blocks it): no SA_RESTART, so it
     * interrupts the read. */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    printf("held %ld %zu\n", count, held);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    if (!wait)
        return 0;
    char line[16];
    while (!fgets(line, sizeof line, stdin) && !feof(stdin) && !stop)
        clearerr(stdin);
    return 0;
}
