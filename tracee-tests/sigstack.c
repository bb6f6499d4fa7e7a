/* A signal handler's allocations, whose stacks go on through the signal
 * frame: handler_malloc <- on_signal <- the signal-return trampoline
 * (__restore_rt) <- signal_here <- main.
 *
 * signal_here sends its own thread SIGUSR1 with a raw tgkill system call,
 * so the signal is delivered as that call returns, inside signal_here,
 * whose CFI is exact at every instruction. The handler allocates from
 * handler_malloc. The blocks are freed by main (release_blocks).
 *
 * usage: sigstack [TIMES]     (default 10) */
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "truth.h"

void *volatile truth_sink;
static void *blocks[1000];
static volatile int taken;

NOINLINE void *handler_malloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void on_signal(int sig)
{
    (void)sig;
    blocks[taken] = handler_malloc(48);
    taken++;
}

NOINLINE void signal_here(long pid, long tid)
{
    long ret = SYS_tgkill;
    __asm__ volatile("syscall"
                     : "+a"(ret)
                     : "D"(pid), "S"(tid), "d"((long)SIGUSR1)
                     : "rcx", "r11", "memory");
}

NOINLINE void release_blocks(int n)
{
    for (int i = 0; i < n; i++)
        free(blocks[i]);
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 10;
    if (n < 0 || n > 1000)
        return 2;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGUSR1, &sa, NULL);
    long pid = getpid();
    long tid = syscall(SYS_gettid);
    for (int i = 0; i < n; i++)
        signal_here(pid, tid);
    if (taken != n) {
        fprintf(stderr, "sigstack: %d signals handled, wanted %d\n", taken, n);
        return 1;
    }
    release_blocks(n);
    truth("handler_malloc", "malloc", n, 48ul * n);
    truth("release_blocks", "free", n, 0);
    return 0;
}
