/* Chained block keys in C: `kvrouter.blocks.chain_keys` without a Python-level step per block.
 *
 * Block i's key is XXH3-64 (seeded) over the previous key's 8 little-endian bytes (or, for a chain's first
 * block, the root material: empty, or the LoRA adapter and cache salt) followed by the block's token ids as
 * little-endian uint32 words. XXH3-64 is the official implementation (xxHash's single header, vendored unchanged
 * in kvrouter/_vendor/xxhash with its BSD licence, inlined here), the same code the `xxhash` package that the
 * Python path uses is built from; tests/test_blockkeys.py checks the two paths bit for bit.
 *
 * Also here, as the other hot loop over a request's prompt: `common_prefix`, the length of two strings' common
 * prefix, for the tokenizer's render cache (kvrouter/tokenization.py; its pure twin bisects with slices).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "_vendor/xxhash/xxhash.h"

typedef uint64_t u64;
typedef uint32_t u32;

static inline u32 to_le32(u32 v) {
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

static inline u64 xxh3_64(const unsigned char *in, size_t len, u64 seed) {
    return (u64)XXH3_64bits_withSeed(in, len, (XXH64_hash_t)seed);
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
    PyObject *fast = NULL;
    Py_buffer words_view;
    int have_words = 0;
    const u32 *word_items = NULL;
    PyObject **items = NULL;
    Py_ssize_t count = 0;
    if (block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        goto done;
    }
    /* 4-byte unsigned ints in a buffer (array('I'), the tokenizer's cached renders): read in place, no int
     * objects. Anything else is a sequence of ints. */
    if (!PyList_Check(tokens_obj) && !PyTuple_Check(tokens_obj) && PyObject_CheckBuffer(tokens_obj)) {
        if (PyObject_GetBuffer(tokens_obj, &words_view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        have_words = 1;
        if (words_view.itemsize != 4 || words_view.format == NULL || strcmp(words_view.format, "I") != 0) {
            PyErr_SetString(PyExc_TypeError, "a token-id buffer must hold 4-byte unsigned ints (array('I'))");
            goto done;
        }
        word_items = (const u32 *)words_view.buf;
        count = words_view.len / 4;
    } else {
        fast = PySequence_Fast(tokens_obj, "token ids must be a sequence");
        if (fast == NULL)
            goto done;
        items = PySequence_Fast_ITEMS(fast);
        count = PySequence_Fast_GET_SIZE(fast);
    }
    Py_ssize_t blocks = count / block_size;
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
            if (word_items != NULL) {
                word = word_items[b * block_size + t];
            } else if (token_word(items[b * block_size + t], &word) < 0) {
                Py_CLEAR(result);
                goto done;
            }
            word = to_le32(word); /* little-endian on any host */
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
    if (have_words)
        PyBuffer_Release(&words_view);
    PyBuffer_Release(&root);
    return result;
}

static PyObject *py_common_prefix(PyObject *module, PyObject *args) {
    /* common_prefix(a, b) -> length of the longest common prefix of two str: memcmp over equal-width storage
     * (whole 256-byte runs first), then code point by code point. */
    PyObject *a, *b;
    if (!PyArg_ParseTuple(args, "UU:common_prefix", &a, &b))
        return NULL;
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(a) < 0 || PyUnicode_READY(b) < 0)
        return NULL;
#endif
    Py_ssize_t la = PyUnicode_GET_LENGTH(a), lb = PyUnicode_GET_LENGTH(b);
    Py_ssize_t n = la < lb ? la : lb;
    int ka = PyUnicode_KIND(a), kb = PyUnicode_KIND(b);
    const void *da = PyUnicode_DATA(a), *db = PyUnicode_DATA(b);
    Py_ssize_t i = 0;
    if (ka == kb) {
        const unsigned char *pa = da, *pb = db;
        size_t bytes = (size_t)n * (size_t)ka, offset = 0;
        while (offset + 256 <= bytes && memcmp(pa + offset, pb + offset, 256) == 0)
            offset += 256;
        i = (Py_ssize_t)(offset / (size_t)ka);
    }
    while (i < n && PyUnicode_READ(ka, da, i) == PyUnicode_READ(kb, db, i))
        i++;
    return PyLong_FromSsize_t(i);
}

static PyMethodDef module_methods[] = {
    {"common_prefix", py_common_prefix, METH_VARARGS, "common_prefix(a, b) -> length of the common prefix."},
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
