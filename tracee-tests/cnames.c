/* C functions whose names are also C++ type codes (h: unsigned char, i:
 * int, Pc: char*, f: float, x: long long, St: std, Dn: std::nullptr_t):
 * each allocates a block of its own size and frees it. Their frames must
 * keep their C names; only mangled names (_Z..., _R...) are demangled. */
#include "truth.h"

void *volatile truth_sink;

#define ALLOCATES(name, size)                                                  \
    NOINLINE void name(void)                                                   \
    {                                                                          \
        void *p = malloc(size);                                                \
        truth_sink = p;                                                        \
        free(p);                                                               \
        truth_sink = NULL;                                                     \
    }

ALLOCATES(h, 11)
ALLOCATES(i, 12)
ALLOCATES(Pc, 13)
ALLOCATES(f, 14)
ALLOCATES(x, 15)
ALLOCATES(St, 16)
ALLOCATES(Dn, 17)

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    h();
    i();
    Pc();
    f();
    x();
    St();
    Dn();
    const char *names[] = {"h", "i", "Pc", "f", "x", "St", "Dn"};
    for (int n = 0; n < 7; n++) {
        truth(names[n], "malloc", 1, 11 + n);
        truth(names[n], "free", 1, 0);
    }
    return 0;
}
