/* An identity map from object pointers to indices.
 *
 * Why not a dict keyed by tensors: torch.Tensor.__hash__ is a Python-level
 * method (it returns id(self)), so every dict probe with a tensor key runs
 * Python code.  The walker and the optimizer mapping probe once or twice
 * per parameter; doing that through a C table keyed by the object address
 * keeps the per-parameter cost at a few nanoseconds.
 *
 * The map never owns references: whoever fills it must keep the objects
 * alive for as long as the map is used (ModelIndex holds them in lists).
 * Open addressing, linear probing, power-of-two capacity, load <= 1/2.
 */
#ifndef DCP_PTRMAP_H
#define DCP_PTRMAP_H

#include <stdint.h>
#include <string.h>

typedef struct {
    const void *key; /* NULL marks an empty slot */
    Py_ssize_t value;
} dcp_ptrmap_slot;

typedef struct {
    dcp_ptrmap_slot *slots;
    size_t mask; /* capacity - 1 */
    size_t used;
} dcp_ptrmap;

static inline size_t
dcp_ptr_hash(const void *p)
{
    /* Objects are 16-byte aligned; fold the address with a multiplicative
     * (Fibonacci) hash so that low bits are well mixed. */
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 4;
    x *= UINT64_C(0x9E3779B97F4A7C15);
    return (size_t)(x ^ (x >> 29));
}

/* Returns 0, or -1 with MemoryError set. */
static inline int
dcp_ptrmap_init(dcp_ptrmap *map, size_t expected)
{
    size_t cap = 16;
    while (cap < expected * 2 + 2) {
        cap <<= 1;
    }
    map->slots = PyMem_Calloc(cap, sizeof(dcp_ptrmap_slot));
    if (map->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    map->mask = cap - 1;
    map->used = 0;
    return 0;
}

static inline void
dcp_ptrmap_free(dcp_ptrmap *map)
{
    PyMem_Free(map->slots);
    map->slots = NULL;
    map->mask = 0;
    map->used = 0;
}

/* Returns the stored index, or -1 when absent. */
static inline Py_ssize_t
dcp_ptrmap_get(const dcp_ptrmap *map, const void *key)
{
    if (map->slots == NULL) {
        return -1;
    }
    size_t i = dcp_ptr_hash(key) & map->mask;
    for (;;) {
        const dcp_ptrmap_slot *s = &map->slots[i];
        if (s->key == key) {
            return s->value;
        }
        if (s->key == NULL) {
            return -1;
        }
        i = (i + 1) & map->mask;
    }
}

static inline int
dcp_ptrmap_grow(dcp_ptrmap *map)
{
    size_t old_cap = map->mask + 1;
    dcp_ptrmap_slot *old = map->slots;
    size_t cap = old_cap * 2;
    dcp_ptrmap_slot *slots = PyMem_Calloc(cap, sizeof(dcp_ptrmap_slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t j = 0; j < old_cap; j++) {
        if (old[j].key == NULL) {
            continue;
        }
        size_t i = dcp_ptr_hash(old[j].key) & (cap - 1);
        while (slots[i].key != NULL) {
            i = (i + 1) & (cap - 1);
        }
        slots[i] = old[j];
    }
    PyMem_Free(old);
    map->slots = slots;
    map->mask = cap - 1;
    return 0;
}

/* Inserts key -> value unless key is present.  Returns the index already
 * stored (>= 0) when present, -1 when inserted, -2 with MemoryError set. */
static inline Py_ssize_t
dcp_ptrmap_setdefault(dcp_ptrmap *map, const void *key, Py_ssize_t value)
{
    if (map->slots == NULL && dcp_ptrmap_init(map, 8) < 0) {
        return -2;
    }
    if ((map->used + 1) * 2 > map->mask + 1 && dcp_ptrmap_grow(map) < 0) {
        return -2;
    }
    size_t i = dcp_ptr_hash(key) & map->mask;
    for (;;) {
        dcp_ptrmap_slot *s = &map->slots[i];
        if (s->key == key) {
            return s->value;
        }
        if (s->key == NULL) {
            s->key = key;
            s->value = value;
            map->used++;
            return -1;
        }
        i = (i + 1) & map->mask;
    }
}

#endif /* DCP_PTRMAP_H */
