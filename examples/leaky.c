/* An example for memptrace: a small "server" with a cache that never shrinks,
 * worker threads that allocate and free, and a buffer that grows by realloc. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct entry {
    char *key;
    struct entry *next;
};

static struct entry *cache;
/* Where workers show their scratch buffers to the world (so the compiler
 * cannot drop a malloc/free pair as unused). */
static void *volatile last_scratch;

__attribute__((noinline)) static char *copy_key(const char *s)
{
    char *k = malloc(strlen(s) + 1);
    strcpy(k, s);
    return k;
}

/* Leaks: entries are added to the cache and never removed. */
__attribute__((noinline)) static void cache_insert(const char *s)
{
    struct entry *e = calloc(1, sizeof *e);
    e->key = copy_key(s);
    e->next = cache;
    cache = e;
}

__attribute__((noinline)) static void *worker(void *arg)
{
    long id = (long)arg;
    for (int i = 0; i < 20000; i++) {
        char *scratch = malloc(64 + (i % 512));
        memset(scratch, (int)id, 64);
        last_scratch = scratch;
        free(scratch);
    }
    return NULL;
}

__attribute__((noinline)) static char *grow_log(void)
{
    char *log = NULL;
    size_t len = 0;
    for (int i = 0; i < 100; i++) {
        log = realloc(log, len + 128);
        len += 128;
    }
    return log;
}

int main(void)
{
    pthread_t threads[4];
    for (long t = 0; t < 4; t++)
        pthread_create(&threads[t], NULL, worker, (void *)t);
    char name[32];
    for (int i = 0; i < 1000; i++) {
        snprintf(name, sizeof name, "key-%d", i);
        cache_insert(name);
    }
    for (int t = 0; t < 4; t++)
        pthread_join(threads[t], NULL);
    free(grow_log());
    printf("leaky: done\n");
    return 0;
}
