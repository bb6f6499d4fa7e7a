/* A program under a seccomp filter that refuses a system call memptrace
 * would otherwise add: `secexec FILTER WHAT ...` installs FILTER (plain
 * prctl and classic BPF), then does WHAT:
 *
 *   FILTER  kill-memfd   SECCOMP_RET_KILL_PROCESS on memfd_create
 *           eperm-memfd  SECCOMP_RET_ERRNO(EPERM) on memfd_create
 *           no-tgkill    SECCOMP_RET_KILL_PROCESS on tgkill
 *           none         no filter
 *           strict       none until `wait` enters strict mode
 *   WHAT    exec PROGRAM ARGS...  runs PROGRAM under the filter
 *           loop N                N malloc/free pairs, truth, exit 3
 *           fork N                a forked child makes N pairs and exits 0,
 *                                 then the parent makes N and exits 3
 *           wait                  prints `ready PID` (and with `strict`,
 *                                 enters strict mode and prints `strict`),
 *                                 echoes stdin to stdout, exits 3 at its end
 *
 * Untraced, every form runs to its end: the filter only refuses what the
 * program itself never calls. */
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "truth.h"

void *volatile truth_sink;

#define PAIRS(prefix)                                                        \
    NOINLINE void *prefix##_alloc(size_t n)                                  \
    {                                                                        \
        void *p = malloc(n);                                                 \
        truth_sink = p;                                                      \
        return p;                                                            \
    }                                                                        \
    NOINLINE void prefix##_release(void *p)                                  \
    {                                                                        \
        free(p);                                                             \
        truth_sink = NULL;                                                   \
    }                                                                        \
    static void prefix##_loop(long n)                                        \
    {                                                                        \
        unsigned long bytes = 0;                                             \
        for (long i = 0; i < n; i++) {                                       \
            size_t size = 16 + i % 64;                                       \
            prefix##_release(prefix##_alloc(size));                          \
            bytes += size;                                                   \
        }                                                                    \
        truth(#prefix "_alloc", "malloc", n, bytes);                         \
        truth(#prefix "_release", "free", n, 0);                             \
    }

PAIRS(parent)
PAIRS(child)

static int install(const char *filter)
{
    long nr;
    unsigned int action;
    if (strcmp(filter, "none") == 0 || strcmp(filter, "strict") == 0)
        return 0;
    if (strcmp(filter, "kill-memfd") == 0)
        nr = SYS_memfd_create, action = SECCOMP_RET_KILL_PROCESS;
    else if (strcmp(filter, "eperm-memfd") == 0)
        nr = SYS_memfd_create, action = SECCOMP_RET_ERRNO | EPERM;
    else if (strcmp(filter, "no-tgkill") == 0)
        nr = SYS_tgkill, action = SECCOMP_RET_KILL_PROCESS;
    else
        return -1;
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, action),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof code / sizeof code[0], code};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
        perror("secexec: seccomp");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 3 || install(argv[1]) != 0) {
        fprintf(stderr, "usage: secexec FILTER exec PROGRAM... | loop N | fork N\n");
        return 2;
    }
    if (strcmp(argv[2], "exec") == 0 && argc > 3) {
        execvp(argv[3], argv + 3);
        perror("secexec: exec");
        return 127;
    }
    long n = argc > 3 ? atol(argv[3]) : 1000;
    if (strcmp(argv[2], "loop") == 0) {
        parent_loop(n);
        return 3;
    }
    if (strcmp(argv[2], "fork") == 0) {
        pid_t pid = fork();
        if (pid == 0) {
            child_loop(n);
            exit(0);
        }
        int status;
        if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
            WEXITSTATUS(status) != 0) {
            fprintf(stderr, "secexec: the child did not exit 0 (status %#x)\n", status);
            return 1;
        }
        parent_loop(n);
        return 3;
    }
    if (strcmp(argv[2], "wait") == 0) {
        parent_release(parent_alloc(10));
        printf("ready %d\n", (int)getpid());
        /* Strict mode allows read, write, exit and sigreturn only: no
         * exit_group, no allocation from here on. */
        if (strcmp(argv[1], "strict") == 0) {
            if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_STRICT, 0, 0, 0) != 0)
                return 1;
            write(1, "strict\n", 7);
        }
        char buf[256];
        ssize_t n;
        while ((n = read(0, buf, sizeof buf)) > 0)
            write(1, buf, (size_t)n);
        syscall(SYS_exit, 3);
    }
    return 2;
}
