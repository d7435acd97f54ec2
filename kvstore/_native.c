/* kvstore._native: the index's per-key loops in C (issue 20).
 *
 * An 8k-key placement walks its keys several times: turning packed keys into
 * hex strings, checking JSON keys, and looking each up in the index's cache
 * of joined groups. Each pass costs 0.2-1 ms in CPython; here each is a loop
 * of dict lookups and memory copies. kvstore/native.py holds the same
 * functions in Python (the reference, and what runs where this did not
 * build); tests run both and compare them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

static const char HEX[] = "0123456789abcdef";

/* hex_keys(octets) -> list[str]: the lowercase hex of each 32 octets. */
static PyObject *
hex_keys(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len % 32) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "hex_keys: not a whole number of 32-octet keys");
        return NULL;
    }
    Py_ssize_t n = view.len / 32;
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const unsigned char *p = view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyUnicode_New(64, 127);
        if (s == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&view);
            return NULL;
        }
        Py_UCS1 *d = PyUnicode_1BYTE_DATA(s);
        for (int j = 0; j < 32; j++) {
            d[2 * j] = HEX[p[j] >> 4];
            d[2 * j + 1] = HEX[p[j] & 15];
        }
        p += 32;
        PyList_SET_ITEM(out, i, s);
    }
    PyBuffer_Release(&view);
    return out;
}

static signed char HEXVAL[256]; /* a digit's value, -1 for other octets */

#ifdef __SSE2__
#include <emmintrin.h>

/* The digit and letter masks of 16 characters: octets '0'-'9', and 'a'-'f'.
 * Signed compares: octets from 0x80 up are negative and fail both. */
static inline void
hex_masks(__m128i v, __m128i *digit, __m128i *letter)
{
    *digit = _mm_and_si128(_mm_cmpgt_epi8(v, _mm_set1_epi8('0' - 1)),
                           _mm_cmplt_epi8(v, _mm_set1_epi8('9' + 1)));
    *letter = _mm_and_si128(_mm_cmpgt_epi8(v, _mm_set1_epi8('a' - 1)),
                            _mm_cmplt_epi8(v, _mm_set1_epi8('f' + 1)));
}

/* Whether the 16 characters at ``c`` are all lowercase hex digits. */
static inline int
is_hex16(const Py_UCS1 *c)
{
    __m128i digit, letter;
    hex_masks(_mm_loadu_si128((const __m128i *)c), &digit, &letter);
    return _mm_movemask_epi8(_mm_or_si128(digit, letter)) == 0xFFFF;
}

/* 16 lowercase hex digits at ``c`` into 8 octets at ``out``; 0 if any is not
 * one. SSE2 (every x86-64): the 64 digits of a key in four steps, where a
 * table lookup per digit made parsing cost more than the hashing it saves. */
static inline int
parse16(const Py_UCS1 *c, unsigned char *out)
{
    __m128i v = _mm_loadu_si128((const __m128i *)c), digit, letter;
    hex_masks(v, &digit, &letter);
    if (_mm_movemask_epi8(_mm_or_si128(digit, letter)) != 0xFFFF)
        return 0;
    __m128i nibble = _mm_sub_epi8(v, _mm_or_si128(_mm_and_si128(digit, _mm_set1_epi8('0')),
                                                  _mm_and_si128(letter, _mm_set1_epi8('a' - 10))));
    /* 16-bit lanes (first digit low): (first << 4) | second, then packed. */
    __m128i pairs = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(nibble, _mm_set1_epi16(0xFF)), 4),
                                 _mm_srli_epi16(nibble, 8));
    _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(pairs, pairs));
    return 1;
}
#else
static inline int
parse16(const Py_UCS1 *c, unsigned char *out)
{
    int bad = 0;
    for (int j = 0; j < 8; j++) {
        int hi = HEXVAL[c[2 * j]], lo = HEXVAL[c[2 * j + 1]];
        bad |= hi | lo;
        out[j] = (unsigned char)(((unsigned)hi & 15) << 4 | ((unsigned)lo & 15));
    }
    return bad >= 0;
}

static inline int
is_hex16(const Py_UCS1 *c)
{
    unsigned char ignored[8];
    return parse16(c, ignored);
}
#endif

/* all_hex32(values) -> bool: a non-empty list or tuple of str, each 64
 * lowercase hex digits. */
static PyObject *
all_hex32(PyObject *self, PyObject *arg)
{
    if (!PyList_Check(arg) && !PyTuple_Check(arg))
        Py_RETURN_FALSE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(arg);
    if (n == 0)
        Py_RETURN_FALSE;
    PyObject **items = PySequence_Fast_ITEMS(arg);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = items[i];
        if (!PyUnicode_CheckExact(s) || PyUnicode_GET_LENGTH(s) != 64 ||
            PyUnicode_KIND(s) != PyUnicode_1BYTE_KIND)
            Py_RETURN_FALSE;
        const Py_UCS1 *c = PyUnicode_1BYTE_DATA(s);
        if (!(is_hex16(c) && is_hex16(c + 16) && is_hex16(c + 32) && is_hex16(c + 48)))
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* ---- KeyTable: the index's cache of joined groups, keyed by raw keys ----
 *
 * A mapping from Block Keys to groups, keyed by the keys' 32 octets, so that
 * a lookup whose keys arrived packed (POST place as octets) finds them with
 * no str object per key, and one whose keys are hex strings parses each
 * (64 characters) instead of hashing it as a str. Open addressing with
 * linear probing over slots that hold the key inline; the hash (hash32)
 * has a random seed per table, so published keys cannot be chosen to
 * collide, and a table that still sees a long probe draws a new one. Values are plain tuples of str, bytes, int and float (what a
 * group is): no value can reach the table back, so the table needs no part
 * in garbage collection (a dict of such tuples is untracked too), and
 * dropping a value runs no Python code.
 */
typedef struct {
    unsigned char key[32];
    PyObject *value; /* NULL: never used; REMOVED: its entry was deleted */
} Slot;

static char removed_marker;
#define REMOVED ((PyObject *)&removed_marker)

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t mask;       /* capacity - 1; capacity is a power of two */
    Py_ssize_t used;   /* live entries */
    Py_ssize_t filled; /* live and removed */
    uint32_t seed[8];  /* of hash32, from os.urandom */
    Py_ssize_t reseeds; /* seeds drawn because a probe grew too long */
} KeyTable;

static PyTypeObject KeyTableType;
static PyObject *urandom; /* os.urandom */

#define SEED_OCTETS 32

/* A new random seed for hash32 into ``seed`` (8 words). */
static int
draw_seed(uint32_t *seed)
{
    PyObject *octets = PyObject_CallFunction(urandom, "n", (Py_ssize_t)SEED_OCTETS);
    if (octets == NULL)
        return -1;
    if (!PyBytes_Check(octets) || PyBytes_GET_SIZE(octets) != SEED_OCTETS) {
        Py_DECREF(octets);
        PyErr_SetString(PyExc_RuntimeError, "KeyTable: os.urandom gave no seed");
        return -1;
    }
    memcpy(seed, PyBytes_AS_STRING(octets), SEED_OCTETS);
    Py_DECREF(octets);
    return 0;
}


/* The slot index of a key: NH (UMAC's hash, ε-almost-universal with
 * ε = 2^-32 over the table's random 256-bit seed) of its eight 32-bit words,
 * then a fixed bijective mix so that the low bits depend on all of them.
 * Keys are HMAC outputs, but a publisher (an authenticated holder, P1)
 * chooses them: without the seed it cannot make them collide, and a probe
 * that still grows long makes the table draw a new seed (table_set). About
 * 2 ns a key; CPython's SipHash of the 32 octets took 15. */
static inline size_t
hash32(const uint32_t *seed, const unsigned char *key)
{
    uint32_t w[8];
    memcpy(w, key, 32);
    uint64_t h = 0;
    for (int j = 0; j < 8; j += 2)
        h += (uint64_t)(w[j] + seed[j]) * (uint64_t)(w[j + 1] + seed[j + 1]);
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return (size_t)h;
}

/* 1: ``key`` (64 lowercase hex digits, or 32 octets) parsed into ``out``;
 * 0: not a Block Key. Never raises. */
static int
parse_key(PyObject *key, unsigned char *out)
{
    if (PyUnicode_CheckExact(key)) {
        if (PyUnicode_GET_LENGTH(key) != 64 || PyUnicode_KIND(key) != PyUnicode_1BYTE_KIND)
            return 0;
        const Py_UCS1 *c = PyUnicode_1BYTE_DATA(key);
        return parse16(c, out) && parse16(c + 16, out + 8) && parse16(c + 32, out + 16) &&
               parse16(c + 48, out + 24);
    }
    if (PyBytes_CheckExact(key) && PyBytes_GET_SIZE(key) == 32) {
        memcpy(out, PyBytes_AS_STRING(key), 32);
        return 1;
    }
    return 0;
}

/* The slot holding ``key``, or NULL. */
static inline Slot *
find(KeyTable *t, const unsigned char *key)
{
    size_t i = hash32(t->seed, key) & t->mask;
    for (;;) {
        Slot *s = &t->slots[i];
        if (s->value == NULL)
            return NULL;
        if (s->value != REMOVED && memcmp(s->key, key, 32) == 0)
            return s;
        i = (i + 1) & t->mask;
    }
}

/* New slots for ``live`` entries, hashed with ``seed`` (NULL: the table's
 * own), the seed kept with them; on failure the table is as it was. */
static int
resize(KeyTable *t, Py_ssize_t live, const uint32_t *seed)
{
    if (seed == NULL)
        seed = t->seed;
    size_t capacity = 8;
    while (capacity <= (size_t)live * 2)
        capacity <<= 1;
    Slot *slots = PyMem_Calloc(capacity, sizeof(Slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Slot *old = t->slots;
    size_t old_capacity = old == NULL ? 0 : t->mask + 1;
    for (size_t k = 0; k < old_capacity; k++) {
        if (old[k].value == NULL || old[k].value == REMOVED)
            continue;
        size_t i = hash32(seed, old[k].key) & (capacity - 1);
        while (slots[i].value != NULL)
            i = (i + 1) & (capacity - 1);
        slots[i] = old[k];
    }
    PyMem_Free(old);
    if (seed != t->seed)
        memcpy(t->seed, seed, sizeof t->seed);
    t->slots = slots;
    t->mask = capacity - 1;
    t->filled = t->used;
    return 0;
}

static int
check_value(PyObject *value)
{
    if (PyTuple_CheckExact(value)) {
        Py_ssize_t n = PyTuple_GET_SIZE(value);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyTuple_GET_ITEM(value, i);
            if (!PyUnicode_CheckExact(item) && !PyBytes_CheckExact(item) &&
                !PyFloat_CheckExact(item) && !PyLong_CheckExact(item))
                goto bad;
        }
        return 0;
    }
bad:
    PyErr_SetString(PyExc_TypeError,
                    "KeyTable: a value is a tuple of str, bytes, int and float");
    return -1;
}

/* A probe this long is near impossible with a random hash (linear probing
 * at a load under 2/3 makes runs of about 10 log2(n)): its keys were chosen
 * to collide, and the table draws a new seed. */
static size_t
probe_limit(const KeyTable *t)
{
    size_t bits = 0;
    while (((size_t)1 << bits) <= t->mask)
        bits++;
    return 32 * (bits + 1);
}

static int
table_set(KeyTable *t, const unsigned char *key, PyObject *value)
{
    Slot *s = find(t, key);
    if (s != NULL) {
        PyObject *old = s->value;
        Py_INCREF(value);
        s->value = value;
        Py_DECREF(old); /* a tuple of atoms: runs no Python code */
        return 0;
    }
    if ((size_t)(t->filled + 1) * 3 >= (t->mask + 1) * 2 && resize(t, t->used + 1, NULL) < 0)
        return -1;
    size_t i = hash32(t->seed, key) & t->mask, probes = 0;
    while (t->slots[i].value != NULL && t->slots[i].value != REMOVED) {
        i = (i + 1) & t->mask;
        probes++;
    }
    if (t->slots[i].value == NULL)
        t->filled++;
    memcpy(t->slots[i].key, key, 32);
    Py_INCREF(value);
    t->slots[i].value = value;
    t->used++;
    if (probes > probe_limit(t)) {
        uint32_t seed[8];
        if (draw_seed(seed) < 0 || resize(t, t->used, seed) < 0)
            PyErr_Clear(); /* the entry is in; the next long probe tries again */
        else
            t->reseeds++;
    }
    return 0;
}

/* The value taken out of the table (a new reference), or NULL if absent. */
static PyObject *
table_take(KeyTable *t, PyObject *key)
{
    unsigned char raw[32];
    if (!parse_key(key, raw))
        return NULL;
    Slot *s = find(t, raw);
    if (s == NULL)
        return NULL;
    PyObject *value = s->value;
    s->value = REMOVED;
    t->used--;
    return value;
}

static PyObject *
KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *no_arguments[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":KeyTable", no_arguments))
        return NULL;
    KeyTable *t = (KeyTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    if (draw_seed(t->seed) < 0 || resize(t, 0, NULL) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

/* Drop ``capacity`` slots and their values. */
static void
free_slots(Slot *slots, size_t capacity)
{
    for (size_t k = 0; k < capacity; k++)
        if (slots[k].value != NULL && slots[k].value != REMOVED)
            Py_DECREF(slots[k].value);
    PyMem_Free(slots);
}

static void
KeyTable_dealloc(KeyTable *t)
{
    if (t->slots != NULL)
        free_slots(t->slots, t->mask + 1);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
KeyTable_len(KeyTable *t)
{
    return t->used;
}

static PyObject *
KeyTable_subscript(KeyTable *t, PyObject *key)
{
    unsigned char raw[32];
    Slot *s = parse_key(key, raw) ? find(t, raw) : NULL;
    if (s == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    Py_INCREF(s->value);
    return s->value;
}

static int
KeyTable_ass_subscript(KeyTable *t, PyObject *key, PyObject *value)
{
    if (value == NULL) {
        PyObject *old = table_take(t, key);
        if (old == NULL) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        Py_DECREF(old);
        return 0;
    }
    unsigned char raw[32];
    if (!parse_key(key, raw)) {
        PyErr_SetString(PyExc_ValueError,
                        "KeyTable: a key is 64 lowercase hex digits or 32 octets");
        return -1;
    }
    if (check_value(value) < 0)
        return -1;
    return table_set(t, raw, value);
}

static int
KeyTable_contains(KeyTable *t, PyObject *key)
{
    unsigned char raw[32];
    return parse_key(key, raw) && find(t, raw) != NULL;
}

static PyObject *
arguments_error(const char *name)
{
    PyErr_Format(PyExc_TypeError, "KeyTable.%s takes a key and an optional default", name);
    return NULL;
}

static PyObject *
KeyTable_get(KeyTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2)
        return arguments_error("get");
    unsigned char raw[32];
    Slot *s = parse_key(args[0], raw) ? find(t, raw) : NULL;
    PyObject *out = s != NULL ? s->value : (nargs > 1 ? args[1] : Py_None);
    Py_INCREF(out);
    return out;
}

static PyObject *
KeyTable_pop(KeyTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2)
        return arguments_error("pop");
    PyObject *value = table_take(t, args[0]);
    if (value != NULL)
        return value;
    if (nargs > 1) {
        Py_INCREF(args[1]);
        return args[1];
    }
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *
KeyTable_clear(KeyTable *t, PyObject *unused)
{
    /* The new, empty slots first: without them the table stays as it was. */
    Slot *fresh = PyMem_Calloc(8, sizeof(Slot));
    if (fresh == NULL)
        return PyErr_NoMemory();
    Slot *old = t->slots;
    size_t old_capacity = t->mask + 1;
    t->slots = fresh;
    t->mask = 7;
    t->used = t->filled = 0;
    free_slots(old, old_capacity);
    Py_RETURN_NONE;
}

static PyObject *
KeyTable_keys(KeyTable *t, PyObject *unused)
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (size_t k = 0; k <= t->mask; k++) {
        Slot *s = &t->slots[k];
        if (s->value == NULL || s->value == REMOVED)
            continue;
        PyObject *key = PyUnicode_New(64, 127);
        if (key == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        Py_UCS1 *d = PyUnicode_1BYTE_DATA(key);
        for (int j = 0; j < 32; j++) {
            d[2 * j] = HEX[s->key[j] >> 4];
            d[2 * j + 1] = HEX[s->key[j] & 15];
        }
        int failed = PyList_Append(out, key);
        Py_DECREF(key);
        if (failed) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* _set_seed(octets): a chosen seed, the slots hashed again (tests: keys
 * that collide under a known seed make the table draw a new one). */
static PyObject *
KeyTable_set_seed(KeyTable *t, PyObject *arg)
{
    if (!PyBytes_Check(arg) || PyBytes_GET_SIZE(arg) != (Py_ssize_t)sizeof t->seed) {
        PyErr_SetString(PyExc_ValueError, "KeyTable._set_seed: 32 octets");
        return NULL;
    }
    uint32_t seed[8];
    memcpy(seed, PyBytes_AS_STRING(arg), sizeof seed);
    if (resize(t, t->used, seed) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef KeyTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyTable_get, METH_FASTCALL,
     "get(key, default=None): the group of a key (hex or octets), or default."},
    {"pop", (PyCFunction)(void (*)(void))KeyTable_pop, METH_FASTCALL,
     "pop(key[, default]): take a key's group out."},
    {"clear", (PyCFunction)KeyTable_clear, METH_NOARGS, "Remove every entry."},
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "The keys, as hex, in no order."},
    {"_set_seed", (PyCFunction)KeyTable_set_seed, METH_O, "Tests: hash with a chosen seed."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef KeyTable_members[] = {
    {"reseeds", T_PYSSIZET, offsetof(KeyTable, reseeds), READONLY,
     "Seeds drawn because a probe grew too long (keys chosen to collide)."},
    {NULL, 0, 0, 0, NULL},
};

static PyMappingMethods KeyTable_as_mapping = {
    (lenfunc)KeyTable_len,
    (binaryfunc)KeyTable_subscript,
    (objobjargproc)KeyTable_ass_subscript,
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_contains = (objobjproc)KeyTable_contains,
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore._native.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_as_mapping = &KeyTable_as_mapping,
    .tp_as_sequence = &KeyTable_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Block Key -> group, keyed by the keys' 32 octets (see native.py).",
    .tp_methods = KeyTable_methods,
    .tp_members = KeyTable_members,
    .tp_new = KeyTable_new,
};

/* The group of a cached key if it is one of ``kind`` expiring after ``now``
 * (borrowed), else NULL. */
static inline PyObject *
live_group(KeyTable *t, const unsigned char *raw, PyObject *kind, double now)
{
    Slot *s = find(t, raw);
    if (s == NULL)
        return NULL;
    PyObject *group = s->value;
    if (!PyTuple_CheckExact(group) || PyTuple_GET_SIZE(group) != 4)
        return NULL;
    PyObject *expiry = PyTuple_GET_ITEM(group, 3);
    if (!PyFloat_CheckExact(expiry) || PyFloat_AS_DOUBLE(expiry) <= now)
        return NULL;
    PyObject *its_kind = PyTuple_GET_ITEM(group, 0);
    if (its_kind != kind) {
        /* Both exact str: compare their characters (no Python code). */
        if (!PyUnicode_CheckExact(its_kind) ||
            PyUnicode_GET_LENGTH(its_kind) != PyUnicode_GET_LENGTH(kind) ||
            PyUnicode_KIND(its_kind) != PyUnicode_KIND(kind) ||
            memcmp(PyUnicode_DATA(its_kind), PyUnicode_DATA(kind),
                   PyUnicode_GET_LENGTH(kind) * PyUnicode_KIND(kind)) != 0)
            return NULL;
    }
    return group;
}

/* walk(table, keys, start, kind, now, records, shapes) -> int
 *
 * From keys[start], while table[key] is a cached group (kind, records,
 * shapes, expiry) of ``kind`` that expires after ``now``: append its records
 * to ``records`` and its shapes to ``shapes`` (either may be None). Answers
 * the index of the first key that is not such a group (len(keys) when all
 * were). ``keys`` is a list or tuple of str (hex), or a buffer of the keys'
 * 32 octets each (a packed POST place). */
static PyObject *
walk(PyObject *self, PyObject *args)
{
    PyObject *table, *keys, *kind, *records, *shapes;
    Py_ssize_t start;
    double now;
    if (!PyArg_ParseTuple(args, "O!OnUdOO:walk", &KeyTableType, &table, &keys, &start, &kind,
                          &now, &records, &shapes))
        return NULL;
    if ((records != Py_None && !PyList_Check(records)) ||
        (shapes != Py_None && !PyList_Check(shapes))) {
        PyErr_SetString(PyExc_TypeError, "walk: records and shapes are lists or None");
        return NULL;
    }
    /* An exact str kind: comparing it runs no Python code, so nothing can
     * change the table or the lists under us. */
    if (!PyUnicode_CheckExact(kind)) {
        PyErr_SetString(PyExc_TypeError, "walk: kind must be a str");
        return NULL;
    }
    KeyTable *t = (KeyTable *)table;
    Py_ssize_t i = start < 0 ? 0 : start;
    Py_buffer view = {0};
    int packed = !PyList_Check(keys) && !PyTuple_Check(keys);
    Py_ssize_t n;
    if (packed) {
        if (PyUnicode_Check(keys) || PyObject_GetBuffer(keys, &view, PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError,
                            "walk: keys are a list or tuple of str, or packed octets");
            return NULL;
        }
        if (view.len % 32) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "walk: not a whole number of 32-octet keys");
            return NULL;
        }
        n = view.len / 32;
    }
    else {
        n = PySequence_Fast_GET_SIZE(keys);
    }
    unsigned char raw[32];
    for (; i < n; i++) {
        const unsigned char *key;
        if (packed) {
            key = (const unsigned char *)view.buf + 32 * i;
        }
        else {
            /* Read again each time: ``records`` or ``shapes`` may be this
             * very list, and appending to it moves its items. */
            PyObject *item = PySequence_Fast_ITEMS(keys)[i];
            if (!PyUnicode_CheckExact(item)) {
                PyErr_SetString(PyExc_TypeError, "walk: block keys must be str");
                return NULL;
            }
            if (!parse_key(item, raw))
                break; /* not a block key: nothing cached under it */
            key = raw;
        }
        PyObject *group = live_group(t, key, kind, now);
        if (group == NULL)
            break;
        if ((records != Py_None && PyList_Append(records, PyTuple_GET_ITEM(group, 1)) < 0) ||
            (shapes != Py_None && PyList_Append(shapes, PyTuple_GET_ITEM(group, 2)) < 0)) {
            if (packed)
                PyBuffer_Release(&view);
            return NULL;
        }
    }
    if (packed)
        PyBuffer_Release(&view);
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"hex_keys", hex_keys, METH_O, "The lowercase hex of each 32 octets of a buffer."},
    {"all_hex32", all_hex32, METH_O, "True for a non-empty list or tuple of 64-digit lowercase hex strings."},
    {"walk", walk, METH_VARARGS, "Collect the cached groups of consecutive keys (see native.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore._native", "The index's per-key loops in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    memset(HEXVAL, -1, sizeof HEXVAL);
    for (int d = 0; d < 16; d++)
        HEXVAL[(unsigned char)HEX[d]] = (signed char)d;
    if (PyType_Ready(&KeyTableType) < 0)
        return NULL;
    PyObject *os = PyImport_ImportModule("os");
    if (os == NULL)
        return NULL;
    urandom = PyObject_GetAttrString(os, "urandom");
    Py_DECREF(os);
    if (urandom == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&KeyTableType);
    if (PyModule_AddObject(m, "KeyTable", (PyObject *)&KeyTableType) < 0) {
        Py_DECREF(&KeyTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
