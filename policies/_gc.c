/* policies._gc: take objects that can never be part of a reference cycle out of the cyclic
 * garbage collector's lists.
 *
 * Why: the broker holds a million blocks, each a compiled Block (and, under deadline_edf,
 * its _Held record), which the collector tracks because they hold object fields. Python's
 * full collection walks every tracked object, and one runs each time the objects that
 * survived since the last one reach a quarter of the rest: with the blocks a serving engine
 * keeps cached (kvbroker bench --prefix-cache), full collections took 40-74 ms each, and
 * they grow with the number of blocks. A Block references only str, int and a tuple of
 * ints, a _Held only its Block, ints, a float and a tuple: neither can be on a cycle, so
 * reference counting alone frees them, and the collector need not look at them.
 * Untracking changes no result: an object that is not tracked still counts as a reference
 * from outside for whatever it points to.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *untrack(PyObject *module, PyObject *obj) {
    if (PyObject_IS_GC(obj) && PyObject_GC_IsTracked(obj)) PyObject_GC_UnTrack(obj);
    return Py_NewRef(obj);
}

static PyMethodDef methods[] = {
    {"untrack", (PyCFunction)untrack, METH_O,
     "untrack(obj) -> obj: take obj out of the cyclic collector's lists (it must never be part of a cycle)."},
    {NULL},
};

static struct PyModuleDef gc_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "policies._gc",
    .m_doc = "Untracking objects that cannot be on a reference cycle (see policies/base.py: untrack).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__gc(void) { return PyModule_Create(&gc_module); }
