/* Resident memory a test can watch rise and fall, step by step as the test
 * decides (it waits for conditions, never for time):
 *
 *   resident        print `ready PID` and wait for a line on stdin;
 *                   malloc 8 MiB and leave it untouched (heap requested,
 *                   not resident); mmap 64 MiB of anonymous memory and
 *                   write to every page, print `touched BYTES`, wait for a
 *                   line on stdin; unmap it and free the block, print
 *                   `released`, wait for a line; exit.
 *   resident fork   the same in a forked child (its `ready` names its
 *                   own pid); the parent waits for it and prints
 *                   `parent done`.
 */
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "truth.h"

void *volatile truth_sink;

#define TOUCHED (64UL << 20)
#define REQUESTED (8UL << 20)

static void wait_line(void)
{
    int c;
    while ((c = getchar()) != EOF && c != '\n')
        ;
}

NOINLINE void *resident_request(void)
{
    void *p = malloc(REQUESTED);
    truth_sink = p;
    return p;
}

NOINLINE char *resident_touch(void)
{
    char *p = mmap(NULL, TOUCHED, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    for (unsigned long i = 0; i < TOUCHED; i += 4096)
        p[i] = (char)i | 1;
    return p;
}

static void hold_and_release(void)
{
    printf("ready %d\n", (int)getpid());
    wait_line();
    void *block = resident_request();
    char *touched = resident_touch();
    printf("touched %lu\n", TOUCHED);
    wait_line();
    munmap(touched, TOUCHED);
    free(block);
    printf("released\n");
    wait_line();
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc > 1 && strcmp(argv[1], "fork") == 0) {
        pid_t child = fork();
        if (child < 0) {
            perror("fork");
            return 1;
        }
        if (child == 0) {
            hold_and_release();
            return 0;
        }
        int status;
        waitpid(child, &status, 0);
        printf("parent done\n");
        return 0;
    }
    hold_and_release();
    return 0;
}
