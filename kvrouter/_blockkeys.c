/* Chained block keys in C: `kvrouter.blocks.chain_keys` without a Python-level step per block.
 *
 * Block i's key is XXH3-64 (seeded) over the previous key's 8 little-endian bytes (or, for a chain's first
 * block, the root material: empty, or the LoRA adapter and cache salt) followed by the block's token ids as
 * little-endian uint32 words. XXH3-64 is implemented here from the published xxHash specification
 * (doc/xxhash_spec.md in the xxHash repository), all input sizes and seeds, and is tested bit for bit against the
 * `xxhash` package, which stays the Python path's hash: keys must not depend on which path computed them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef uint64_t u64;
typedef uint32_t u32;

static const u64 PRIME32_1 = 0x9E3779B1U;
static const u64 PRIME32_2 = 0x85EBCA77U;
static const u64 PRIME32_3 = 0xC2B2AE3DU;
static const u64 PRIME64_1 = 0x9E3779B185EBCA87ULL;
static const u64 PRIME64_2 = 0xC2B2AE3D27D4EB4FULL;
static const u64 PRIME64_3 = 0x165667B19E3779F9ULL;
static const u64 PRIME64_4 = 0x85EBCA77C2B2AE63ULL;
static const u64 PRIME64_5 = 0x27D4EB2F165667C5ULL;
static const u64 PRIME_MX1 = 0x165667919E3779F9ULL;
static const u64 PRIME_MX2 = 0x9FB21C651E98DF25ULL;

#define SECRET_SIZE 192
static const unsigned char DEFAULT_SECRET[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline u64 read64(const unsigned char *p) {
    u64 v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline u32 read32(const unsigned char *p) {
    u32 v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline void write64(unsigned char *p, u64 v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

static inline u64 rotl64(u64 x, int r) { return (x << r) | (x >> (64 - r)); }

static inline u64 fold_mul(u64 a, u64 b) {
    unsigned __int128 product = (unsigned __int128)a * b;
    return (u64)product ^ (u64)(product >> 64);
}

static inline u64 avalanche(u64 x) {
    x ^= x >> 37;
    x *= PRIME_MX1;
    return x ^ (x >> 32);
}

static inline u64 avalanche_xxh64(u64 x) {
    x ^= x >> 33;
    x *= PRIME64_2;
    x ^= x >> 29;
    x *= PRIME64_3;
    return x ^ (x >> 32);
}

static inline u64 mix_step(const unsigned char *data, const unsigned char *secret, u64 seed) {
    return fold_mul(read64(data) ^ (read64(secret) + seed), read64(data + 8) ^ (read64(secret + 8) - seed));
}

static u64 hash_small(const unsigned char *in, size_t len, u64 seed) {
    const unsigned char *s = DEFAULT_SECRET;
    if (len == 0)
        return avalanche_xxh64(seed ^ read64(s + 56) ^ read64(s + 64));
    if (len <= 3) {
        u32 combined = (u32)in[len - 1] | ((u32)len << 8) | ((u32)in[0] << 16) | ((u32)in[len >> 1] << 24);
        return avalanche_xxh64(((u64)(read32(s) ^ read32(s + 4)) + seed) ^ (u64)combined);
    }
    if (len <= 8) {
        u64 modified = seed ^ ((u64)__builtin_bswap32((u32)seed) << 32);
        u64 combined = (u64)read32(in + len - 4) | ((u64)read32(in) << 32);
        u64 value = ((read64(s + 8) ^ read64(s + 16)) - modified) ^ combined;
        value ^= rotl64(value, 49) ^ rotl64(value, 24);
        value *= PRIME_MX2;
        value ^= (value >> 35) + len;
        value *= PRIME_MX2;
        return value ^ (value >> 28);
    }
    u64 low = ((read64(s + 24) ^ read64(s + 32)) + seed) ^ read64(in);
    u64 high = ((read64(s + 40) ^ read64(s + 48)) - seed) ^ read64(in + len - 8);
    return avalanche(len + __builtin_bswap64(low) + high + fold_mul(low, high));
}

static u64 hash_medium(const unsigned char *in, size_t len, u64 seed) {
    const unsigned char *s = DEFAULT_SECRET;
    u64 acc = len * PRIME64_1;
    if (len <= 128) {
        size_t rounds = ((len - 1) >> 5) + 1;
        for (size_t i = 0; i < rounds; i++) {
            acc += mix_step(in + i * 16, s + i * 32, seed);
            acc += mix_step(in + len - i * 16 - 16, s + i * 32 + 16, seed);
        }
        return avalanche(acc);
    }
    size_t chunks = len >> 4;
    for (size_t i = 0; i < 8; i++)
        acc += mix_step(in + i * 16, s + i * 16, seed);
    acc = avalanche(acc);
    for (size_t i = 8; i < chunks; i++)
        acc += mix_step(in + i * 16, s + (i - 8) * 16 + 3, seed);
    acc += mix_step(in + len - 16, s + 119, seed);
    return avalanche(acc);
}

static void accumulate(u64 acc[8], const unsigned char *stripe, const unsigned char *secret) {
    for (int i = 0; i < 8; i++) {
        u64 data = read64(stripe + 8 * i);
        u64 value = data ^ read64(secret + 8 * i);
        acc[i ^ 1] += data;
        acc[i] += (value & 0xFFFFFFFFULL) * (value >> 32);
    }
}

static u64 hash_large(const unsigned char *in, size_t len, u64 seed) {
    unsigned char derived[SECRET_SIZE];
    const unsigned char *s = DEFAULT_SECRET;
    if (seed != 0) {
        for (int i = 0; i < SECRET_SIZE / 16; i++) {
            write64(derived + 16 * i, read64(DEFAULT_SECRET + 16 * i) + seed);
            write64(derived + 16 * i + 8, read64(DEFAULT_SECRET + 16 * i + 8) - seed);
        }
        s = derived;
    }
    u64 acc[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
    const size_t stripes_per_block = (SECRET_SIZE - 64) / 8;
    const size_t block = 64 * stripes_per_block;
    size_t offset = 0;
    while (len - offset > block) {
        for (size_t n = 0; n < stripes_per_block; n++)
            accumulate(acc, in + offset + n * 64, s + n * 8);
        for (int i = 0; i < 8; i++) {
            acc[i] ^= acc[i] >> 47;
            acc[i] ^= read64(s + SECRET_SIZE - 64 + 8 * i);
            acc[i] *= PRIME32_1;
        }
        offset += block;
    }
    size_t last = len - offset;
    for (size_t n = 0; n < (last - 1) / 64; n++)
        accumulate(acc, in + offset + n * 64, s + n * 8);
    accumulate(acc, in + len - 64, s + SECRET_SIZE - 71);
    u64 result = len * PRIME64_1;
    for (int i = 0; i < 4; i++)
        result += fold_mul(acc[2 * i] ^ read64(s + 11 + 16 * i), acc[2 * i + 1] ^ read64(s + 11 + 16 * i + 8));
    return avalanche(result);
}

static u64 xxh3_64(const unsigned char *in, size_t len, u64 seed) {
    if (len <= 16)
        return hash_small(in, len, seed);
    if (len <= 240)
        return hash_medium(in, len, seed);
    return hash_large(in, len, seed);
}

/* ---- Python functions ------------------------------------------------------------------------------------ */

static PyObject *py_xxh3_64(PyObject *module, PyObject *args) {
    Py_buffer data;
    unsigned long long seed = 0;
    if (!PyArg_ParseTuple(args, "y*|K:xxh3_64", &data, &seed))
        return NULL;
    u64 h = xxh3_64(data.buf, (size_t)data.len, seed);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(h);
}

static int token_word(PyObject *item, u32 *out) {
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "token ids must be ints, not %.100s", Py_TYPE(item)->tp_name);
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_OverflowError, "token ids must lie in [0, 2**32)");
        return -1;
    }
    *out = (u32)v;
    return 0;
}

static PyObject *py_chain_keys(PyObject *module, PyObject *args) {
    /* chain_keys(token_ids, block_size, seed, root) -> keys of every full block; `root` is what the first block
     * chains from (the parent key's 8 little-endian bytes, or the root material). */
    PyObject *tokens_obj;
    Py_ssize_t block_size;
    unsigned long long seed;
    Py_buffer root;
    if (!PyArg_ParseTuple(args, "OnKy*:chain_keys", &tokens_obj, &block_size, &seed, &root))
        return NULL;
    PyObject *result = NULL;
    unsigned char *buffer = NULL;
    PyObject *fast = PySequence_Fast(tokens_obj, "token ids must be a sequence");
    if (fast == NULL)
        goto done;
    if (block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        goto done;
    }
    Py_ssize_t blocks = PySequence_Fast_GET_SIZE(fast) / block_size;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    size_t words = (size_t)block_size * 4;
    size_t head = (size_t)root.len > 8 ? (size_t)root.len : 8;
    buffer = PyMem_Malloc(head + words);
    result = PyList_New(blocks);
    if (buffer == NULL || result == NULL) {
        if (buffer == NULL)
            PyErr_NoMemory();
        Py_CLEAR(result);
        goto done;
    }
    size_t prefix = (size_t)root.len;
    memcpy(buffer, root.buf, prefix);
    for (Py_ssize_t b = 0; b < blocks; b++) {
        unsigned char *out = buffer + prefix;
        for (Py_ssize_t t = 0; t < block_size; t++) {
            u32 word;
            if (token_word(items[b * block_size + t], &word) < 0) {
                Py_CLEAR(result);
                goto done;
            }
            word = (u32)read32((const unsigned char *)&word); /* little-endian on any host */
            memcpy(out + 4 * t, &word, 4);
        }
        u64 key = xxh3_64(buffer, prefix + words, seed);
        PyObject *value = PyLong_FromUnsignedLongLong(key);
        if (value == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, b, value);
        write64(buffer, key);
        prefix = 8;
    }
done:
    PyMem_Free(buffer);
    Py_XDECREF(fast);
    PyBuffer_Release(&root);
    return result;
}

static PyMethodDef module_methods[] = {
    {"xxh3_64", py_xxh3_64, METH_VARARGS, "xxh3_64(data, seed=0) -> XXH3-64 of data (as the xxhash package)."},
    {"chain_keys", py_chain_keys, METH_VARARGS,
     "chain_keys(token_ids, block_size, seed, root) -> chained keys of every full block."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvrouter._blockkeys",
    .m_doc = "Chained XXH3-64 block keys.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__blockkeys(void) { return PyModule_Create(&module_def); }
