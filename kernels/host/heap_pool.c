// The allocator behind gpucomm's torch.cuda.MemPool over the symmetric heap (gpucomm/transport/pool.py):
// torch's CUDAPluggableAllocator calls gpucomm_heap_malloc / gpucomm_heap_free for the segments its
// caching allocator carves tensors from, and they come from one region of the heap, first fit in
// offset order. Deterministic: the same calls in the same order give the same offsets, so ranks
// that run the same program get their pooled tensors at the same heap offsets (symmetric), and a
// collective reads them in place. Each call folds (call, offset, size) into a running hash that
// the ranks compare (SymmetricPool.check) to find out that their sequences differed.
//
// One region per process (the pluggable allocator's functions take no context): configure() sets
// it, from Python, before any allocation. 512-byte alignment, as torch's allocator keeps.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ALIGN 512
#define MAX_BLOCKS 4096

typedef struct {
    uint64_t offset, size;
} Block;

static struct {
    uintptr_t base;
    uint64_t size;
    Block free[MAX_BLOCKS];  // by offset
    int free_count;
    Block live[MAX_BLOCKS];
    int live_count;
    uint64_t live_bytes, hash;
} pool;

static void fold(uint64_t call, uint64_t offset, uint64_t size) {
    // FNV-1a over the three words, so that any difference in the sequence changes it.
    uint64_t words[3] = {call, offset, size};
    const unsigned char *bytes = (const unsigned char *)words;
    for (size_t i = 0; i < sizeof words; i++) pool.hash = (pool.hash ^ bytes[i]) * 1099511628211ULL;
}

// void* alloc(size_t size, int device, cudaStream_t stream), as CUDAPluggableAllocator calls it.
__attribute__((visibility("default"))) void *gpucomm_heap_malloc(size_t size, int device, void *stream) {
    (void)device, (void)stream;
    uint64_t want = ((uint64_t)size + ALIGN - 1) / ALIGN * ALIGN;
    if (want == 0) want = ALIGN;
    if (pool.base == 0 || pool.live_count == MAX_BLOCKS) return NULL;
    for (int i = 0; i < pool.free_count; i++) {
        Block *b = &pool.free[i];
        if (b->size < want) continue;
        uint64_t offset = b->offset;
        if (b->size == want) {
            memmove(b, b + 1, (size_t)(pool.free_count - i - 1) * sizeof *b);
            pool.free_count--;
        } else {
            b->offset += want;
            b->size -= want;
        }
        pool.live[pool.live_count++] = (Block){offset, want};
        pool.live_bytes += want;
        fold(1, offset, want);
        return (void *)(pool.base + offset);
    }
    fold(3, 0, want);  // a failed call is part of the sequence too
    return NULL;
}

// void free(void* ptr, size_t size, int device, cudaStream_t stream)
__attribute__((visibility("default"))) void gpucomm_heap_free(void *ptr, size_t size, int device, void *stream) {
    (void)size, (void)device, (void)stream;
    uint64_t offset = (uint64_t)((uintptr_t)ptr - pool.base);
    int at = -1;
    for (int i = 0; i < pool.live_count; i++)
        if (pool.live[i].offset == offset) at = i;
    if (at < 0) return;  // not ours: nothing to give back
    Block block = pool.live[at];
    pool.live[at] = pool.live[--pool.live_count];
    pool.live_bytes -= block.size;
    fold(2, block.offset, block.size);
    // Insert in offset order, merging with the neighbours it touches.
    int i = 0;
    while (i < pool.free_count && pool.free[i].offset < block.offset) i++;
    if (i < pool.free_count && block.offset + block.size == pool.free[i].offset) {
        block.size += pool.free[i].size;
        memmove(&pool.free[i], &pool.free[i + 1], (size_t)(pool.free_count - i - 1) * sizeof(Block));
        pool.free_count--;
    }
    if (i > 0 && pool.free[i - 1].offset + pool.free[i - 1].size == block.offset) {
        pool.free[i - 1].size += block.size;
        return;
    }
    memmove(&pool.free[i + 1], &pool.free[i], (size_t)(pool.free_count - i) * sizeof(Block));
    pool.free[i] = block;
    pool.free_count++;
}

// configure(base, size): the region every later allocation comes from (the whole of it free);
// (0, 0) gives the region up.
static PyObject *configure(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "configure: expected 2 arguments (base, size), got %zd", nargs);
        return NULL;
    }
    void *base = PyLong_AsVoidPtr(args[0]);
    if (base == NULL && PyErr_Occurred()) return NULL;
    unsigned long long size = PyLong_AsUnsignedLongLong(args[1]);
    if (size == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    // Blocks of the old region still out are forgotten: a free of one later is not ours any more.
    memset(&pool, 0, sizeof pool);
    pool.base = (uintptr_t)base;
    pool.size = size;
    pool.hash = 1469598103934665603ULL;
    if (size) pool.free[pool.free_count++] = (Block){0, size};
    Py_RETURN_NONE;
}

// state() -> (base, live blocks, live bytes, hash of every call so far)
static PyObject *state(PyObject *self, PyObject *unused) {
    return Py_BuildValue("(KiKK)", (unsigned long long)pool.base, pool.live_count, (unsigned long long)pool.live_bytes, (unsigned long long)pool.hash);
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL, "configure(base, size)"},
    {"state", (PyCFunction)state, METH_NOARGS, "state() -> (base, live_blocks, live_bytes, hash)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpucomm_heap_pool", "the symmetric heap's MemPool allocator", -1, methods};

PyMODINIT_FUNC PyInit_gpucomm_heap_pool(void) { return PyModule_Create(&module); }
