/* kvpool.master._index: the master's batched key lookup, the per-key part of exists and prefix_length.
 *
 * lookup(keys, objects) -> list
 *     keys      a list of keys (str)
 *     objects   a tuple of the shards' dicts key -> ObjectMeta, in shard order
 *     -> for each key, objects[xxh3_64(utf8(key)) % len(objects)].get(key): its ObjectMeta or None. A key
 *        that is not exactly a str (the master refuses those: INVALID_KEY), or is not valid UTF-8 (a lone
 *        surrogate), is None: it is not in the index.
 *
 * lookup(keys, objects, groups, group) -> list | int
 *     the same, and checks that every key belongs to shard group ``group`` of ``groups`` (decision 0080:
 *     xxh64(utf8(key), seed 0) % groups, common/groups.py's group_of): the position of the first key that
 *     does not is returned instead of the list. Keys that are not str or not UTF-8 are not checked.
 *
 * foreign(keys, groups, group) -> int
 *     the position of the first key of the sequence ``keys`` (str) whose group is not ``group``, or -1.
 *     A key that is not a str, or not UTF-8, raises TypeError / UnicodeEncodeError.
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

/* Sets *foreign when groups > 1 and the key's shard group is not group (the lookup then stops). */
static PyObject *meta_of(PyObject *key, PyObject *objects, Py_ssize_t nshards, unsigned long long groups,
                         unsigned long long group, int *foreign) {
    if (!PyUnicode_CheckExact(key)) {
        return Py_None;
    }
    Py_ssize_t size;
    const char *utf8 = PyUnicode_AsUTF8AndSize(key, &size); /* cached in the str; ASCII: no copy */
    if (utf8 == NULL) {
        PyErr_Clear(); /* not encodable: not a key of the index */
        return Py_None;
    }
    if (groups > 1 && XXH64(utf8, (size_t)size, 0) % groups != group) {
        *foreign = 1;
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

/* groups, group from args[2], args[3] when given; 0 on success. */
static int group_args(PyObject *const *args, Py_ssize_t nargs, unsigned long long *groups, unsigned long long *group) {
    *groups = 1;
    *group = 0;
    if (nargs < 4) {
        return 0;
    }
    *groups = PyLong_AsUnsignedLongLong(args[2]);
    *group = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred()) {
        return -1;
    }
    if (*groups < 1 || *group >= *groups) {
        PyErr_SetString(PyExc_ValueError, "group must be in 0 .. groups - 1");
        return -1;
    }
    return 0;
}

static PyObject *lookup(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if ((nargs != 2 && nargs != 4) || !PyList_Check(args[0]) || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "lookup(keys: list, objects: tuple of dicts[, groups, group])");
        return NULL;
    }
    unsigned long long groups, group;
    if (group_args(args, nargs, &groups, &group) < 0) {
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
        int foreign = 0;
        PyObject *meta = meta_of(PyList_GET_ITEM(keys, i), objects, nshards, groups, group, &foreign);
        if (meta == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        if (foreign) {
            Py_DECREF(out); /* the items set so far are released with it; the rest are still NULL */
            return PyLong_FromSsize_t(i);
        }
        PyList_SET_ITEM(out, i, Py_NewRef(meta));
    }
    return out;
}

static PyObject *foreign(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "foreign(keys: sequence of str, groups, group)");
        return NULL;
    }
    unsigned long long groups, group;
    PyObject *group_argv[4] = {NULL, NULL, args[1], args[2]};
    if (group_args(group_argv, 4, &groups, &group) < 0) {
        return NULL;
    }
    PyObject *keys = PySequence_Fast(args[0], "foreign: keys must be a sequence");
    if (keys == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    Py_ssize_t found = -1;
    for (Py_ssize_t i = 0; i < n && groups > 1; i++) {
        if (!PyUnicode_Check(items[i])) {
            PyErr_SetString(PyExc_TypeError, "foreign: keys must be str");
            Py_DECREF(keys);
            return NULL;
        }
        Py_ssize_t size;
        const char *utf8 = PyUnicode_AsUTF8AndSize(items[i], &size);
        if (utf8 == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
        if (XXH64(utf8, (size_t)size, 0) % groups != group) {
            found = i;
            break;
        }
    }
    Py_DECREF(keys);
    return PyLong_FromSsize_t(found);
}

static PyMethodDef methods[] = {
    {"lookup", (PyCFunction)(void (*)(void))lookup, METH_FASTCALL,
     "Each key's ObjectMeta or None, from the shards' dicts; with groups and group, the position of the "
     "first key of another shard group instead (_index.c)."},
    {"foreign", (PyCFunction)(void (*)(void))foreign, METH_FASTCALL,
     "The position of the first key whose shard group is not group, or -1 (_index.c)."},
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
