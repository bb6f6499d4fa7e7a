/* A heap that changes throughout an attach: WORKERS threads each hold
 * SLOTS blocks and replace them without pause (free then malloc, realloc,
 * free then calloc), while the main thread watches TracerPid in
 * /proc/self/status. Once memptrace has attached, the workers go on for
 * 300 ms and 3000 replacements each more, then stop for good; the main thread prints, for every slot,
 *
 *     block <thread> <slot> <address> <size asked>
 *
 * then `done`, and waits for SIGTERM or SIGINT (exit 0). After `ready PID`
 * nothing here allocates but the workers' calls (write(2) and snprintf into
 * static buffers, open/read on /proc): the blocks live when memptrace
 * detaches are the slots and what was live before `ready`.
 *
 * usage: busyheap [SLOTS] */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "truth.h"

#define WORKERS 2

void *volatile truth_sink;

static long slots = 20000;
static void **blocks[WORKERS];
static size_t *asked[WORKERS];
static volatile int traced, finished[WORKERS];
static volatile sig_atomic_t stop;

static void on_term(int sig)
{
    (void)sig;
    stop = 1;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void say(const char *text)
{
    size_t n = strlen(text);
    while (n > 0) {
        ssize_t w = write(1, text, n);
        if (w <= 0)
            return;
        text += w;
        n -= (size_t)w;
    }
}

/* One replacement of slot i of worker w, the kind by k. */
NOINLINE static void busy_replace(int w, long i, unsigned long k)
{
    size_t size = 16 + (size_t)(k * 131 % 1000);
    switch (k % 3) {
    case 0:
        free(blocks[w][i]);
        blocks[w][i] = malloc(size);
        break;
    case 1: {
        void *p = realloc(blocks[w][i], size);
        if (p)
            blocks[w][i] = p;
        else
            size = asked[w][i];
        break;
    }
    default:
        free(blocks[w][i]);
        blocks[w][i] = calloc(1, size);
        break;
    }
    asked[w][i] = size;
    truth_sink = blocks[w][i];
}

static void *worker(void *arg)
{
    int w = (int)(intptr_t)arg;
    uint64_t end = 0;
    unsigned long k = (unsigned long)w * 7, last = 0;
    for (;;) {
        if (traced && end == 0) {
            end = now_ns() + 300000000u;
            last = k + 3000;
        }
        if (end != 0 && now_ns() >= end && k >= last)
            break;
        long i = (long)(k * 7919 % (unsigned long)slots);
        busy_replace(w, i, k);
        k++;
        /* Time outside the allocator: an attach seldom finds a call in
         * flight. */
        for (volatile int spin = 0; spin < 20000; spin++)
            ;
    }
    finished[w] = 1;
    for (;;)
        pause();
    return NULL;
}

static int is_traced(void)
{
    static char buf[4096];
    int fd = open("/proc/self/status", O_RDONLY);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *t = strstr(buf, "TracerPid:");
    return t && strtol(t + 10, NULL, 10) != 0;
}

int main(int argc, char **argv)
{
    static char line[128];
    if (argc > 1)
        slots = atol(argv[1]);
    if (slots < 1)
        slots = 1;
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);
    for (int w = 0; w < WORKERS; w++) {
        blocks[w] = malloc(sizeof(void *) * (size_t)slots);
        asked[w] = malloc(sizeof(size_t) * (size_t)slots);
        for (long i = 0; i < slots; i++) {
            asked[w][i] = 16 + (size_t)(i * 37 % 700);
            blocks[w][i] = malloc(asked[w][i]);
        }
    }
    pthread_t threads[WORKERS];
    for (int w = 0; w < WORKERS; w++)
        pthread_create(&threads[w], NULL, worker, (void *)(intptr_t)w);
    snprintf(line, sizeof line, "ready %d\n", (int)getpid());
    say(line);
    struct timespec ms = {0, 1000000};
    while (!is_traced())
        nanosleep(&ms, NULL);
    traced = 1;
    for (int w = 0; w < WORKERS; w++)
        while (!finished[w])
            nanosleep(&ms, NULL);
    for (int w = 0; w < WORKERS; w++)
        for (long i = 0; i < slots; i++) {
            snprintf(line, sizeof line, "block %d %ld %#lx %zu\n", w, i,
                     (unsigned long)(uintptr_t)blocks[w][i], asked[w][i]);
            say(line);
        }
    say("done\n");
    while (!stop)
        nanosleep(&ms, NULL);
    return 0;
}
