/* A program that writes over the memory it shares with memptrace (issue 18:
 * that memory is untrusted input). Traced with jump probes, it finds the
 * control area in its own memory (the `memfd:memptrace` mapping whose first
 * word is the magic "memptrc1"), finds its own thread's slot (the key is its
 * thread pointer + 1), damages it as argv[1] says, waits until memptrace
 * has read its ring past the damage, then keeps allocating
 * (from scribble_after, 1000 malloc/free pairs of 48 bytes) and exits 0:
 *
 *   random    random bytes over the free slots, its own counters, and 4 KiB
 *             of its ring, which it then commits (head += 4096)
 *   size65    a record of size 65 committed (the head left unaligned)
 *   ffff      a record whose size and frame fields are 0xffff
 *   again     a record of size 65, ten times over
 *   counter   the area's sequence counter set to a random number
 *   head      its ring's head pushed 2^40 bytes ahead
 *   counters  its nested, abandoned and wait counters set to 2^64-1
 *   seqs      copies of its last malloc record numbered 5, 3, 3, 2^64-2
 *   garbage   a copy with a fresh number (taken from the area's counter as
 *             a probe does) stamped 2^63 with garbage frames, then a record of op
 *             10 (`inventory`), probe 999, flags 0xf0
 *
 * (The program never touches what its probes need to run safely: the
 * slot's key, ring and stack words, the directory of unwind tables.)
 *
 * It prints `scribbled MODE` once done, or `no control area` when it finds
 * none (int3 probes, or untraced), and the truth of scribble_after. The
 * offsets are those of src/tracer/probes/jump/layout.rs. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "truth.h"

void *volatile truth_sink;

#define HEADER_SIZE 4096u
#define SLOT_SIZE 256u
#define SLOTS (1024u + 4u)
#define ARCH_GET_FS 0x1003
#define AREA_SEQ 64u
#define RING_SIZE (1ul << 20)
#define RECORD_HEADER 64u

/* Slot fields. */
#define KEY 0u
#define RING 32u
#define NESTED 112u
#define ABANDONED 120u
#define HEAD 128u
#define WAITS 144u
#define TAIL 192u

static volatile uint64_t *word(unsigned char *at)
{
    return (volatile uint64_t *)at;
}

/* The control area: the memptrace memfd that begins with the magic. */
static unsigned char *find_area(void)
{
    FILE *maps = fopen("/proc/self/maps", "r");
    if (!maps)
        return NULL;
    char line[512];
    unsigned char *found = NULL;
    while (!found && fgets(line, sizeof line, maps)) {
        if (!strstr(line, "memfd:memptrace"))
            continue;
        unsigned long lo, hi;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3 || hi - lo < HEADER_SIZE ||
            strncmp(perms, "rw", 2) != 0)
            continue;
        if (memcmp((void *)lo, "memptrc1", 8) == 0)
            found = (unsigned char *)lo;
    }
    fclose(maps);
    return found;
}

static unsigned char *own_slot(unsigned char *area)
{
    unsigned long fs = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_FS, &fs) != 0)
        return NULL;
    for (unsigned i = 0; i < SLOTS; i++) {
        unsigned char *slot = area + HEADER_SIZE + i * SLOT_SIZE;
        if (*word(slot + KEY) == fs + 1)
            return slot;
    }
    return NULL;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next_random(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Where a record `off` bytes past the head goes (a record starts in the
 * ring and may run past its end, into the room after it), once the ring
 * is at least half free (memptrace empties it). */
static unsigned char *past_head(unsigned char *slot, unsigned char *ring, uint64_t off)
{
    while (*word(slot + HEAD) - *word(slot + TAIL) > RING_SIZE / 2)
        usleep(1000);
    return ring + (*word(slot + HEAD) + off) % RING_SIZE;
}

/* Commit `len` bytes past the head (as a probe does: bytes, then head). */
static void commit(unsigned char *slot, uint64_t len)
{
    __atomic_store_n(word(slot + HEAD), *word(slot + HEAD) + len, __ATOMIC_RELEASE);
}

NOINLINE static void *scribble_malloc(size_t n)
{
    void *p = malloc(n);
    truth_sink = p;
    return p;
}

static void header_record(unsigned char *slot, unsigned char *ring, uint64_t header, uint64_t len)
{
    unsigned char *r = past_head(slot, ring, 0);
    memset(r, 0, len < RECORD_HEADER ? RECORD_HEADER : len);
    *word(r) = header;
    commit(slot, len);
}

static int scribble(const char *mode, unsigned char *area, unsigned char *slot)
{
    unsigned char *ring = (unsigned char *)(uintptr_t)*word(slot + RING);
    /* A record of the program's own to copy: its last malloc's. */
    uint64_t before = *word(slot + HEAD);
    void *block = scribble_malloc(24);
    uint64_t after = *word(slot + HEAD);
    unsigned char model[RECORD_HEADER + 128 * 8];
    uint64_t size = after - before;
    if (size < RECORD_HEADER || size > sizeof model)
        return 0;
    memcpy(model, ring + before % RING_SIZE, size);
    free(block);

    if (!strcmp(mode, "random")) {
        for (unsigned i = 0; i < SLOTS; i++) {
            unsigned char *other = area + HEADER_SIZE + i * SLOT_SIZE;
            if (other == slot || *word(other + KEY) != 0)
                continue;
            for (unsigned w = 0; w < SLOT_SIZE; w += 8)
                *word(other + w) = next_random();
        }
        *word(slot + NESTED) = next_random();
        *word(slot + ABANDONED) = next_random();
        *word(slot + WAITS) = next_random();
        unsigned char *r = past_head(slot, ring, 0);
        for (unsigned w = 0; w < 4096; w += 8)
            *word(r + w) = next_random();
        commit(slot, 4096);
    } else if (!strcmp(mode, "size65")) {
        header_record(slot, ring, 65 | (uint64_t)0 << 40, 65);
    } else if (!strcmp(mode, "again")) {
        /* Ten bad records, each once memptrace has read past the one
         * before: the slot is dropped after the eighth. */
        for (int i = 0; i < 10; i++) {
            header_record(slot, ring, 65, 65);
            while (*word(slot + TAIL) != *word(slot + HEAD))
                usleep(1000);
        }
    } else if (!strcmp(mode, "counter")) {
        *word(area + AREA_SEQ) = next_random();
    } else if (!strcmp(mode, "ffff")) {
        header_record(slot, ring, 0xffff | 0xfffful << 16, RECORD_HEADER);
    } else if (!strcmp(mode, "head")) {
        commit(slot, 1ul << 40);
    } else if (!strcmp(mode, "counters")) {
        *word(slot + NESTED) = UINT64_MAX;
        *word(slot + ABANDONED) = UINT64_MAX;
        *word(slot + WAITS) = UINT64_MAX;
    } else if (!strcmp(mode, "seqs")) {
        const uint64_t seqs[] = {5, 3, 3, UINT64_MAX - 1};
        for (unsigned i = 0; i < 4; i++) {
            unsigned char *r = past_head(slot, ring, i * size);
            memcpy(r, model, size);
            *word(r + 8) = seqs[i];
        }
        commit(slot, 4 * size);
    } else if (!strcmp(mode, "garbage")) {
        unsigned char *r = past_head(slot, ring, 0);
        memcpy(r, model, size);
        /* A number of its own, taken as a probe takes it: only the time
         * and the frames are wrong. */
        *word(r + 8) = __atomic_fetch_add(word(area + AREA_SEQ), 1, __ATOMIC_SEQ_CST);
        *word(r + 16) = 1ull << 63;
        for (uint64_t f = RECORD_HEADER; f < size; f += 8)
            *word(r + f) = next_random();
        uint64_t header = RECORD_HEADER | (uint64_t)0xf0 << 32 | (uint64_t)10 << 40 |
                          (uint64_t)999 << 48;
        unsigned char *bad = past_head(slot, ring, size);
        memset(bad, 0, RECORD_HEADER);
        *word(bad) = header;
        commit(slot, size + RECORD_HEADER);
    } else {
        fprintf(stderr, "scribble: unknown mode %s\n", mode);
        exit(2);
    }
    /* memptrace empties a damaged ring to its head: the calls after are
     * recorded once it has read past the damage (it reads every ms). */
    for (int ms = 0; *word(slot + TAIL) != *word(slot + HEAD); ms++) {
        if (ms == 30000) {
            fprintf(stderr, "scribble: memptrace never read the ring\n");
            exit(3);
        }
        usleep(1000);
    }
    return 1;
}

NOINLINE static void scribble_after(void)
{
    for (int i = 0; i < 1000; i++) {
        void *p = malloc(48);
        truth_sink = p;
        free(p);
    }
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: scribble MODE\n");
        return 2;
    }
    /* Its own slot exists once a probe has run on the thread. */
    free(scribble_malloc(16));
    unsigned char *area = find_area();
    unsigned char *slot = area ? own_slot(area) : NULL;
    if (slot && scribble(argv[1], area, slot))
        printf("scribbled %s\n", argv[1]);
    else
        printf("no control area\n");
    scribble_after();
    truth("scribble_after", "malloc", 1000, 48000);
    truth("scribble_after", "free", 1000, 0);
    return 0;
}
