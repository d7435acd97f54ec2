/* kvstore/_keytable.h: the KeyTable type of kvstore._native (issue 20).
 *
 * Included once, by _native.c, after its hex helpers (hex32, parse16): one
 * translation unit, so the walk there inlines the table's lookups.
 */
/* ---- KeyTable: the index's cache of joined groups, keyed by raw keys ----
 *
 * A mapping from Block Keys to groups, keyed by the keys' 32 octets, so that
 * a lookup whose keys arrived packed (POST place as octets) finds them with
 * no str object per key, and one whose keys are hex strings parses each
 * (64 characters) instead of hashing it as a str. Open addressing with
 * linear probing over slots that hold the key inline; the hash (hash32)
 * has a random seed per table, so published keys cannot be chosen to
 * collide, and a table that still sees a long probe draws a new one.
 * Values are plain tuples of str, bytes, int and float (what a group is):
 * no value can reach the table back, so the table needs no part in garbage
 * collection (a dict of such tuples is untracked too), and dropping a value
 * runs no Python code.
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
    if (probes > 32 && probes > probe_limit(t)) { /* the limit: 32 at least */
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
        PyObject *key = hex32(s->key);
        if (key == NULL) {
            Py_DECREF(out);
            return NULL;
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
