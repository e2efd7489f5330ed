/* The prefix index's storage: open-addressing hash tables of 64-bit keys, in C.
 *
 * A BlockTable maps a uint64 key to a value of `words` uint64 words. The prefix index uses it two ways: as a
 * tier table (block key -> bitmask of the event sources holding the block; an entry whose mask reaches zero is
 * deleted) and as a source's engine map (engine block hash -> block key, one word). Slots are [key, value...]
 * inline, probed linearly from a home slot picked by a mixed hash scaled onto the capacity (so capacity is any
 * size and grows by half: the load stays between 0.53 and 0.8, 20-30 bytes per one-word entry). Key 0 lives in
 * a spare slot after the probe area, so an empty slot is simply key 0. Deletion shifts the probe run back (no
 * tombstones).
 *
 * An `ordered` table also keeps a doubly linked recency list through the slots (8 more bytes per slot): stores,
 * matches and touches move keys to its newest end and `evict_oldest` drops from the other end. That is what the
 * index's optional block budget needs; without a budget tables are unordered and carry no links.
 *
 * Memory comes from PyMem_* so tracemalloc sees it. Keys are Python ints taken modulo 2**64 (a signed 64-bit engine
 * hash keeps its bits): converting one never runs Python code, so no operation can be re-entered halfway.
 * Mutating operations read all their keys first, so a bad key raises before anything changed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define NIL UINT32_MAX
#define NONE SIZE_MAX
#define MAX_WORDS 64 /* 4096 sources */
#define MIN_CAP 8
#define STACK_KEYS 512

typedef struct {
    uint32_t prev, next;
} Link;

typedef struct {
    PyObject_HEAD
    uint64_t *slots; /* (cap + 1) * stride words; slot `cap` holds key 0 */
    Link *links;     /* cap + 1 links when ordered, else NULL */
    size_t cap;      /* probe slots, the zero slot excluded */
    size_t used;     /* entries, the zero slot included */
    size_t stride;   /* 1 + words */
    int words;
    int ordered;
    int zero_used;
    uint32_t head, tail; /* oldest and newest entry when ordered */
} Table;

static PyTypeObject TableType;

/* ---- hashing and probing --------------------------------------------------------------------------------- */

static inline uint64_t mix(uint64_t k) {
    /* MurmurHash3's finalizer: engine hashes may be small sequential ints; keys must still spread. */
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static inline size_t home_of(size_t cap, uint64_t key) {
    return (size_t)(((unsigned __int128)mix(key) * (unsigned __int128)cap) >> 64);
}

static inline uint64_t *slot_at(const Table *t, size_t i) { return t->slots + i * t->stride; }

/* Bulk operations look AHEAD keys forward and prefetch their home slots: a table bigger than the caches then
 * costs overlapped memory misses rather than one round trip per key. */
#define AHEAD 8

static inline void prefetch_home(const Table *t, uint64_t key) {
    __builtin_prefetch(t->slots + (key ? home_of(t->cap, key) : t->cap) * t->stride);
}

static size_t find(const Table *t, uint64_t key) {
    if (key == 0)
        return t->zero_used ? t->cap : NONE;
    size_t i = home_of(t->cap, key);
    const size_t stride = t->stride;
    const uint64_t *slots = t->slots;
    for (;;) {
        uint64_t k = slots[i * stride];
        if (k == key)
            return i;
        if (k == 0)
            return NONE;
        if (++i == t->cap)
            i = 0;
    }
}

/* ---- recency list ---------------------------------------------------------------------------------------- */

static void link_newest(Table *t, uint32_t i) {
    t->links[i].prev = t->tail;
    t->links[i].next = NIL;
    if (t->tail != NIL)
        t->links[t->tail].next = i;
    else
        t->head = i;
    t->tail = i;
}

static void unlink_slot(Table *t, uint32_t i) {
    Link l = t->links[i];
    if (l.prev != NIL)
        t->links[l.prev].next = l.next;
    else
        t->head = l.next;
    if (l.next != NIL)
        t->links[l.next].prev = l.prev;
    else
        t->tail = l.prev;
}

static void relink(Table *t, uint32_t from, uint32_t to) {
    Link l = t->links[from];
    t->links[to] = l;
    if (l.prev != NIL)
        t->links[l.prev].next = to;
    else
        t->head = to;
    if (l.next != NIL)
        t->links[l.next].prev = to;
    else
        t->tail = to;
}

static inline void make_newest(Table *t, size_t i) {
    if (t->tail != (uint32_t)i) {
        unlink_slot(t, (uint32_t)i);
        link_newest(t, (uint32_t)i);
    }
}

/* ---- storage --------------------------------------------------------------------------------------------- */

static int allocate(size_t cap, size_t stride, int ordered, uint64_t **slots, Link **links) {
    if (cap >= (size_t)NIL - 1 || cap + 1 > PY_SSIZE_T_MAX / (stride * sizeof(uint64_t))) {
        PyErr_SetString(PyExc_MemoryError, "block table too large");
        return -1;
    }
    *slots = PyMem_Calloc(cap + 1, stride * sizeof(uint64_t));
    if (*slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *links = NULL;
    if (ordered) {
        *links = PyMem_Malloc((cap + 1) * sizeof(Link));
        if (*links == NULL) {
            PyMem_Free(*slots);
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

/* Place a key known to be absent, with room known to exist; returns its slot (value words zeroed). */
static size_t place(Table *t, uint64_t key) {
    size_t i;
    if (key == 0) {
        i = t->cap;
        t->zero_used = 1;
    } else {
        i = home_of(t->cap, key);
        while (t->slots[i * t->stride] != 0)
            if (++i == t->cap)
                i = 0;
        t->slots[i * t->stride] = key;
    }
    t->used++;
    if (t->ordered)
        link_newest(t, (uint32_t)i);
    return i;
}

typedef int (*keep_fn)(const Table *t, const uint64_t *slot, void *ctx);

static int keep_nonzero(const Table *t, const uint64_t *slot, void *ctx) {
    (void)ctx;
    for (int w = 1; w <= t->words; w++)
        if (slot[w])
            return 1;
    return 0;
}

/* Rebuild into `new_cap` probe slots of `new_words` value words, keeping the entries `keep` accepts (all when
 * NULL), oldest first when ordered. */
static int rehash(Table *t, size_t new_cap, int new_words, keep_fn keep, void *ctx) {
    size_t new_stride = (size_t)new_words + 1;
    uint64_t *slots;
    Link *links;
    if (allocate(new_cap, new_stride, t->ordered, &slots, &links) < 0)
        return -1;
    Table old = *t;
    t->slots = slots;
    t->links = links;
    t->cap = new_cap;
    t->stride = new_stride;
    t->words = new_words;
    t->used = 0;
    t->zero_used = 0;
    t->head = t->tail = NIL;
    size_t copy = (size_t)(old.words < new_words ? old.words : new_words) * sizeof(uint64_t);
    if (old.ordered) {
        for (uint32_t i = old.head; i != NIL; i = old.links[i].next) {
            const uint64_t *src = old.slots + (size_t)i * old.stride;
            if (keep != NULL && !keep(&old, src, ctx))
                continue;
            uint64_t key = (size_t)i == old.cap ? 0 : src[0];
            memcpy(slot_at(t, place(t, key)) + 1, src + 1, copy);
        }
    } else {
        /* In batches: find a batch's entries, prefetch their new homes, then place them. */
        size_t batch[2 * AHEAD];
        size_t i = 0;
        while (i <= old.cap) {
            size_t count = 0;
            for (; i <= old.cap && count < 2 * AHEAD; i++) {
                const uint64_t *src = old.slots + i * old.stride;
                if (i == old.cap ? !old.zero_used : src[0] == 0)
                    continue;
                if (keep != NULL && !keep(&old, src, ctx))
                    continue;
                batch[count++] = i;
                prefetch_home(t, i == old.cap ? 0 : src[0]);
            }
            for (size_t b = 0; b < count; b++) {
                const uint64_t *src = old.slots + batch[b] * old.stride;
                memcpy(slot_at(t, place(t, batch[b] == old.cap ? 0 : src[0])) + 1, src + 1, copy);
            }
        }
    }
    PyMem_Free(old.slots);
    PyMem_Free(old.links);
    return 0;
}

static size_t cap_for(size_t entries) {
    /* Room for `entries` at a load of about 2/3: the middle of the band the table keeps. */
    size_t cap = entries + entries / 2 + 1;
    return cap < MIN_CAP ? MIN_CAP : cap;
}

static int reserve(Table *t, size_t more) {
    /* Grow by half when the load would pass 0.8. */
    size_t need = t->used + more;
    if (need * 5 <= t->cap * 4)
        return 0;
    size_t cap = t->cap + t->cap / 2;
    if (cap * 4 < need * 5)
        cap = need * 5 / 4 + 1;
    return rehash(t, cap, t->words, NULL, NULL);
}

static int maybe_shrink(Table *t) {
    /* After bulk removals: give memory back once the load falls under 0.2. */
    if (t->cap > MIN_CAP && t->used * 5 < t->cap)
        return rehash(t, cap_for(t->used), t->words, NULL, NULL);
    return 0;
}

/* Find `key` or add it (value zeroed, growing the table first if need be); NONE with an exception set when the
 * table cannot grow. */
static size_t find_or_place(Table *t, uint64_t key, int *created) {
    size_t i = find(t, key);
    *created = i == NONE;
    if (i != NONE)
        return i;
    if (reserve(t, 1) < 0)
        return NONE;
    return place(t, key);
}

static void delete_at(Table *t, size_t i) {
    if (t->ordered)
        unlink_slot(t, (uint32_t)i);
    t->used--;
    if (i == t->cap) {
        t->zero_used = 0;
        memset(slot_at(t, i), 0, t->stride * sizeof(uint64_t));
        return;
    }
    size_t hole = i, j = i;
    for (;;) {
        if (++j == t->cap)
            j = 0;
        uint64_t k = t->slots[j * t->stride];
        if (k == 0)
            break;
        size_t h = home_of(t->cap, k);
        /* The entry at j may fill the hole unless its home lies cyclically in (hole, j]. */
        int movable = hole <= j ? (h <= hole || h > j) : (h <= hole && h > j);
        if (movable) {
            memcpy(slot_at(t, hole), slot_at(t, j), t->stride * sizeof(uint64_t));
            if (t->ordered)
                relink(t, (uint32_t)j, (uint32_t)hole);
            hole = j;
        }
    }
    memset(slot_at(t, hole), 0, t->stride * sizeof(uint64_t));
}

/* ---- argument helpers ------------------------------------------------------------------------------------ */

static int as_u64(PyObject *item, uint64_t *out) {
    /* The int's low 64 bits (two's complement for a negative one), as wire.py folds engine hashes: read straight
     * from the digits, where PyLong_AsUnsignedLongLong would go through a generic byte-array conversion. Only
     * ints get here, so no __index__ (no Python code) runs. */
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "block keys and hashes must be ints, not %.100s", Py_TYPE(item)->tp_name);
        return -1;
    }
    *out = (uint64_t)PyLong_AsUnsignedLongLongMask(item);
    return 0;
}

typedef struct {
    uint64_t *values;
    Py_ssize_t n;
    uint64_t local[STACK_KEYS];
} U64s;

static void u64s_free(U64s *buf) {
    if (buf->values != buf->local)
        PyMem_Free(buf->values);
}

/* Read a sequence (or any iterable) of ints into a C array, before anything is changed. */
static int u64s_read(PyObject *obj, U64s *buf) {
    PyObject *fast = PySequence_Fast(obj, "expected a sequence of ints");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    buf->values = buf->local;
    buf->n = n;
    if (n > STACK_KEYS) {
        buf->values = PyMem_Malloc((size_t)n * sizeof(uint64_t));
        if (buf->values == NULL) {
            Py_DECREF(fast);
            PyErr_NoMemory();
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_u64(items[i], &buf->values[i]) < 0) {
            u64s_free(buf);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static int bit_arg(const Table *t, Py_ssize_t bit, size_t *word, uint64_t *mask) {
    if (bit < 0 || bit >= (Py_ssize_t)t->words * 64) {
        PyErr_Format(PyExc_ValueError, "bit %zd outside this table's %d words", bit, t->words);
        return -1;
    }
    *word = 1 + (size_t)bit / 64;
    *mask = (uint64_t)1 << (bit % 64);
    return 0;
}

static PyObject *value_to_int(const Table *t, const uint64_t *slot) {
    if (t->words == 1)
        return PyLong_FromUnsignedLongLong(slot[1]);
    PyObject *result = PyLong_FromLong(0);
    PyObject *shift = PyLong_FromLong(64);
    for (int w = t->words; w >= 1 && result != NULL && shift != NULL; w--) {
        PyObject *moved = PyNumber_Lshift(result, shift);
        Py_DECREF(result);
        result = NULL;
        if (moved == NULL)
            break;
        PyObject *word = PyLong_FromUnsignedLongLong(slot[w]);
        if (word == NULL) {
            Py_DECREF(moved);
            break;
        }
        result = PyNumber_Or(moved, word);
        Py_DECREF(moved);
        Py_DECREF(word);
    }
    Py_XDECREF(shift);
    return result;
}

static int check_tables(PyObject *tables, int words, const char *what) {
    if (!PyTuple_Check(tables)) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple of BlockTable", what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tables); i++) {
        PyObject *item = PyTuple_GET_ITEM(tables, i);
        if (!PyObject_TypeCheck(item, &TableType)) {
            PyErr_Format(PyExc_TypeError, "%s must be a tuple of BlockTable", what);
            return -1;
        }
        if (words > 0 && ((Table *)item)->words != words) {
            PyErr_SetString(PyExc_ValueError, "tables of one index must have the same width");
            return -1;
        }
    }
    return 0;
}

/* ---- the type -------------------------------------------------------------------------------------------- */

static PyObject *Table_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"words", "ordered", NULL};
    int words = 1, ordered = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|ip:BlockTable", names, &words, &ordered))
        return NULL;
    if (words < 1 || words > MAX_WORDS) {
        PyErr_Format(PyExc_ValueError, "words must be in 1..%d", MAX_WORDS);
        return NULL;
    }
    Table *t = (Table *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->words = words;
    t->stride = (size_t)words + 1;
    t->ordered = ordered;
    t->cap = MIN_CAP;
    t->head = t->tail = NIL;
    if (allocate(t->cap, t->stride, ordered, &t->slots, &t->links) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void Table_dealloc(Table *t) {
    PyMem_Free(t->slots);
    PyMem_Free(t->links);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t Table_len(Table *t) { return (Py_ssize_t)t->used; }

static PyObject *Table_get_words(Table *t, void *closure) { return PyLong_FromLong(t->words); }
static PyObject *Table_get_ordered(Table *t, void *closure) { return PyBool_FromLong(t->ordered); }
static PyObject *Table_get_nbytes(Table *t, void *closure) {
    size_t bytes = sizeof(Table) + (t->cap + 1) * t->stride * sizeof(uint64_t);
    if (t->ordered)
        bytes += (t->cap + 1) * sizeof(Link);
    return PyLong_FromSize_t(bytes);
}

static PyObject *Table_widen(Table *t, PyObject *arg) {
    long words = PyLong_AsLong(arg);
    if (words == -1 && PyErr_Occurred())
        return NULL;
    if (words < t->words || words > MAX_WORDS) {
        PyErr_Format(PyExc_ValueError, "words must be in %d..%d", t->words, MAX_WORDS);
        return NULL;
    }
    if (words > t->words && rehash(t, t->cap, (int)words, NULL, NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Table_get(Table *t, PyObject *arg) {
    uint64_t key;
    if (as_u64(arg, &key) < 0)
        return NULL;
    size_t i = find(t, key);
    if (i == NONE)
        Py_RETURN_NONE;
    return value_to_int(t, slot_at(t, i));
}

static PyObject *Table_pop(Table *t, PyObject *arg) {
    uint64_t key;
    if (as_u64(arg, &key) < 0)
        return NULL;
    size_t i = find(t, key);
    if (i == NONE)
        Py_RETURN_NONE;
    PyObject *value = value_to_int(t, slot_at(t, i));
    if (value != NULL)
        delete_at(t, i);
    return value;
}

static PyObject *Table_set_many(Table *t, PyObject *args) {
    PyObject *keys_obj, *values_obj;
    if (!PyArg_ParseTuple(args, "OO:set_many", &keys_obj, &values_obj))
        return NULL;
    if (t->words != 1) {
        PyErr_SetString(PyExc_ValueError, "set_many needs a one-word table");
        return NULL;
    }
    U64s keys, values;
    if (u64s_read(keys_obj, &keys) < 0)
        return NULL;
    if (u64s_read(values_obj, &values) < 0) {
        u64s_free(&keys);
        return NULL;
    }
    PyObject *result = NULL;
    if (keys.n != values.n) {
        PyErr_SetString(PyExc_ValueError, "keys and values must have the same length");
    } else {
        result = Py_None;
        for (Py_ssize_t n = 0; n < keys.n; n++) {
            if (n + AHEAD < keys.n)
                prefetch_home(t, keys.values[n + AHEAD]);
            int created;
            size_t i = find_or_place(t, keys.values[n], &created);
            if (i == NONE) {
                result = NULL;
                break;
            }
            slot_at(t, i)[1] = values.values[n];
            if (t->ordered && !created)
                make_newest(t, i);
        }
        Py_XINCREF(result);
    }
    u64s_free(&keys);
    u64s_free(&values);
    return result;
}

/* The (keys, bit) arguments of a bulk bit operation: keys read into `keys`, bit resolved to its word and mask. */
static int keys_and_bit(Table *t, PyObject *args, const char *format, U64s *keys, size_t *word, uint64_t *mask) {
    PyObject *keys_obj;
    Py_ssize_t bit;
    if (!PyArg_ParseTuple(args, format, &keys_obj, &bit) || bit_arg(t, bit, word, mask) < 0)
        return -1;
    return u64s_read(keys_obj, keys);
}

static PyObject *Table_or_bit(Table *t, PyObject *args) {
    U64s keys;
    size_t word;
    uint64_t mask;
    if (keys_and_bit(t, args, "On:or_bit", &keys, &word, &mask) < 0)
        return NULL;
    /* Ordered: deepest block first, each made newest, so a chain's head ends up newest and is evicted last. */
    int failed = 0;
    for (Py_ssize_t m = 0; m < keys.n; m++) {
        Py_ssize_t n = t->ordered ? keys.n - 1 - m : m;
        if (m + AHEAD < keys.n)
            prefetch_home(t, keys.values[t->ordered ? keys.n - 1 - m - AHEAD : m + AHEAD]);
        int created;
        size_t i = find_or_place(t, keys.values[n], &created);
        if (i == NONE) {
            failed = 1;
            break;
        }
        slot_at(t, i)[word] |= mask;
        if (t->ordered && !created)
            make_newest(t, i);
    }
    u64s_free(&keys);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static int clear_bit_at(Table *t, size_t i, size_t word, uint64_t mask) {
    uint64_t *slot = slot_at(t, i);
    if (!(slot[word] & mask))
        return 0;
    slot[word] &= ~mask;
    if (!keep_nonzero(t, slot, NULL))
        delete_at(t, i);
    return 1;
}

static PyObject *Table_clear_bit(Table *t, PyObject *args) {
    U64s keys;
    size_t word;
    uint64_t mask;
    if (keys_and_bit(t, args, "On:clear_bit", &keys, &word, &mask) < 0)
        return NULL;
    Py_ssize_t cleared = 0;
    for (Py_ssize_t n = 0; n < keys.n; n++) {
        size_t i = find(t, keys.values[n]);
        if (i != NONE)
            cleared += clear_bit_at(t, i, word, mask);
    }
    u64s_free(&keys);
    if (maybe_shrink(t) < 0)
        return NULL;
    return PyLong_FromSsize_t(cleared);
}

static PyObject *Table_has_bit(Table *t, PyObject *args) {
    PyObject *key_obj;
    Py_ssize_t bit;
    if (!PyArg_ParseTuple(args, "On:has_bit", &key_obj, &bit))
        return NULL;
    size_t word;
    uint64_t mask, key;
    if (bit_arg(t, bit, &word, &mask) < 0 || as_u64(key_obj, &key) < 0)
        return NULL;
    size_t i = find(t, key);
    return PyBool_FromLong(i != NONE && (slot_at(t, i)[word] & mask));
}

static PyObject *Table_touch(Table *t, PyObject *keys_obj) {
    U64s keys;
    if (u64s_read(keys_obj, &keys) < 0)
        return NULL;
    if (t->ordered) {
        for (Py_ssize_t n = keys.n - 1; n >= 0; n--) {
            size_t i = find(t, keys.values[n]);
            if (i != NONE)
                make_newest(t, i);
        }
    }
    u64s_free(&keys);
    Py_RETURN_NONE;
}

static PyObject *Table_evict_oldest(Table *t, PyObject *arg) {
    Py_ssize_t count = PyLong_AsSsize_t(arg);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    if (!t->ordered) {
        PyErr_SetString(PyExc_ValueError, "only an ordered table knows its oldest entries");
        return NULL;
    }
    Py_ssize_t evicted = 0;
    while (evicted < count && t->head != NIL) {
        delete_at(t, t->head);
        evicted++;
    }
    if (maybe_shrink(t) < 0)
        return NULL;
    return PyLong_FromSsize_t(evicted);
}

static PyObject *Table_items(Table *t, PyObject *unused) {
    /* (key, value) pairs, oldest first when ordered: for tests and inspection, not the hot path. */
    PyObject *result = PyList_New(0);
    if (result == NULL)
        return NULL;
    size_t i = t->ordered ? t->head : 0;
    for (;;) {
        if (t->ordered) {
            if (i == NIL)
                break;
        } else if (i > t->cap) {
            break;
        }
        int occupied = i == t->cap ? t->zero_used : slot_at(t, i)[0] != 0;
        if (occupied) {
            PyObject *pair = Py_BuildValue(
                "(KN)", (unsigned long long)(i == t->cap ? 0 : slot_at(t, i)[0]), value_to_int(t, slot_at(t, i)));
            if (pair == NULL || PyList_Append(result, pair) < 0) {
                Py_XDECREF(pair);
                Py_DECREF(result);
                return NULL;
            }
            Py_DECREF(pair);
        }
        i = t->ordered ? t->links[i].next : i + 1;
    }
    return result;
}

typedef struct {
    PyObject *tables;
    size_t word;
    uint64_t mask;
} HeldBy;

static int value_is_held(const Table *t, const uint64_t *slot, void *ctx) {
    (void)t;
    const HeldBy *held = ctx;
    for (Py_ssize_t n = 0; n < PyTuple_GET_SIZE(held->tables); n++) {
        const Table *tier = (const Table *)PyTuple_GET_ITEM(held->tables, n);
        size_t i = find(tier, slot[1]);
        if (i != NONE && (slot_at(tier, i)[held->word] & held->mask))
            return 1;
    }
    return 0;
}

static PyObject *Table_retain_held(Table *t, PyObject *args) {
    /* An engine map's sweep: keep hash -> key where some table still gives the key `bit`. */
    PyObject *tables;
    Py_ssize_t bit;
    if (!PyArg_ParseTuple(args, "On:retain_held", &tables, &bit) || check_tables(tables, 0, "tables") < 0)
        return NULL;
    if (t->words != 1 || PyTuple_GET_SIZE(tables) == 0) {
        PyErr_SetString(PyExc_ValueError, "retain_held needs a one-word map and at least one table");
        return NULL;
    }
    HeldBy held = {tables, 0, 0};
    if (bit_arg((Table *)PyTuple_GET_ITEM(tables, 0), bit, &held.word, &held.mask) < 0)
        return NULL;
    size_t before = t->used;
    size_t kept = 0;
    for (size_t i = 0; i <= t->cap; i++) {
        int occupied = i == t->cap ? t->zero_used : slot_at(t, i)[0] != 0;
        if (occupied && value_is_held(t, slot_at(t, i), &held))
            kept++;
    }
    if (kept != before && rehash(t, cap_for(kept), 1, value_is_held, &held) < 0)
        return NULL;
    return PyLong_FromSize_t(before - t->used);
}

static PyMethodDef Table_methods[] = {
    {"widen", (PyCFunction)Table_widen, METH_O, "Grow each value to `words` words (more event sources)."},
    {"get", (PyCFunction)Table_get, METH_O, "The value stored under `key`, or None."},
    {"pop", (PyCFunction)Table_pop, METH_O, "Remove `key`; its value, or None."},
    {"set_many", (PyCFunction)Table_set_many, METH_VARARGS, "Store values[i] under keys[i] (one-word tables)."},
    {"or_bit", (PyCFunction)Table_or_bit, METH_VARARGS, "Set `bit` on every key (added if absent)."},
    {"clear_bit", (PyCFunction)Table_clear_bit, METH_VARARGS,
     "Clear `bit` on the keys, dropping emptied entries; how many had it."},
    {"has_bit", (PyCFunction)Table_has_bit, METH_VARARGS, "Whether `key` is stored with `bit` set."},
    {"touch", (PyCFunction)Table_touch, METH_O, "Make the stored keys newest, the first key last (ordered)."},
    {"evict_oldest", (PyCFunction)Table_evict_oldest, METH_O, "Drop up to `count` oldest entries; how many."},
    {"items", (PyCFunction)Table_items, METH_NOARGS, "[(key, value)], oldest first when ordered."},
    {"retain_held", (PyCFunction)Table_retain_held, METH_VARARGS,
     "Keep only the entries whose value has `bit` in some table; how many were dropped."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Table_getset[] = {
    {"words", (getter)Table_get_words, NULL, "Value width in 64-bit words.", NULL},
    {"ordered", (getter)Table_get_ordered, NULL, "Whether the table keeps a recency order.", NULL},
    {"nbytes", (getter)Table_get_nbytes, NULL, "Bytes this table holds.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Table_as_sequence = {
    .sq_length = (lenfunc)Table_len,
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvrouter._blocktable.BlockTable",
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "BlockTable(words=1, ordered=False): uint64 key -> `words` uint64 words.",
    .tp_new = Table_new,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
    .tp_getset = Table_getset,
    .tp_as_sequence = &Table_as_sequence,
};

/* ---- whole-index operations ------------------------------------------------------------------------------ */

static int record_drops(PyObject *lengths, const uint64_t *before, const uint64_t *after, int words, Py_ssize_t at) {
    for (int w = 0; w < words; w++) {
        uint64_t dropped = before[w] & ~after[w];
        while (dropped) {
            int low = __builtin_ctzll(dropped);
            dropped &= dropped - 1;
            PyObject *bit = PyLong_FromLong(w * 64 + low);
            PyObject *length = PyLong_FromSsize_t(at);
            int failed = bit == NULL || length == NULL || PyDict_SetItem(lengths, bit, length) < 0;
            Py_XDECREF(bit);
            Py_XDECREF(length);
            if (failed)
                return -1;
        }
    }
    return 0;
}

static inline int prefetch_key(const Table *t, PyObject *item, uint64_t *key) {
    if (as_u64(item, key) < 0)
        return -1;
    prefetch_home(t, *key);
    return 0;
}

static PyObject *prefix_lengths(PyObject *module, PyObject *args) {
    /* One pass over the request's keys: for each source bit, how many leading keys it holds in the GPU table
     * (`gpu`) and in any table (`gpu` or one of `lower`). Stops at the first key no source holds any more. */
    PyObject *keys_obj, *gpu_obj, *lower;
    if (!PyArg_ParseTuple(args, "OO!O:prefix_lengths", &keys_obj, &TableType, &gpu_obj, &lower))
        return NULL;
    const Table *gpu = (const Table *)gpu_obj;
    if (check_tables(lower, gpu->words, "lower") < 0)
        return NULL;
    PyObject *fast = PySequence_Fast(keys_obj, "expected a sequence of ints");
    if (fast == NULL)
        return NULL;
    PyObject *any_lengths = PyDict_New();
    PyObject *gpu_lengths = PyDict_New();
    PyObject *result = NULL;
    if (any_lengths == NULL || gpu_lengths == NULL)
        goto done;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    const int words = gpu->words;
    const Py_ssize_t lowers = PyTuple_GET_SIZE(lower);
    uint64_t alive_any[MAX_WORDS], alive_gpu[MAX_WORDS], m_any[MAX_WORDS], m_gpu[MAX_WORDS];
    Py_ssize_t pos = 0;
    if (words == 1) {
        /* Up to 64 sources (the common fleet): plain words, no per-key copies. Keys are read AHEAD positions early
         * and their home slots prefetched, so a table bigger than the caches costs overlapped misses, not one
         * memory round trip per block. */
        uint64_t ring[AHEAD];
        for (Py_ssize_t p = 0; p < n && p < AHEAD; p++)
            if (prefetch_key(gpu, items[p], &ring[p]) < 0)
                goto done;
        for (; pos < n; pos++) {
            uint64_t key = ring[pos % AHEAD];
            if (pos + AHEAD < n && prefetch_key(gpu, items[pos + AHEAD], &ring[pos % AHEAD]) < 0)
                goto done;
            size_t i = find(gpu, key);
            uint64_t on_gpu = i == NONE ? 0 : gpu->slots[2 * i + 1];
            uint64_t anywhere = on_gpu;
            for (Py_ssize_t l = 0; l < lowers; l++) {
                const Table *tier = (const Table *)PyTuple_GET_ITEM(lower, l);
                size_t j = find(tier, key);
                if (j != NONE)
                    anywhere |= tier->slots[2 * j + 1];
            }
            if (pos == 0) {
                alive_any[0] = anywhere;
                alive_gpu[0] = on_gpu;
            } else if ((alive_any[0] & ~anywhere) | (alive_gpu[0] & ~on_gpu)) {
                m_any[0] = alive_any[0] & anywhere;
                m_gpu[0] = alive_gpu[0] & on_gpu;
                if (record_drops(any_lengths, alive_any, m_any, 1, pos) < 0 ||
                    record_drops(gpu_lengths, alive_gpu, m_gpu, 1, pos) < 0)
                    goto done;
                alive_any[0] = m_any[0];
                alive_gpu[0] = m_gpu[0];
            }
            if (!alive_any[0])
                break;
        }
    }
    for (; words > 1 && pos < n; pos++) {
        uint64_t key;
        if (as_u64(items[pos], &key) < 0)
            goto done;
        size_t i = find(gpu, key);
        if (i == NONE)
            memset(m_gpu, 0, (size_t)words * sizeof(uint64_t));
        else
            memcpy(m_gpu, slot_at(gpu, i) + 1, (size_t)words * sizeof(uint64_t));
        memcpy(m_any, m_gpu, (size_t)words * sizeof(uint64_t));
        for (Py_ssize_t l = 0; l < lowers; l++) {
            const Table *tier = (const Table *)PyTuple_GET_ITEM(lower, l);
            size_t j = find(tier, key);
            if (j != NONE)
                for (int w = 0; w < words; w++)
                    m_any[w] |= slot_at(tier, j)[1 + w];
        }
        uint64_t left = 0;
        if (pos == 0) {
            memcpy(alive_any, m_any, (size_t)words * sizeof(uint64_t));
            memcpy(alive_gpu, m_gpu, (size_t)words * sizeof(uint64_t));
            for (int w = 0; w < words; w++)
                left |= alive_any[w];
        } else {
            int changed = 0;
            for (int w = 0; w < words; w++) {
                m_any[w] &= alive_any[w];
                m_gpu[w] &= alive_gpu[w];
                changed |= m_any[w] != alive_any[w] || m_gpu[w] != alive_gpu[w];
                left |= m_any[w];
            }
            if (changed) {
                if (record_drops(any_lengths, alive_any, m_any, words, pos) < 0 ||
                    record_drops(gpu_lengths, alive_gpu, m_gpu, words, pos) < 0)
                    goto done;
                memcpy(alive_any, m_any, (size_t)words * sizeof(uint64_t));
                memcpy(alive_gpu, m_gpu, (size_t)words * sizeof(uint64_t));
            }
        }
        if (!left)
            break;
    }
    if (pos == n && n > 0) {
        uint64_t none[MAX_WORDS] = {0};
        if (record_drops(any_lengths, alive_any, none, words, n) < 0 ||
            record_drops(gpu_lengths, alive_gpu, none, words, n) < 0)
            goto done;
    }
    result = PyTuple_Pack(2, any_lengths, gpu_lengths);
done:
    Py_XDECREF(any_lengths);
    Py_XDECREF(gpu_lengths);
    Py_DECREF(fast);
    return result;
}

static void add_counts(Py_ssize_t *counts, const uint64_t *mask, int words) {
    for (int w = 0; w < words; w++) {
        uint64_t bits = mask[w];
        while (bits) {
            counts[w * 64 + __builtin_ctzll(bits)]++;
            bits &= bits - 1;
        }
    }
}

/* The bits `tables[0..upto)` hold for `key`, OR-ed. */
static void held_before(PyObject *tables, Py_ssize_t upto, uint64_t key, uint64_t *out, int words) {
    memset(out, 0, (size_t)words * sizeof(uint64_t));
    for (Py_ssize_t n = 0; n < upto; n++) {
        const Table *t = (const Table *)PyTuple_GET_ITEM(tables, n);
        size_t i = find(t, key);
        if (i != NONE)
            for (int w = 0; w < words; w++)
                out[w] |= slot_at(t, i)[1 + w];
    }
}

static PyObject *held_counts(PyObject *module, PyObject *args) {
    /* Per source bit, the distinct keys holding it in any of `tables` (a key in two tiers counts once); and the
     * distinct keys holding any bit outside `excluded` (a bit list). Returns (counts dict, keys). */
    PyObject *tables, *excluded_obj;
    if (!PyArg_ParseTuple(args, "O!O:held_counts", &PyTuple_Type, &tables, &excluded_obj))
        return NULL;
    if (PyTuple_GET_SIZE(tables) == 0)
        return Py_BuildValue("(Nn)", PyDict_New(), (Py_ssize_t)0);
    const Table *first = (const Table *)PyTuple_GET_ITEM(tables, 0);
    if (check_tables(tables, first->words, "tables") < 0)
        return NULL;
    const int words = first->words;
    uint64_t excluded[MAX_WORDS] = {0};
    U64s bits;
    if (u64s_read(excluded_obj, &bits) < 0)
        return NULL;
    for (Py_ssize_t n = 0; n < bits.n; n++) {
        if (bits.values[n] >= (uint64_t)words * 64) {
            u64s_free(&bits);
            PyErr_SetString(PyExc_ValueError, "excluded bit outside the tables' width");
            return NULL;
        }
        excluded[bits.values[n] / 64] |= (uint64_t)1 << (bits.values[n] % 64);
    }
    u64s_free(&bits);
    Py_ssize_t *counts = PyMem_Calloc((size_t)words * 64, sizeof(Py_ssize_t));
    if (counts == NULL)
        return PyErr_NoMemory();
    Py_ssize_t distinct = 0;
    uint64_t earlier[MAX_WORDS], fresh[MAX_WORDS];
    for (Py_ssize_t n = 0; n < PyTuple_GET_SIZE(tables); n++) {
        const Table *t = (const Table *)PyTuple_GET_ITEM(tables, n);
        for (size_t i = 0; i <= t->cap; i++) {
            const uint64_t *slot = slot_at(t, i);
            if (i == t->cap ? !t->zero_used : slot[0] == 0)
                continue;
            uint64_t key = i == t->cap ? 0 : slot[0];
            held_before(tables, n, key, earlier, words);
            int counted_before = 0, counts_now = 0;
            for (int w = 0; w < words; w++) {
                fresh[w] = slot[1 + w] & ~earlier[w];
                counted_before |= (earlier[w] & ~excluded[w]) != 0;
                counts_now |= (slot[1 + w] & ~excluded[w]) != 0;
            }
            add_counts(counts, fresh, words);
            if (counts_now && !counted_before)
                distinct++;
        }
    }
    PyObject *result = PyDict_New();
    for (int b = 0; result != NULL && b < words * 64; b++) {
        if (!counts[b])
            continue;
        PyObject *bit = PyLong_FromLong(b);
        PyObject *count = PyLong_FromSsize_t(counts[b]);
        if (bit == NULL || count == NULL || PyDict_SetItem(result, bit, count) < 0)
            Py_CLEAR(result);
        Py_XDECREF(bit);
        Py_XDECREF(count);
    }
    PyMem_Free(counts);
    if (result == NULL)
        return NULL;
    return Py_BuildValue("(Nn)", result, distinct);
}

static PyObject *remove_blocks(PyObject *module, PyObject *args) {
    /* A BlockRemoved for one source (`bit`): map each engine hash back to its key through `engine_map`, clear the
     * bit in `tier`, and forget the mapping once no table in `tables` gives the key that bit. Returns how many
     * hashes the map did not know. */
    PyObject *map_obj, *hashes_obj, *tier_obj, *tables;
    Py_ssize_t bit;
    if (!PyArg_ParseTuple(args, "O!OO!O!n:remove_blocks", &TableType, &map_obj, &hashes_obj, &TableType, &tier_obj,
                          &PyTuple_Type, &tables, &bit))
        return NULL;
    Table *map = (Table *)map_obj;
    Table *tier = (Table *)tier_obj;
    if (check_tables(tables, tier->words, "tables") < 0)
        return NULL;
    if (map->words != 1) {
        PyErr_SetString(PyExc_ValueError, "the engine map must be a one-word table");
        return NULL;
    }
    size_t word;
    uint64_t mask;
    if (bit_arg(tier, bit, &word, &mask) < 0)
        return NULL;
    U64s hashes;
    if (u64s_read(hashes_obj, &hashes) < 0)
        return NULL;
    Py_ssize_t unknown = 0;
    HeldBy held = {tables, word, mask};
    for (Py_ssize_t n = 0; n < hashes.n; n++) {
        if (n + AHEAD < hashes.n)
            prefetch_home(map, hashes.values[n + AHEAD]);
        size_t m = find(map, hashes.values[n]);
        if (m == NONE) {
            unknown++;
            continue;
        }
        uint64_t key = slot_at(map, m)[1];
        size_t i = find(tier, key);
        if (i != NONE)
            clear_bit_at(tier, i, word, mask);
        if (!value_is_held(map, slot_at(map, m), &held))
            delete_at(map, m);
    }
    u64s_free(&hashes);
    if (maybe_shrink(tier) < 0 || maybe_shrink(map) < 0)
        return NULL;
    return PyLong_FromSsize_t(unknown);
}

static PyObject *clear_source(PyObject *module, PyObject *args) {
    /* A source's blocks gone (engine restart, replica removed): clear `bit` on the keys its engine map names, in
     * every table; the cost is the source's own blocks, not the index's. Returns how many (table, key) had it. */
    PyObject *map_obj, *tables;
    Py_ssize_t bit;
    if (!PyArg_ParseTuple(args, "O!O!n:clear_source", &TableType, &map_obj, &PyTuple_Type, &tables, &bit))
        return NULL;
    const Table *map = (const Table *)map_obj;
    if (PyTuple_GET_SIZE(tables) == 0 || map->words != 1) {
        PyErr_SetString(PyExc_ValueError, "clear_source needs a one-word map and at least one table");
        return NULL;
    }
    Table *first = (Table *)PyTuple_GET_ITEM(tables, 0);
    if (check_tables(tables, first->words, "tables") < 0)
        return NULL;
    size_t word;
    uint64_t mask;
    if (bit_arg(first, bit, &word, &mask) < 0)
        return NULL;
    Py_ssize_t cleared = 0;
    for (Py_ssize_t n = 0; n < PyTuple_GET_SIZE(tables); n++) {
        Table *t = (Table *)PyTuple_GET_ITEM(tables, n);
        if (t->used == 0)
            continue;
        for (size_t m = 0; m <= map->cap; m++) {
            const uint64_t *entry = slot_at(map, m);
            if (m == map->cap ? !map->zero_used : entry[0] == 0)
                continue;
            size_t i = find(t, entry[1]);
            if (i != NONE)
                cleared += clear_bit_at(t, i, word, mask);
        }
        if (maybe_shrink(t) < 0)
            return NULL;
    }
    return PyLong_FromSsize_t(cleared);
}

static PyObject *expire_marks(PyObject *module, PyObject *args) {
    /* Provisional marks due at `now` (both as order codes, see index.py): each of `keys` whose mark in `marks`
     * is at most `now` loses the mark and `bit` in `gpu`; a key marked again since (a later code) keeps both.
     * Returns how many marks were dropped. One call per expired request: the per-key loop stays in C. */
    PyObject *marks_obj, *keys_obj, *gpu_obj;
    unsigned long long now;
    Py_ssize_t bit;
    if (!PyArg_ParseTuple(args, "O!OKO!n:expire_marks", &TableType, &marks_obj, &keys_obj, &now, &TableType,
                          &gpu_obj, &bit))
        return NULL;
    Table *marks = (Table *)marks_obj;
    Table *gpu = (Table *)gpu_obj;
    if (marks->words != 1) {
        PyErr_SetString(PyExc_ValueError, "the marks must be a one-word table");
        return NULL;
    }
    size_t word;
    uint64_t mask;
    if (bit_arg(gpu, bit, &word, &mask) < 0)
        return NULL;
    U64s keys;
    if (u64s_read(keys_obj, &keys) < 0)
        return NULL;
    Py_ssize_t dropped = 0;
    for (Py_ssize_t n = 0; n < keys.n; n++) {
        if (n + AHEAD < keys.n)
            prefetch_home(marks, keys.values[n + AHEAD]);
        size_t m = find(marks, keys.values[n]);
        if (m == NONE || slot_at(marks, m)[1] > (uint64_t)now)
            continue;
        delete_at(marks, m);
        dropped++;
        size_t i = find(gpu, keys.values[n]);
        if (i != NONE)
            clear_bit_at(gpu, i, word, mask);
    }
    u64s_free(&keys);
    if (maybe_shrink(marks) < 0 || maybe_shrink(gpu) < 0)
        return NULL;
    return PyLong_FromSsize_t(dropped);
}

static PyMethodDef module_methods[] = {
    {"expire_marks", expire_marks, METH_VARARGS,
     "expire_marks(marks, keys, now, gpu, bit) -> marks dropped (those at most `now`, with their bit in gpu)"},
    {"clear_source", clear_source, METH_VARARGS,
     "clear_source(engine_map, tables, bit) -> (table, key) entries that had the bit"},
    {"prefix_lengths", prefix_lengths, METH_VARARGS,
     "prefix_lengths(keys, gpu, lower) -> ({bit: blocks in any tier}, {bit: blocks in gpu})"},
    {"held_counts", held_counts, METH_VARARGS,
     "held_counts(tables, excluded_bits) -> ({bit: distinct keys}, distinct keys outside excluded_bits)"},
    {"remove_blocks", remove_blocks, METH_VARARGS,
     "remove_blocks(engine_map, hashes, tier, tables, bit) -> hashes the map did not know"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvrouter._blocktable",
    .m_doc = "Open-addressing uint64 tables for the prefix index.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__blocktable(void) {
    if (PyType_Ready(&TableType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(module, "BlockTable", (PyObject *)&TableType) < 0) {
        Py_DECREF(&TableType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
