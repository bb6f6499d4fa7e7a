/* A process that makes threads and processes without pause, for memptrace to
 * attach to and detach from while it does, and that checks itself: every
 * thread's start routine must run exactly once, every system call that makes
 * a thread or a process must return what the kernel did (a child's id, never
 * a failure after a child was made), every block it allocates must keep its
 * pattern, and every child must exit with the status it was given.
 *
 * Each round makes 4 threads in the chosen way; each thread (or child)
 * mallocs 32 blocks, fills them, checks them and frees them (raw threads,
 * which share their maker's thread pointer, fill and check their stack
 * instead); the main thread does the same between rounds.
 *
 *   pthread  pthread_create + pthread_join (glibc tries clone3, then clone)
 *   clone3   raw clone3(CLONE_VM|CLONE_THREAD|...) threads on stacks of its own
 *   clone    raw clone(CLONE_VM|CLONE_THREAD|...), the same
 *   fork     fork + waitpid
 *   vfork    vfork + exec of itself as `spawner child` + waitpid
 *
 * It prints "ready PID" once running, runs until SIGTERM or SIGINT (or 300 s),
 * then prints "rounds N", "<N> damaged" and exits 0 only if nothing was
 * damaged (1 otherwise); every damage is also described on stderr.
 *
 * usage: spawner pthread|clone3|clone|fork|vfork | spawner child */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "truth.h"

/* Spelled out here: musl's compiler has no kernel headers. */
#define FUTEX_WAIT_ 0
struct clone_args_ {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls;
};
#ifndef SYS_clone3
#define SYS_clone3 435
#endif

#define THREADS 4
#define BLOCKS 32
#define STACK (256 * 1024)

void *volatile truth_sink;
static volatile sig_atomic_t stop;
static atomic_long damage;
static char self_path[4096];

static void on_stop(int sig)
{
    (void)sig;
    stop = 1;
}

static void damaged(const char *what, long a, long b)
{
    atomic_fetch_add(&damage, 1);
    fprintf(stderr, "DAMAGE %s (%ld, %ld)\n", what, a, b);
}

NOINLINE void *spawner_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void spawner_release(void *p)
{
    free(p);
    truth_sink = NULL;
}

/* Allocate, fill, check and free 32 blocks; the number of bad blocks. */
static int work(unsigned seed)
{
    unsigned char *blocks[BLOCKS];
    size_t sizes[BLOCKS];
    int bad = 0;
    for (int i = 0; i < BLOCKS; i++) {
        sizes[i] = 16 + (seed * 7919u + i * 131u) % 3000;
        blocks[i] = spawner_alloc(sizes[i]);
        if (!blocks[i])
            return BLOCKS;
        memset(blocks[i], (seed + i) & 0xff, sizes[i]);
    }
    for (int i = 0; i < BLOCKS; i++) {
        for (size_t j = 0; j < sizes[i]; j++)
            if (blocks[i][j] != ((seed + i) & 0xff)) {
                bad++;
                break;
            }
        spawner_release(blocks[i]);
    }
    return bad;
}

/* One job per thread: its start routine must see it exactly once. */
struct job {
    atomic_int starts;
    atomic_int done;
    unsigned seed;
};

static void run_job(struct job *job)
{
    int starts = atomic_fetch_add(&job->starts, 1) + 1;
    if (starts != 1)
        damaged("DUPLICATE START of a thread's job", job->seed, starts);
    int bad = work(job->seed);
    if (bad)
        damaged("blocks lost their pattern", job->seed, bad);
}

static void *pthread_start(void *arg)
{
    run_job(arg);
    return NULL;
}

/* Raw threads share the thread pointer of the thread that made them (no
 * CLONE_SETTLS), so they must not call the allocator: they fill and check
 * memory on their own stack. The kernel clears their id word
 * (CLONE_CHILD_CLEARTID) and wakes its futex when they are gone. */
static int raw_start(void *arg)
{
    struct job *job = arg;
    int starts = atomic_fetch_add(&job->starts, 1) + 1;
    if (starts != 1)
        damaged("DUPLICATE START of a thread's job", job->seed, starts);
    volatile unsigned char block[4096];
    for (size_t j = 0; j < sizeof block; j++)
        block[j] = (job->seed + j) & 0xff;
    for (size_t j = 0; j < sizeof block; j++)
        if (block[j] != ((job->seed + j) & 0xff)) {
            damaged("a raw thread's stack lost its pattern", job->seed, (long)j);
            break;
        }
    return 0;
}

static void wait_cleared(atomic_int *tid_word)
{
    int v;
    while ((v = atomic_load(tid_word)) != 0)
        syscall(SYS_futex, tid_word, FUTEX_WAIT_, v, NULL, NULL, 0);
}

#define THREAD_FLAGS                                                                  \
    (CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM | \
     CLONE_CHILD_CLEARTID | CLONE_PARENT_SETTID)

/* clone3 starts the child on the given stack at the instruction after the
 * call: it cannot return into C code safely, so a small assembly entry calls
 * the routine and exits the thread. */
static long raw_clone3(struct clone_args_ *args, int (*fn)(void *), void *arg)
{
    long ret;
    register void *r8 __asm__("r8") = (void *)fn;
    register void *r9 __asm__("r9") = arg;
    __asm__ volatile(
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 1f\n\t"
        "xor %%ebp, %%ebp\n\t"
        "mov %%r9, %%rdi\n\t"
        "call *%%r8\n\t"
        "mov %%eax, %%edi\n\t"
        "mov $60, %%eax\n\t" /* exit(2): this thread only */
        "syscall\n\t"
        "hlt\n"
        "1:\n\t"
        : "=a"(ret)
        : "0"(SYS_clone3), "D"(args), "S"(sizeof *args), "r"(r8), "r"(r9)
        : "rcx", "r11", "memory");
    return ret;
}

static void raw_round(int use_clone3, unsigned round)
{
    static char *stacks[THREADS];
    struct job jobs[THREADS];
    atomic_int tids[THREADS];
    for (int i = 0; i < THREADS; i++) {
        if (!stacks[i]) {
            stacks[i] = mmap(NULL, STACK, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
            if (stacks[i] == MAP_FAILED) {
                damaged("mmap of a stack failed", errno, i);
                return;
            }
        }
        atomic_init(&jobs[i].starts, 0);
        jobs[i].seed = round * THREADS + i;
        atomic_init(&tids[i], 0);
        long tid;
        if (use_clone3) {
            struct clone_args_ args = {
                .flags = THREAD_FLAGS,
                .child_tid = (uintptr_t)&tids[i],
                .parent_tid = (uintptr_t)&tids[i],
                .stack = (uintptr_t)stacks[i],
                .stack_size = STACK,
            };
            tid = raw_clone3(&args, raw_start, &jobs[i]);
        } else {
            tid = clone(raw_start, stacks[i] + STACK, (int)THREAD_FLAGS, &jobs[i], &tids[i],
                        NULL, &tids[i]);
        }
        if (tid <= 0) {
            /* A failure is damage only if a thread was made all the same. */
            int errno_was = tid < 0 ? (int)-tid : errno;
            if (atomic_load(&tids[i]) != 0 || atomic_load(&jobs[i].starts) != 0)
                damaged("clone failed after making a thread", errno_was, atomic_load(&tids[i]));
            else
                damaged("clone failed", errno_was, i);
            return;
        }
        int told = atomic_load(&tids[i]);
        if (told != 0 && told != tid)
            damaged("clone returned another thread's id", tid, told);
    }
    for (int i = 0; i < THREADS; i++) {
        wait_cleared(&tids[i]);
        if (atomic_load(&jobs[i].starts) != 1)
            damaged("a thread's job ran other than once", jobs[i].seed,
                    atomic_load(&jobs[i].starts));
    }
}

static void pthread_round(unsigned round)
{
    pthread_t threads[THREADS];
    struct job jobs[THREADS];
    for (int i = 0; i < THREADS; i++) {
        atomic_init(&jobs[i].starts, 0);
        jobs[i].seed = round * THREADS + i;
        int err = pthread_create(&threads[i], NULL, pthread_start, &jobs[i]);
        if (err) {
            damaged("pthread_create failed", err, i);
            threads[i] = 0;
        }
    }
    for (int i = 0; i < THREADS; i++) {
        if (threads[i])
            pthread_join(threads[i], NULL);
        if (threads[i] && atomic_load(&jobs[i].starts) != 1)
            damaged("a thread's job ran other than once", jobs[i].seed,
                    atomic_load(&jobs[i].starts));
    }
}

static void process_round(int use_vfork, unsigned round)
{
    pid_t pids[THREADS];
    for (int i = 0; i < THREADS; i++) {
        unsigned seed = round * THREADS + i;
        pid_t pid;
        if (use_vfork) {
            pid = vfork();
            if (pid == 0) {
                execl(self_path, self_path, "child", (char *)NULL);
                _exit(99);
            }
        } else {
            pid = fork();
            if (pid == 0)
                _exit(work(seed) ? 1 : 42);
        }
        if (pid < 0)
            damaged("fork failed", errno, i);
        pids[i] = pid;
    }
    for (int i = 0; i < THREADS; i++) {
        if (pids[i] < 0)
            continue;
        int status;
        pid_t got;
        while ((got = waitpid(pids[i], &status, 0)) < 0 && errno == EINTR)
            ;
        if (got != pids[i])
            damaged("waitpid failed", errno, pids[i]);
        else if (!WIFEXITED(status) || WEXITSTATUS(status) != 42)
            damaged("a child ended badly", pids[i], status);
    }
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "child") == 0)
        return work((unsigned)getpid()) ? 1 : 42;
    if (argc != 2) {
        fprintf(stderr, "usage: spawner pthread|clone3|clone|fork|vfork\n");
        return 2;
    }
    ssize_t n = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
    if (n <= 0)
        return 2;
    self_path[n] = 0;
    const char *how = argv[1];
    setvbuf(stdout, NULL, _IOLBF, 0);
    struct sigaction sa = {.sa_handler = on_stop};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    printf("ready %d\n", getpid());
    time_t start = time(NULL);
    unsigned rounds = 0;
    while (!stop && time(NULL) - start < 300) {
        if (strcmp(how, "pthread") == 0)
            pthread_round(rounds);
        else if (strcmp(how, "clone3") == 0 || strcmp(how, "clone") == 0)
            raw_round(strcmp(how, "clone3") == 0, rounds);
        else if (strcmp(how, "fork") == 0)
            process_round(0, rounds);
        else if (strcmp(how, "vfork") == 0)
            process_round(1, rounds);
        else {
            fprintf(stderr, "usage: spawner pthread|clone3|clone|fork|vfork\n");
            return 2;
        }
        /* The main thread allocates too, between rounds. */
        if (work(rounds))
            damaged("the main thread's blocks lost their pattern", rounds, 0);
        rounds++;
    }
    long bad = atomic_load(&damage);
    printf("rounds %u\n%ld damaged\n", rounds, bad);
    return bad ? 1 : 0;
}
