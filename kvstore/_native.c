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
        for (int j = 0; j < 64; j++) {
            Py_UCS1 x = c[j];
            if (!((x >= '0' && x <= '9') || (x >= 'a' && x <= 'f')))
                Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* walk(groups, keys, start, kind, now, records, shapes) -> int
 *
 * From keys[start], while groups[key] is a cached group (kind, records,
 * shapes, expiry) of ``kind`` that expires after ``now``: append its records
 * to ``records`` and its shapes to ``shapes`` (either may be None). Answers
 * the index of the first key that is not such a group (len(keys) when all
 * were). */
static PyObject *
walk(PyObject *self, PyObject *args)
{
    PyObject *groups, *keys, *kind, *records, *shapes;
    Py_ssize_t start;
    double now;
    if (!PyArg_ParseTuple(args, "O!OnUdOO:walk", &PyDict_Type, &groups, &keys, &start, &kind,
                          &now, &records, &shapes))
        return NULL;
    if (!PyList_Check(keys) && !PyTuple_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "walk: keys must be a list or a tuple");
        return NULL;
    }
    if ((records != Py_None && !PyList_Check(records)) ||
        (shapes != Py_None && !PyList_Check(shapes))) {
        PyErr_SetString(PyExc_TypeError, "walk: records and shapes are lists or None");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    Py_ssize_t i = start < 0 ? 0 : start;
    /* Exact str keys and kinds only: their hashing and comparing run no
     * Python code, so nothing can change the dict or the lists under us. */
    if (!PyUnicode_CheckExact(kind)) {
        PyErr_SetString(PyExc_TypeError, "walk: kind must be a str");
        return NULL;
    }
    for (; i < n; i++) {
        PyObject *key = items[i];
        if (!PyUnicode_CheckExact(key)) {
            PyErr_SetString(PyExc_TypeError, "walk: block keys must be str");
            return NULL;
        }
        PyObject *group = PyDict_GetItemWithError(groups, key); /* borrowed */
        if (group == NULL) {
            if (PyErr_Occurred())
                return NULL;
            break;
        }
        if (!PyTuple_CheckExact(group) || PyTuple_GET_SIZE(group) != 4)
            break;
        PyObject *expiry = PyTuple_GET_ITEM(group, 3);
        if (!PyFloat_CheckExact(expiry) || PyFloat_AS_DOUBLE(expiry) <= now)
            break;
        PyObject *its_kind = PyTuple_GET_ITEM(group, 0);
        if (its_kind != kind &&
            (!PyUnicode_CheckExact(its_kind) || PyUnicode_Compare(its_kind, kind) != 0)) {
            if (PyErr_Occurred())
                return NULL;
            break;
        }
        if (records != Py_None && PyList_Append(records, PyTuple_GET_ITEM(group, 1)) < 0)
            return NULL;
        if (shapes != Py_None && PyList_Append(shapes, PyTuple_GET_ITEM(group, 2)) < 0)
            return NULL;
    }
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
    return PyModule_Create(&module);
}
