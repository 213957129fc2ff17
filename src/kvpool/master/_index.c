/* kvpool.master._index: the master's batched key lookup, the per-key part of exists and prefix_length.
 *
 * lookup(keys, objects) -> list
 *     keys      a list of keys (str)
 *     objects   a tuple of the shards' dicts key -> ObjectMeta, in shard order
 *     -> for each key, objects[xxh3_64(utf8(key)) % len(objects)].get(key): its ObjectMeta or None. A key
 *        that is not exactly a str (the master refuses those: INVALID_KEY), or is not valid UTF-8 (a lone
 *        surrogate), is None: it is not in the index.
 *
 * Why native: a 1,000-key exists spent a third of the master's time computing shard indices (encode, an
 * xxh3 call and a modulo per key in Python) and most of the rest on the dict lookups around them
 * (docs/benchmarks.md, "The master's batched lookup"). The shard function is shards.shard_index's:
 * XXH3-64 with seed 0, whose output is fixed since xxHash 0.8.0, so this and python-xxhash agree (the
 * tests check it). The GIL is held throughout: the lookup is as atomic as the Python loop it replaces.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

static PyObject *meta_of(PyObject *key, PyObject *objects, Py_ssize_t nshards) {
    if (!PyUnicode_CheckExact(key)) {
        return Py_None;
    }
    Py_ssize_t size;
    const char *utf8 = PyUnicode_AsUTF8AndSize(key, &size); /* cached in the str; ASCII: no copy */
    if (utf8 == NULL) {
        PyErr_Clear(); /* not encodable: not a key of the index */
        return Py_None;
    }
    XXH64_hash_t hash = XXH3_64bits(utf8, (size_t)size);
    PyObject *shard = PyTuple_GET_ITEM(objects, (Py_ssize_t)(hash % (XXH64_hash_t)nshards));
    PyObject *meta = PyDict_GetItemWithError(shard, key); /* borrowed */
    if (meta == NULL) {
        return PyErr_Occurred() ? NULL : Py_None;
    }
    return meta;
}

static PyObject *lookup(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyList_Check(args[0]) || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "lookup(keys: list, objects: tuple of dicts)");
        return NULL;
    }
    PyObject *keys = args[0], *objects = args[1];
    Py_ssize_t nshards = PyTuple_GET_SIZE(objects);
    if (nshards < 1) {
        PyErr_SetString(PyExc_ValueError, "lookup: no shards");
        return NULL;
    }
    for (Py_ssize_t s = 0; s < nshards; s++) {
        if (!PyDict_Check(PyTuple_GET_ITEM(objects, s))) {
            PyErr_SetString(PyExc_TypeError, "lookup: objects must be a tuple of dicts");
            return NULL;
        }
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* No Python code runs in here (exact str keys hash and compare natively), so keys cannot change. */
        PyObject *meta = meta_of(PyList_GET_ITEM(keys, i), objects, nshards);
        if (meta == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, Py_NewRef(meta));
    }
    return out;
}

static PyMethodDef methods[] = {
    {"lookup", (PyCFunction)(void (*)(void))lookup, METH_FASTCALL,
     "Each key's ObjectMeta or None, from the shards' dicts (_index.c)."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvpool.master._index",
    .m_doc = "The master's batched key lookup (see _index.c).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__index(void) { return PyModule_Create(&module_def); }
