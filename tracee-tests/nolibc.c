/* A program without a C library: no allocator anywhere, in any image. It
 * prints "ready PID" and sleeps until killed (or 300 s). Built static and
 * stripped (memptrace must refuse it, at launch and at attach, without
 * stopping it for long), and dynamic with the dynamic linker as its only
 * image besides itself (the allocator is missing from every image: an
 * attach hooks nothing and must let it go unchanged). */

static long sys(long n, long a, long b, long c)
{
    long r;
    __asm__ volatile("syscall"
                     : "=a"(r)
                     : "a"(n), "D"(a), "S"(b), "d"(c)
                     : "rcx", "r11", "memory");
    return r;
}

void _start(void)
{
    char line[32] = "ready ";
    char digits[16];
    long pid = sys(39, 0, 0, 0); /* getpid */
    int n = 0, at = 6;
    do {
        digits[n++] = (char)('0' + pid % 10);
        pid /= 10;
    } while (pid);
    while (n)
        line[at++] = digits[--n];
    line[at++] = '\n';
    sys(1, 1, (long)line, at); /* write */
    struct {
        long s, ns;
    } t = {300, 0};
    sys(35, (long)&t, 0, 0); /* nanosleep */
    sys(60, 0, 0, 0);        /* exit(0) */
}
