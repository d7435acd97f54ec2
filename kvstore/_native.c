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

/* A new str: the lowercase hex of the 32 octets at ``p``. */
static PyObject *
hex32(const unsigned char *p)
{
    PyObject *s = PyUnicode_New(64, 127);
    if (s == NULL)
        return NULL;
    Py_UCS1 *d = PyUnicode_1BYTE_DATA(s);
    for (int j = 0; j < 32; j++) {
        d[2 * j] = HEX[p[j] >> 4];
        d[2 * j + 1] = HEX[p[j] & 15];
    }
    return s;
}

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
        PyObject *s = hex32(p + 32 * i);
        if (s == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&view);
            return NULL;
        }
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

#include "_keytable.h"

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
