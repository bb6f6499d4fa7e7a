/* A program that forks, vforks, posix_spawns and calls system(), allocating
 * around each. A child inherits the int3 bytes memptrace planted: unless they
 * are removed, its first malloc kills it with SIGTRAP. Each child checks
 * itself and exits with a known status, which the parent checks; the program
 * exits 0 only if every child behaved. Children are not traced, so only the
 * parent's calls are in the ground truth. With `exec PROGRAM`, it runs
 * PROGRAM in a forked child instead. */
#include <spawn.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "truth.h"

extern char **environ;
void *volatile truth_sink;

NOINLINE void *parent_alloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

NOINLINE void parent_release(void *p)
{
    free(p);
    truth_sink = NULL;
}

NOINLINE int child_work(void)
{
    /* Allocates and checks that its memory holds what it wrote. */
    char *blocks[100];
    for (int i = 0; i < 100; i++) {
        blocks[i] = malloc(100 + i);
        memset(blocks[i], i, 100 + i);
    }
    int ok = 1;
    for (int i = 0; i < 100; i++) {
        for (int j = 0; j < 100 + i; j++)
            ok &= blocks[i][j] == (char)i;
        free(blocks[i]);
    }
    return ok;
}

static int check(const char *what, int status, int want)
{
    if (WIFEXITED(status) && WEXITSTATUS(status) == want)
        return 1;
    fprintf(stderr, "forks: %s: status %#x, wanted exit %d\n", what, status, want);
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    int ok = 1, status;
    /* `forks exec PROGRAM`: allocate, then run PROGRAM in a forked child and
     * exit with its status. */
    if (argc > 2 && strcmp(argv[1], "exec") == 0) {
        parent_release(parent_alloc(10));
        pid_t pid = fork();
        if (pid == 0) {
            execv(argv[2], argv + 2);
            _exit(127);
        }
        waitpid(pid, &status, 0);
        return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    }
    int calls = 0;

    parent_release(parent_alloc(10)), calls++;

    pid_t pid = fork();
    if (pid == 0)
        _exit(child_work() ? 42 : 1);
    parent_release(parent_alloc(20)), calls++;
    waitpid(pid, &status, 0);
    ok &= check("fork", status, 42);

    /* The parent runs on as soon as its vfork child execs, and allocates at
     * once: memptrace must record it again by then (ten times over). */
    for (int i = 0; i < 10; i++) {
        pid = vfork();
        if (pid == 0) {
            execl("/bin/sh", "sh", "-c", "exit 43", (char *)NULL);
            _exit(127);
        }
        parent_release(parent_alloc(1)), calls++;
        waitpid(pid, &status, 0);
        ok &= check("vfork", status, 43);
    }
    parent_release(parent_alloc(30)), calls++;

    char *sh_argv[] = {"sh", "-c", "exit 44", NULL};
    if (posix_spawn(&pid, "/bin/sh", NULL, NULL, sh_argv, environ) != 0)
        ok = 0;
    parent_release(parent_alloc(5)), calls++;
    waitpid(pid, &status, 0);
    ok &= check("posix_spawn", status, 44);
    parent_release(parent_alloc(40)), calls++;

    status = system("exit 45");
    ok &= check("system", status, 45);
    parent_release(parent_alloc(50)), calls++;

    truth("parent_alloc", "malloc", calls, 165);
    truth("parent_release", "free", calls, 0);
    truth("child_work", "malloc", 0, 0);
    truth("child_work", "free", 0, 0);
    return ok ? 0 : 1;
}
