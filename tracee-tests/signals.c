/* Signals memptrace must deliver untouched: SIGUSR1 and a real-time signal
 * (SIGRTMIN+3) with handlers, and the program's own SIGTRAP (raised and from
 * an int3 instruction), which memptrace must not mistake for its own. Exits 0
 * only if every handler ran exactly as often as the signal was sent. */
#include <signal.h>

#include "truth.h"

void *volatile truth_sink;
static volatile sig_atomic_t usr1, rt, trap;

static void on_usr1(int sig) { (void)sig; usr1++; }
static void on_rt(int sig) { (void)sig; rt++; }
static void on_trap(int sig) { (void)sig; trap++; }

NOINLINE void *signal_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGUSR1, on_usr1);
    signal(SIGRTMIN + 3, on_rt);
    signal(SIGTRAP, on_trap);
    for (int i = 0; i < 10; i++) {
        free(signal_alloc(16));
        raise(SIGUSR1);
        raise(SIGRTMIN + 3);
    }
    raise(SIGTRAP);
    __asm__ volatile("int3");
    truth("signal_alloc", "malloc", 10, 160);
    if (usr1 != 10 || rt != 10 || trap != 2) {
        fprintf(stderr, "signals: usr1=%d rt=%d trap=%d, wanted 10 10 2\n", usr1, rt, trap);
        return 1;
    }
    return 0;
}
