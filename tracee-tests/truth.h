/* Shared by the tracees: how a tracee states its own ground truth.
 *
 * Every allocator call a tracee makes comes from a uniquely named noinline
 * function, and the tracee prints, on stdout, one line per (function, op):
 *
 *     truth <function> <op> <calls> <bytes>
 *
 * where <bytes> is the sum of the sizes requested (calloc and reallocarray:
 * n*m; free: 0). Leaked blocks are stated as
 *
 *     leak <function> <blocks> <bytes>
 *
 * The integration tests compare these lines with the database memptrace
 * wrote: events whose innermost frame is <function>. */
#ifndef TRUTH_H
#define TRUTH_H

#include <stdio.h>
#include <stdlib.h>

/* Blocks are published here so the compiler cannot drop an allocation as
 * unused, nor turn a call into a tail call. */
extern void *volatile truth_sink;

#define NOINLINE __attribute__((noinline))

static inline void truth(const char *function, const char *op, long calls, unsigned long bytes)
{
    printf("truth %s %s %ld %lu\n", function, op, calls, bytes);
}

static inline void truth_leak(const char *function, long blocks, unsigned long bytes)
{
    printf("leak %s %ld %lu\n", function, blocks, bytes);
}

/* The pid of the process tracing this one (TracerPid in its status file),
 * 0 for none, -1 when it cannot be read. */
static inline int tracer_pid(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    int pid = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "TracerPid: %d", &pid) == 1)
            break;
    if (f)
        fclose(f);
    return pid;
}

#endif
