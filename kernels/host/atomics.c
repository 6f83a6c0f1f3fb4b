// Release stores and acquire loads of 64-bit words in host memory: the flag handoff of the
// shared-memory workspace (gpucomm.ops.host_atomics), with the same release/acquire guarantee the
// GPU kernels give. Through ctypes and libatomic each costs 0.4-0.6 us of call overhead, and an
// 8-byte all_reduce at 2 ranks makes at least four; here each is one C call. The caller checks an
// address once (non-null, 8-byte aligned, inside a mapped workspace) before it loops on it.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static int64_t *word_at(PyObject *addr) {
    void *p = PyLong_AsVoidPtr(addr);
    if (p == NULL && PyErr_Occurred()) return NULL;
    return (int64_t *)p;
}

// store_release(addr, value): *addr = value, with release ordering.
static PyObject *store_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "store_release: expected 2 arguments (addr, value), got %zd", nargs);
        return NULL;
    }
    int64_t *word = word_at(args[0]);
    if (word == NULL) return NULL;
    int64_t value = PyLong_AsLongLong(args[1]);
    if (value == -1 && PyErr_Occurred()) return NULL;
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

// load_acquire(addr) -> *addr, with acquire ordering.
static PyObject *load_acquire(PyObject *self, PyObject *addr) {
    int64_t *word = word_at(addr);
    if (word == NULL) return NULL;
    return PyLong_FromLongLong(__atomic_load_n(word, __ATOMIC_ACQUIRE));
}

static PyMethodDef methods[] = {
    {"store_release", (PyCFunction)(void (*)(void))store_release, METH_FASTCALL, "store_release(addr, value)"},
    {"load_acquire", (PyCFunction)load_acquire, METH_O, "load_acquire(addr) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpucomm_atomics", "gpucomm's host flag atomics", -1, methods};

PyMODINIT_FUNC PyInit_gpucomm_atomics(void) { return PyModule_Create(&module); }
