// The writer of a rank's flight record (gpucomm.reliability.flight), in C: what every collective pays for it.
//
// A call writes one slot of the rank's ring in shared memory when it starts and one word when
// it ends, and finds the caller's file:line by walking up the Python frames to the first one
// outside gpucomm and torch.distributed. In Python those three cost about 1.3 us per call, a
// seventh of an 8-byte all_reduce on the shared-memory path; here they cost one C call each
// (docs/reliability.md, "Cost", has the measurements). gpucomm.reliability.flight keeps the same writer in
// Python for hosts that cannot build this file; both follow the layout written there.
//
// The frame walk needs two verdicts that only Python can make: whether a code object is
// gpucomm's own, and the interned call site of an instruction of an outside one. The recorder
// keeps both in tables keyed by the code object's address, each holding a reference to its code
// object so that an address is never reused while it is a key. Where the walk meets a code
// object or an instruction it does not know, it hands the frame to Python's `teacher`, which
// walks on from there, teaches what it finds (teach_code, teach_site) and returns the site; a
// full table only means that Python walks more often.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>

// On CPython 3.11 and 3.12 the walk reads the interpreter's own frames. The public API hands out
// frame objects, and one is allocated for every frame on the way that has none yet, which is most
// of them: a collective's frames are new on every call. That doubled the writer's cost. This file
// is compiled by the interpreter that loads it, against its own headers, so the private layout it
// reads is that interpreter's. Other versions take the public walk.
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000 && !defined(GPUCOMM_PUBLIC_FRAMES)
#define GPUCOMM_INTERNAL_FRAMES 1
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#endif
#include <stdint.h>
#include <string.h>
#include <time.h>

// Slot layout: [entry, seq, collective, dtype, count, op, root, group, call site, entered, ended].
enum { SLOT_WORDS = 11, ENDED_WORD = 10 };
// Entries per table: gpucomm's own functions on the paths to a collective are a few dozen, and a
// program's call sites are a few per collective. Powers of two (the probe masks them).
enum { CODES = 1024, SITES = 1024 };

typedef struct {
    PyObject *code;  // NULL: empty
    int internal;
} CodeEntry;

typedef struct {
    PyObject *code;  // NULL: empty
    int lasti;
    int64_t site;
} SiteEntry;

typedef struct {
    PyObject_HEAD
    Py_buffer segment;  // the rank's own segment, held until close()
    int held;
    int64_t *words;
    Py_ssize_t ring_word, ring_mask;  // the ring's first word; slots - 1 (slots: a power of two)
    int64_t entries;  // calls entered so far, by every communicator writing here
    PyObject *teacher;  // teacher(frame) -> site, where the walk meets what it does not know
    CodeEntry codes[CODES];
    SiteEntry sites[SITES];
} Recorder;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  // time.monotonic_ns(): one clock for every process of a host
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline size_t probe_start(const void *code, size_t mask) {
    return ((uintptr_t)code >> 4) & mask;  // objects are 16-byte aligned
}

static inline int frame_lasti(PyFrameObject *frame) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(frame);
#else
    return frame->f_lasti * (int)sizeof(_Py_CODEUNIT);  // as Python's frame.f_lasti reads it
#endif
}

// -1: not taught; 0: outside code; 1: gpucomm's or torch.distributed's own.
static int code_verdict(Recorder *self, PyObject *code) {
    for (size_t i = probe_start(code, CODES - 1), n = 0; n < CODES; i = (i + 1) & (CODES - 1), ++n) {
        if (self->codes[i].code == code) return self->codes[i].internal;
        if (self->codes[i].code == NULL) return -1;
    }
    return -1;
}

static int64_t site_of(Recorder *self, PyObject *code, int lasti) {
    for (size_t i = probe_start(code, SITES - 1) ^ ((size_t)lasti & (SITES - 1)), n = 0; n < SITES; i = (i + 1) & (SITES - 1), ++n) {
        if (self->sites[i].code == code && self->sites[i].lasti == lasti) return self->sites[i].site;
        if (self->sites[i].code == NULL) return -1;
    }
    return -1;
}

#ifdef GPUCOMM_INTERNAL_FRAMES
// walk()'s answer from the interpreter's frames, without a frame object; -2 where the tables do
// not know a frame on the way (walk() then takes the public path, which asks the teacher).
static int64_t walk_internal(Recorder *self) {
    _PyInterpreterFrame *frame = PyThreadState_Get()->cframe->current_frame;
    for (; frame != NULL; frame = frame->previous) {
        if (_PyFrame_IsIncomplete(frame)) continue;  // being set up: not a caller yet
#if PY_VERSION_HEX >= 0x030C0000
        if (frame->owner == FRAME_OWNED_BY_CSTACK) continue;  // the C stack's shim frames
#endif
        int verdict = code_verdict(self, (PyObject *)frame->f_code);
        if (verdict < 0) return -2;
        if (verdict == 1) continue;
        int64_t site = site_of(self, (PyObject *)frame->f_code, _PyInterpreterFrame_LASTI(frame) * (int)sizeof(_Py_CODEUNIT));
        return site < 0 ? -2 : site;
    }
    return 0;
}
#endif

// The interned call site of the first frame outside gpucomm above the Python function calling
// us (0 when there is none: a call from gpucomm itself), asking the teacher where the tables do
// not know; -1 with an exception set if the teacher failed.
static int64_t walk(Recorder *self) {
#ifdef GPUCOMM_INTERNAL_FRAMES
    int64_t known = walk_internal(self);
    if (known >= 0) return known;
#endif
    PyFrameObject *frame = PyEval_GetFrame();  // borrowed
    if (frame == NULL) return 0;
    Py_INCREF(frame);
    int64_t site = 0;
    while (frame != NULL) {
        PyObject *code = (PyObject *)PyFrame_GetCode(frame);
        int verdict = code_verdict(self, code);
        Py_DECREF(code);
        if (verdict == 0) site = site_of(self, code, frame_lasti(frame));
        if (verdict < 0 || (verdict == 0 && site < 0)) {
            // Our own reference for the call: the teacher runs Python code, during which another
            // thread may close the record (which drops the record's reference to it).
            PyObject *teacher = self->teacher;
            Py_INCREF(teacher);
            PyObject *taught = PyObject_CallOneArg(teacher, (PyObject *)frame);
            Py_DECREF(teacher);
            site = taught == NULL ? -1 : PyLong_AsLongLong(taught);
            Py_XDECREF(taught);
            if (site < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Recorder: the teacher returned a negative site");
            break;
        }
        if (verdict == 0) break;
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    Py_XDECREF(frame);
    return site;
}

static int Recorder_init(Recorder *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"segment", "ring_at", "slots", "teacher", NULL};
    PyObject *segment, *teacher;
    Py_ssize_t ring_at, slots;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnO", names, &segment, &ring_at, &slots, &teacher)) return -1;
    if (!PyCallable_Check(teacher)) {
        PyErr_SetString(PyExc_TypeError, "Recorder: teacher must be callable");
        return -1;
    }
    if (slots <= 0 || (slots & (slots - 1)) || ring_at % 8) {
        PyErr_Format(PyExc_ValueError, "Recorder: slots must be a power of two and ring_at a multiple of 8, got %zd and %zd", slots, ring_at);
        return -1;
    }
    if (self->held) {
        PyErr_SetString(PyExc_RuntimeError, "Recorder: already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(segment, &self->segment, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    self->held = 1;
    if ((uintptr_t)self->segment.buf % 8 || self->segment.len < ring_at + slots * SLOT_WORDS * 8) {
        PyErr_Format(PyExc_ValueError, "Recorder: the segment must be 8-byte aligned and hold %zd bytes, got %zd", ring_at + slots * SLOT_WORDS * 8, self->segment.len);
        return -1;
    }
    self->words = (int64_t *)self->segment.buf;
    self->ring_word = ring_at / 8;
    self->ring_mask = slots - 1;
    Py_INCREF(teacher);
    self->teacher = teacher;
    return 0;
}

static void forget(Recorder *self) {
    for (size_t i = 0; i < CODES; ++i) Py_CLEAR(self->codes[i].code);
    for (size_t i = 0; i < SITES; ++i) Py_CLEAR(self->sites[i].code);
    Py_CLEAR(self->teacher);
    if (self->held) {
        PyBuffer_Release(&self->segment);
        self->held = 0;
        self->words = NULL;
    }
}

static void Recorder_dealloc(Recorder *self) {
    forget(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_open(Recorder *self) {
    if (self->words != NULL) return 1;
    PyErr_SetString(PyExc_ValueError, "Recorder: closed");
    return 0;
}

// Fills the slot of the next entry; its byte offset. call: collective, dtype, count, op, root, group.
static PyObject *write_slot(Recorder *self, int64_t seq, int64_t site, PyObject *call) {
    if (!PyTuple_Check(call) || PyTuple_GET_SIZE(call) != 6) {
        PyErr_SetString(PyExc_TypeError, "Recorder: call must be a tuple (collective, dtype, count, op, root, group)");
        return NULL;
    }
    int64_t v[6];
    for (int i = 0; i < 6; ++i) {
        v[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(call, i));
        if (v[i] == -1 && PyErr_Occurred()) return NULL;
    }
    // Checked again here, after the last call that can run Python code (the walk's teacher, an
    // __index__ above): another thread may have closed the record while it ran. From here to the
    // write nothing gives up the GIL.
    if (!check_open(self)) return NULL;
    int64_t entry = ++self->entries;
    Py_ssize_t word = self->ring_word + (entry & self->ring_mask) * SLOT_WORDS;
    int64_t *slot = self->words + word;
    slot[ENDED_WORD] = 0;  // running
    slot[0] = entry;
    slot[1] = seq;
    memcpy(slot + 2, v, sizeof v);
    slot[8] = site;
    slot[9] = now_ns();
    return PyLong_FromSsize_t(word * 8);
}

// enter(seq, call): write the slot of call number `seq`, entered now, with the call site of the
// first frame outside gpucomm above our caller; its byte offset.
static PyObject *Recorder_enter(Recorder *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "Recorder.enter: expected 2 arguments (seq, call), got %zd", nargs);
        return NULL;
    }
    if (!check_open(self)) return NULL;
    int64_t seq = PyLong_AsLongLong(args[0]);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    int64_t site = walk(self);
    if (site < 0) return NULL;
    return write_slot(self, seq, site, args[1]);
}

static int64_t *ended_word(Recorder *self, PyObject *at_obj) {
    Py_ssize_t at = PyLong_AsSsize_t(at_obj);
    if (at == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t first = self->ring_word * 8, last = first + (self->ring_mask + 1) * SLOT_WORDS * 8;
    if (at < first || at >= last || (at - first) % (SLOT_WORDS * 8)) {
        PyErr_Format(PyExc_ValueError, "Recorder: %zd is not the offset of a slot", at);
        return NULL;
    }
    return self->words + at / 8 + ENDED_WORD;
}

// end(at): the call at slot offset `at` completed now.
static PyObject *Recorder_end(Recorder *self, PyObject *at) {
    if (!check_open(self)) return NULL;  // nothing after it runs Python code: PyLong_AsSsize_t takes only an int
    int64_t *ended = ended_word(self, at);
    if (ended == NULL) return NULL;
    *ended = now_ns();
    Py_RETURN_NONE;
}

// fail(at): the call at slot offset `at` failed now (stored as minus the time).
static PyObject *Recorder_fail(Recorder *self, PyObject *at) {
    if (!check_open(self)) return NULL;
    int64_t *ended = ended_word(self, at);
    if (ended == NULL) return NULL;
    *ended = -now_ns();
    Py_RETURN_NONE;
}

// teach_code(code, internal): the walk's verdict on a code object.
static PyObject *Recorder_teach_code(Recorder *self, PyObject *args) {
    PyObject *code;
    int internal;
    if (!PyArg_ParseTuple(args, "O!p", &PyCode_Type, &code, &internal)) return NULL;
    for (size_t i = probe_start(code, CODES - 1), n = 0; n < CODES; i = (i + 1) & (CODES - 1), ++n) {
        if (self->codes[i].code == code) break;
        if (self->codes[i].code == NULL) {
            Py_INCREF(code);
            self->codes[i].code = code;
            self->codes[i].internal = internal;
            break;
        }
    }
    Py_RETURN_NONE;
}

// teach_site(frame, site): the interned call site of the instruction `frame` is at.
static PyObject *Recorder_teach_site(Recorder *self, PyObject *args) {
    PyObject *frame;
    long long site;
    if (!PyArg_ParseTuple(args, "O!L", &PyFrame_Type, &frame, &site)) return NULL;
    PyObject *code = (PyObject *)PyFrame_GetCode((PyFrameObject *)frame);
    int lasti = frame_lasti((PyFrameObject *)frame);
    for (size_t i = probe_start(code, SITES - 1) ^ ((size_t)lasti & (SITES - 1)), n = 0; n < SITES; i = (i + 1) & (SITES - 1), ++n) {
        if (self->sites[i].code == code && self->sites[i].lasti == lasti) break;
        if (self->sites[i].code == NULL) {
            Py_INCREF(code);
            self->sites[i].code = code;
            self->sites[i].lasti = lasti;
            self->sites[i].site = site;
            break;
        }
    }
    Py_DECREF(code);
    Py_RETURN_NONE;
}

static PyObject *Recorder_close(Recorder *self, PyObject *unused) {
    forget(self);
    Py_RETURN_NONE;
}

static PyObject *Recorder_get_entries(Recorder *self, void *unused) {
    return PyLong_FromLongLong(self->entries);
}

static PyMethodDef Recorder_methods[] = {
    {"enter", (PyCFunction)(void (*)(void))Recorder_enter, METH_FASTCALL, "enter(seq, call) -> byte offset of the slot written"},
    {"end", (PyCFunction)Recorder_end, METH_O, "end(at): the call at slot offset `at` completed now"},
    {"fail", (PyCFunction)Recorder_fail, METH_O, "fail(at): the call at slot offset `at` failed now"},
    {"teach_code", (PyCFunction)Recorder_teach_code, METH_VARARGS, "teach_code(code, internal)"},
    {"teach_site", (PyCFunction)Recorder_teach_site, METH_VARARGS, "teach_site(frame, site)"},
    {"close", (PyCFunction)Recorder_close, METH_NOARGS, "release the segment and the taught code objects"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Recorder_getset[] = {
    {"entries", (getter)Recorder_get_entries, NULL, "calls entered so far", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpucomm_flight_record.Recorder",
    .tp_basicsize = sizeof(Recorder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Writes one rank's flight-record ring (gpucomm.reliability.flight).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Recorder_init,
    .tp_dealloc = (destructor)Recorder_dealloc,
    .tp_methods = Recorder_methods,
    .tp_getset = Recorder_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpucomm_flight_record", "gpucomm's flight-record writer", -1, NULL};

PyMODINIT_FUNC PyInit_gpucomm_flight_record(void) {
    if (PyType_Ready(&RecorderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&RecorderType);
    if (PyModule_AddObject(m, "Recorder", (PyObject *)&RecorderType) < 0) {
        Py_DECREF(&RecorderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
