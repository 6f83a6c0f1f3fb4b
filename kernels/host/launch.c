// Kernel launches bound once, each then one call into the CUDA driver (gpucomm.ops.launcher).
//
// A repeated collective launches the same kernel with the same arguments call after call. Through
// Triton's JIT dispatch that costs 8-17 us of host time per call (the binder specialising every
// argument, the cache key, the launch metadata), through CuPy's Function a conversion of every
// argument; a bare cuLaunchKernel costs 1.3-1.6 us. Here the arguments are packed once into the
// kernel's parameter buffer (each at its offset, the layout the kernel's .entry declares) and a
// launch is one cuLaunchKernel with that buffer (CU_LAUNCH_PARAM_BUFFER_POINTER): no Python object
// is built per call. A launch whose words change per call is bound anew per call (Driver.bind packs
// them in C), never rewritten in place: several threads may launch the same kernel at once.
//
// The driver is reached with dlopen() ("libcuda.so.1", or a path the caller gives: the tests'
// driver double), so nothing links against a driver at build time, and the entry points are
// resolved once, when the Driver is made.
//
// A function is loaded when it is handed out (Driver.load), not at its first launch: under lazy
// loading (the driver's default since CUDA 12.2) a function cuModuleGetFunction returns may be
// loaded only when first used, and a first launch that loads it can wait behind a kernel already
// spinning on a flag that this very launch would set (NCCL loads its kernels at init for this).
// Every call lands on the kernel's own GPU, whatever context the calling thread holds (a process
// driving several GPUs, a thread whose current device is another rank's): a module is loaded into
// the primary context of the device named at load (torch's context of that device), and a launch
// of one of its functions runs in that context, made current around the cuLaunchKernel when the
// thread holds another one and the thread's own restored after. Same context: one cuCtxGetCurrent.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
// cuLaunchKernel's `extra` keys (cuda.h).
#define LAUNCH_PARAM_END ((void *)0)
#define LAUNCH_PARAM_BUFFER_POINTER ((void *)1)
#define LAUNCH_PARAM_BUFFER_SIZE ((void *)2)
// The most parameter bytes a kernel takes (CUDA 12.1 raised it from 4 KiB to 32 KiB; ours use ~120).
#define MAX_PARAM_BYTES 32764

typedef CUresult (*cuInit_t)(unsigned int);
typedef CUresult (*cuCtxGetCurrent_t)(CUcontext *);
typedef CUresult (*cuCtxSetCurrent_t)(CUcontext);
typedef CUresult (*cuDeviceGet_t)(CUdevice *, int);
typedef CUresult (*cuDevicePrimaryCtxRetain_t)(CUcontext *, CUdevice);
typedef CUresult (*cuModuleLoadData_t)(CUmodule *, const void *);
typedef CUresult (*cuModuleGetFunction_t)(CUfunction *, CUmodule, const char *);
typedef CUresult (*cuFuncSetAttribute_t)(CUfunction, int, int);
typedef CUresult (*cuFuncGetParamInfo_t)(CUfunction, size_t, size_t *, size_t *);
typedef CUresult (*cuFuncLoad_t)(CUfunction);
typedef CUresult (*cuLaunchKernel_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **,
                                     void **);
typedef CUresult (*cuGetErrorName_t)(CUresult, const char **);

typedef struct {
    PyObject_HEAD
    void *library;
    cuCtxGetCurrent_t ctx_get_current;
    cuCtxSetCurrent_t ctx_set_current;
    cuDeviceGet_t device_get;
    cuDevicePrimaryCtxRetain_t primary_ctx_retain;
    cuModuleLoadData_t module_load_data;
    cuModuleGetFunction_t module_get_function;
    cuFuncSetAttribute_t func_set_attribute;
    cuFuncGetParamInfo_t func_get_param_info;  // NULL before CUDA 12.4
    cuFuncLoad_t func_load;                    // NULL before CUDA 12.4
    cuLaunchKernel_t launch_kernel;
    cuGetErrorName_t get_error_name;
    // The context each function loaded here lives in (functions are a few dozen per process).
    Py_ssize_t loaded, capacity;
    CUfunction *functions;
    CUcontext *contexts;
} Driver;

// Raise RuntimeError naming the driver call that failed and its CUresult; returns NULL.
static PyObject *driver_error(Driver *driver, const char *call, CUresult result) {
    const char *name = NULL;
    if (driver->get_error_name == NULL || driver->get_error_name(result, &name) != CUDA_SUCCESS || name == NULL) name = "unknown";
    PyErr_Format(PyExc_RuntimeError, "gpucomm launcher: %s failed: %s (CUresult %d)", call, name, result);
    return NULL;
}

static void *resolve(void *library, const char *name, int required) {
    void *found = dlsym(library, name);
    if (found == NULL && required) PyErr_Format(PyExc_OSError, "gpucomm launcher: the driver has no %s", name);
    return found;
}

// Driver(path=None): the CUDA driver at `path` (default "libcuda.so.1"), initialised.
static int Driver_init(Driver *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"path", NULL};
    const char *path = "libcuda.so.1";
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|z", keywords, &path)) return -1;
    if (path == NULL) path = "libcuda.so.1";
    if (self->library != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "gpucomm launcher: a Driver is opened once");
        return -1;
    }
    void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        PyErr_Format(PyExc_OSError, "gpucomm launcher: cannot open %s: %s", path, dlerror());
        return -1;
    }
    self->library = library;
    cuInit_t init = (cuInit_t)resolve(library, "cuInit", 1);
    self->ctx_get_current = (cuCtxGetCurrent_t)resolve(library, "cuCtxGetCurrent", 1);
    self->ctx_set_current = (cuCtxSetCurrent_t)resolve(library, "cuCtxSetCurrent", 1);
    self->device_get = (cuDeviceGet_t)resolve(library, "cuDeviceGet", 1);
    self->primary_ctx_retain = (cuDevicePrimaryCtxRetain_t)resolve(library, "cuDevicePrimaryCtxRetain", 1);
    self->module_load_data = (cuModuleLoadData_t)resolve(library, "cuModuleLoadData", 1);
    self->module_get_function = (cuModuleGetFunction_t)resolve(library, "cuModuleGetFunction", 1);
    self->func_set_attribute = (cuFuncSetAttribute_t)resolve(library, "cuFuncSetAttribute", 1);
    self->launch_kernel = (cuLaunchKernel_t)resolve(library, "cuLaunchKernel", 1);
    self->get_error_name = (cuGetErrorName_t)resolve(library, "cuGetErrorName", 0);
    self->func_get_param_info = (cuFuncGetParamInfo_t)resolve(library, "cuFuncGetParamInfo", 0);
    self->func_load = (cuFuncLoad_t)resolve(library, "cuFuncLoad", 0);
    if (PyErr_Occurred()) return -1;
    CUresult result = init(0);
    if (result != CUDA_SUCCESS) {
        driver_error(self, "cuInit", result);
        return -1;
    }
    return 0;
}

static void Driver_dealloc(Driver *self) {
    // The library stays loaded: functions it handed out may still be launched by a CUDA graph.
    PyMem_Free(self->functions);
    PyMem_Free(self->contexts);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

// The context `function` was loaded into by this Driver, or NULL for a function it did not load.
static CUcontext context_of(Driver *self, CUfunction function) {
    for (Py_ssize_t i = 0; i < self->loaded; i++)
        if (self->functions[i] == function) return self->contexts[i];
    return NULL;
}

static int remember(Driver *self, CUfunction function, CUcontext context) {
    if (context_of(self, function) != NULL) return 0;
    if (self->loaded == self->capacity) {
        Py_ssize_t capacity = self->capacity ? 2 * self->capacity : 32;
        CUfunction *functions = PyMem_Realloc(self->functions, (size_t)capacity * sizeof(CUfunction));
        if (functions == NULL) return -1;
        self->functions = functions;
        CUcontext *contexts = PyMem_Realloc(self->contexts, (size_t)capacity * sizeof(CUcontext));
        if (contexts == NULL) return -1;
        self->contexts = contexts;
        self->capacity = capacity;
    }
    self->functions[self->loaded] = function;
    self->contexts[self->loaded++] = context;
    return 0;
}

// load(image: bytes, name: str, device: int) -> function handle. The module holding `name` loaded
// into the device's primary context (torch's context of that device), whatever context is current:
// it is made current for the load, and the caller's (or none) is restored after. The function is
// loaded whole before it is handed out: cuFuncLoad where the driver has it (CUDA 12.4); before it,
// cuModuleGetFunction itself loads the kernel (CUDA 12.2's programming guide, "Lazy Loading").
// Launches of the function bound from this Driver run in that context (launch_on).
static PyObject *Driver_load(Driver *self, PyObject *args) {
    Py_buffer image;
    const char *name;
    int device;
    if (!PyArg_ParseTuple(args, "y*si", &image, &name, &device)) return NULL;
    CUcontext previous = NULL, primary = NULL;
    CUmodule module = NULL;
    CUfunction function = NULL;
    CUdevice dev;
    const char *call = "cuCtxGetCurrent";
    CUresult result = self->ctx_get_current(&previous);
    if (result == CUDA_SUCCESS) call = "cuDeviceGet", result = self->device_get(&dev, device);
    if (result == CUDA_SUCCESS) call = "cuDevicePrimaryCtxRetain", result = self->primary_ctx_retain(&primary, dev);
    if (result == CUDA_SUCCESS && primary != previous) call = "cuCtxSetCurrent", result = self->ctx_set_current(primary);
    if (result == CUDA_SUCCESS) call = "cuModuleLoadData", result = self->module_load_data(&module, image.buf);
    if (result == CUDA_SUCCESS) call = "cuModuleGetFunction", result = self->module_get_function(&function, module, name);
    if (result == CUDA_SUCCESS && self->func_load != NULL) call = "cuFuncLoad", result = self->func_load(function);
    // The primary context stays retained: the module, and every launch of its functions, live in it.
    if (primary != NULL && primary != previous) {
        CUresult restored = self->ctx_set_current(previous);
        if (result == CUDA_SUCCESS) call = "cuCtxSetCurrent", result = restored;
    }
    PyBuffer_Release(&image);
    if (result != CUDA_SUCCESS) return driver_error(self, call, result);
    if (remember(self, function, primary) < 0) return PyErr_NoMemory();
    return PyLong_FromVoidPtr(function);
}

// set_attribute(function, attribute, value): cuFuncSetAttribute.
static PyObject *Driver_set_attribute(Driver *self, PyObject *args) {
    PyObject *function;
    int attribute, value;
    if (!PyArg_ParseTuple(args, "Oii", &function, &attribute, &value)) return NULL;
    void *f = PyLong_AsVoidPtr(function);
    if (f == NULL && PyErr_Occurred()) return NULL;
    CUresult result = self->func_set_attribute(f, attribute, value);
    if (result != CUDA_SUCCESS) return driver_error(self, "cuFuncSetAttribute", result);
    Py_RETURN_NONE;
}

// param_info(function) -> [(offset, size), ...] as the driver reads them from the module, or None
// where the driver cannot say (cuFuncGetParamInfo is CUDA 12.4's).
static PyObject *Driver_param_info(Driver *self, PyObject *function) {
    void *f = PyLong_AsVoidPtr(function);
    if (f == NULL && PyErr_Occurred()) return NULL;
    if (self->func_get_param_info == NULL) Py_RETURN_NONE;
    PyObject *found = PyList_New(0);
    if (found == NULL) return NULL;
    for (size_t i = 0;; i++) {
        size_t offset = 0, size = 0;
        CUresult result = self->func_get_param_info(f, i, &offset, &size);
        if (result == CUDA_ERROR_INVALID_VALUE && i > 0) break;  // past the last parameter
        if (result != CUDA_SUCCESS) {
            Py_DECREF(found);
            Py_RETURN_NONE;  // this driver or this function cannot say
        }
        PyObject *entry = Py_BuildValue("(nn)", (Py_ssize_t)offset, (Py_ssize_t)size);
        if (entry == NULL || PyList_Append(found, entry) < 0) {
            Py_XDECREF(entry);
            Py_DECREF(found);
            return NULL;
        }
        Py_DECREF(entry);
    }
    return found;
}

// -- Bound: one kernel, its launch configuration and its packed parameters ----------------------
typedef struct {
    PyObject_HEAD
    Driver *driver;  // held: the entry point below is the driver's
    cuLaunchKernel_t launch_kernel;
    CUfunction function;
    CUcontext context;  // where the function lives (Driver.load); NULL: whatever is current
    unsigned grid[3], block[3], shared;
    CUstream stream;  // where launch() with no stream goes (a caller without streams: the double on CPU)
    Py_ssize_t count;
    size_t *offsets, *sizes;
    size_t bytes;
    unsigned char *buffer;
    void *extra[5];
} Bound;

static PyTypeObject BoundType;

// Store `value` as a `size`-byte little-endian integer at `at`; it must fit signed or unsigned.
static int store_word(unsigned char *at, size_t size, PyObject *value, Py_ssize_t index) {
    int overflow = 0;
    long long signed_value = PyLong_AsLongLongAndOverflow(value, &overflow);
    unsigned long long bits;
    if (signed_value == -1 && PyErr_Occurred()) return -1;
    if (overflow > 0) {
        bits = PyLong_AsUnsignedLongLong(value);
        if (bits == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        if (size < 8) goto out_of_range;
    } else if (overflow < 0) {
        goto out_of_range;
    } else {
        if (size < 8) {
            long long low = -(1LL << (8 * size - 1)), high = (1LL << (8 * size)) - 1;
            if (signed_value < low || signed_value > high) goto out_of_range;
        }
        bits = (unsigned long long)signed_value;
    }
    memcpy(at, &bits, size);  // little-endian: the low `size` bytes
    return 0;
out_of_range:
    PyErr_Format(PyExc_OverflowError, "gpucomm launcher: parameter %zd does not fit in %zu bytes: %R", index, size, value);
    return -1;
}

static int dims(PyObject *tuple, unsigned out[3], const char *what) {
    if (!PyArg_ParseTuple(tuple, "III", &out[0], &out[1], &out[2])) {
        PyErr_Format(PyExc_TypeError, "gpucomm launcher: %s must be 3 ints", what);
        return -1;
    }
    if (out[0] == 0 || out[1] == 0 || out[2] == 0) {
        PyErr_Format(PyExc_ValueError, "gpucomm launcher: %s must be positive", what);
        return -1;
    }
    return 0;
}

// bind(function, grid, block, shared, layout, values, stream=0) -> Bound. `layout` is
// [(offset, size), ...] of every parameter, `values` their ints; the caller checked the layout
// against the kernel's (gpucomm.ops.launcher.bind).
static PyObject *Driver_bind(Driver *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"function", "grid", "block", "shared", "layout", "values", "stream", NULL};
    PyObject *function, *grid, *block, *layout, *values, *stream = NULL;
    unsigned shared;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!IOO|O", keywords, &function, &PyTuple_Type, &grid, &PyTuple_Type, &block, &shared,
                                     &layout, &values, &stream))
        return NULL;
    Bound *bound = PyObject_New(Bound, &BoundType);
    if (bound == NULL) return NULL;
    bound->offsets = bound->sizes = NULL;
    bound->buffer = NULL;
    Py_INCREF(self);
    bound->driver = self;
    bound->launch_kernel = self->launch_kernel;
    bound->shared = shared;
    bound->stream = NULL;
    bound->function = PyLong_AsVoidPtr(function);
    bound->context = context_of(self, bound->function);
    PyObject *layout_seq = NULL, *values_seq = NULL;
    if (bound->function == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "gpucomm launcher: function handle is NULL");
        goto fail;
    }
    if (stream != NULL && stream != Py_None) {
        bound->stream = PyLong_AsVoidPtr(stream);
        if (bound->stream == NULL && PyErr_Occurred()) goto fail;
    }
    if (dims(grid, bound->grid, "grid") < 0 || dims(block, bound->block, "block") < 0) goto fail;
    layout_seq = PySequence_Fast(layout, "gpucomm launcher: layout must be a sequence");
    values_seq = PySequence_Fast(values, "gpucomm launcher: values must be a sequence");
    if (layout_seq == NULL || values_seq == NULL) goto fail;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(layout_seq);
    if (PySequence_Fast_GET_SIZE(values_seq) != count) {
        PyErr_Format(PyExc_ValueError, "gpucomm launcher: %zd parameters in the layout, %zd values", count, PySequence_Fast_GET_SIZE(values_seq));
        goto fail;
    }
    bound->count = count;
    bound->offsets = PyMem_Calloc((size_t)count + 1, sizeof(size_t));
    bound->sizes = PyMem_Calloc((size_t)count + 1, sizeof(size_t));
    if (bound->offsets == NULL || bound->sizes == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    size_t end = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t offset, size;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(layout_seq, i), "nn", &offset, &size)) goto fail;
        if (size != 1 && size != 2 && size != 4 && size != 8) {
            PyErr_Format(PyExc_ValueError, "gpucomm launcher: parameter %zd is %zd bytes; 1, 2, 4 or 8 are packed", i, size);
            goto fail;
        }
        if (offset < 0 || offset % size != 0 || (size_t)offset < end) {
            PyErr_Format(PyExc_ValueError, "gpucomm launcher: parameter %zd at offset %zd: not aligned to its %zd bytes, or overlapping the one before", i,
                         offset, size);
            goto fail;
        }
        bound->offsets[i] = (size_t)offset;
        bound->sizes[i] = (size_t)size;
        end = (size_t)(offset + size);
    }
    if (end > MAX_PARAM_BYTES) {
        PyErr_Format(PyExc_ValueError, "gpucomm launcher: %zu bytes of parameters, more than a kernel takes", end);
        goto fail;
    }
    bound->bytes = end;
    bound->buffer = PyMem_Calloc(end ? end : 1, 1);
    if (bound->buffer == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        if (store_word(bound->buffer + bound->offsets[i], bound->sizes[i], PySequence_Fast_GET_ITEM(values_seq, i), i) < 0) goto fail;
    bound->extra[0] = LAUNCH_PARAM_BUFFER_POINTER;
    bound->extra[1] = bound->buffer;
    bound->extra[2] = LAUNCH_PARAM_BUFFER_SIZE;
    bound->extra[3] = &bound->bytes;
    bound->extra[4] = LAUNCH_PARAM_END;
    Py_DECREF(layout_seq);
    Py_DECREF(values_seq);
    return (PyObject *)bound;
fail:
    Py_XDECREF(layout_seq);
    Py_XDECREF(values_seq);
    Py_DECREF(bound);
    return NULL;
}

static void Bound_dealloc(Bound *self) {
    PyMem_Free(self->offsets);
    PyMem_Free(self->sizes);
    PyMem_Free(self->buffer);
    Py_XDECREF(self->driver);
    PyObject_Free(self);
}

// One cuLaunchKernel in the function's context: made current around it where the thread holds
// another (or none), the thread's own restored after, whatever the launch returned.
static inline PyObject *launch_on(Bound *self, CUstream stream) {
    Driver *driver = self->driver;
    CUresult result = CUDA_SUCCESS, restored = CUDA_SUCCESS;
    const char *call = "cuCtxGetCurrent";
    CUcontext previous = NULL;
    Py_BEGIN_ALLOW_THREADS;  // the driver may block while its launch queue is full
    if (self->context != NULL) result = driver->ctx_get_current(&previous);
    int switched = result == CUDA_SUCCESS && self->context != NULL && previous != self->context;
    if (switched) call = "cuCtxSetCurrent", result = driver->ctx_set_current(self->context);
    if (result == CUDA_SUCCESS) {
        call = "cuLaunchKernel";
        result = self->launch_kernel(self->function, self->grid[0], self->grid[1], self->grid[2], self->block[0], self->block[1], self->block[2],
                                     self->shared, stream, NULL, self->extra);
        if (switched) restored = driver->ctx_set_current(previous);
    }
    Py_END_ALLOW_THREADS;
    if (result != CUDA_SUCCESS) return driver_error(driver, call, result);
    if (restored != CUDA_SUCCESS) return driver_error(driver, "cuCtxSetCurrent", restored);
    Py_RETURN_NONE;
}

// launch(stream): one cuLaunchKernel on the stream whose handle (an int, as torch's cuda_stream) is given.
static PyObject *Bound_launch(Bound *self, PyObject *stream) {
    void *s = PyLong_AsVoidPtr(stream);
    if (s == NULL && PyErr_Occurred()) return NULL;
    return launch_on(self, s);
}

// bound(): one cuLaunchKernel on the stream given at bind.
static PyObject *Bound_call(Bound *self, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "gpucomm launcher: a Bound is called without arguments (launch(stream) names a stream)");
        return NULL;
    }
    return launch_on(self, self->stream);
}

static PyObject *Bound_params(Bound *self, void *closure) { return PyBytes_FromStringAndSize((const char *)self->buffer, (Py_ssize_t)self->bytes); }

static PyObject *Bound_layout(Bound *self, void *closure) {
    PyObject *layout = PyList_New(self->count);
    if (layout == NULL) return NULL;
    for (Py_ssize_t i = 0; i < self->count; i++) {
        PyObject *entry = Py_BuildValue("(nn)", (Py_ssize_t)self->offsets[i], (Py_ssize_t)self->sizes[i]);
        if (entry == NULL) {
            Py_DECREF(layout);
            return NULL;
        }
        PyList_SET_ITEM(layout, i, entry);
    }
    return layout;
}

static PyObject *Bound_config(Bound *self, void *closure) {
    return Py_BuildValue("((III)(III)I)", self->grid[0], self->grid[1], self->grid[2], self->block[0], self->block[1], self->block[2], self->shared);
}

static PyObject *Bound_function(Bound *self, void *closure) { return PyLong_FromVoidPtr(self->function); }

static PyMethodDef Bound_methods[] = {
    {"launch", (PyCFunction)Bound_launch, METH_O, "launch(stream): one cuLaunchKernel on that stream"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Bound_getset[] = {
    {"params", (getter)Bound_params, NULL, "the packed parameter bytes", NULL},
    {"layout", (getter)Bound_layout, NULL, "[(offset, size)] of every parameter", NULL},
    {"config", (getter)Bound_config, NULL, "(grid, block, shared memory bytes)", NULL},
    {"function", (getter)Bound_function, NULL, "the kernel's CUfunction handle", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BoundType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpucomm_launch.Bound",
    .tp_basicsize = sizeof(Bound),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A kernel launch bound once: launch(stream), or call it for the stream given at bind.",
    .tp_dealloc = (destructor)Bound_dealloc,
    .tp_call = (ternaryfunc)Bound_call,
    .tp_methods = Bound_methods,
    .tp_getset = Bound_getset,
};

static PyMethodDef Driver_methods[] = {
    {"load", (PyCFunction)Driver_load, METH_VARARGS, "load(image, name, device) -> function handle"},
    {"set_attribute", (PyCFunction)Driver_set_attribute, METH_VARARGS, "set_attribute(function, attribute, value)"},
    {"param_info", (PyCFunction)Driver_param_info, METH_O, "param_info(function) -> [(offset, size)] or None"},
    {"bind", (PyCFunction)(void (*)(void))Driver_bind, METH_VARARGS | METH_KEYWORDS,
     "bind(function, grid, block, shared, layout, values, stream=0) -> Bound"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DriverType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpucomm_launch.Driver",
    .tp_basicsize = sizeof(Driver),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Driver(path=None): the CUDA driver, opened with dlopen (default libcuda.so.1).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Driver_init,
    .tp_dealloc = (destructor)Driver_dealloc,
    .tp_methods = Driver_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpucomm_launch", "gpucomm's bound kernel launches", -1, NULL};

PyMODINIT_FUNC PyInit_gpucomm_launch(void) {
    if (PyType_Ready(&DriverType) < 0 || PyType_Ready(&BoundType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&DriverType);
    if (PyModule_AddObject(m, "Driver", (PyObject *)&DriverType) < 0) {
        Py_DECREF(&DriverType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
