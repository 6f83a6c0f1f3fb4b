// The driver double's virtual-memory and multicast entry points: the calls of gpucomm's symmetric
// heap (gpucomm/transport/vmm.py), recorded, and backed by real shared memory.
//
// An allocation (cuMemCreate) or a multicast object (cuMulticastCreate) is a memfd; exporting it
// gives a descriptor of that memfd, importing one wraps it, so descriptors passed between processes
// with SCM_RIGHTS name the same object there, and every record carries the object's inode for a
// test to follow it across processes. cuMemAddressReserve reserves host address space, cuMemMap maps
// the memfd there (MAP_SHARED), cuMemSetAccess makes it readable and writable: two processes that
// map each other's allocations share those bytes, as GPUs sharing a heap do.
//
// A multicast object keeps a header after its bytes (shared by every process holding it): how many
// devices it was created for, how many were added, how many memories were bound. As the driver
// does, cuMulticastBindMem refuses (CUDA_ERROR_NOT_PERMITTED) while a device is still to be added;
// the release of a handle records how many had bound by then.

#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "double.h"

typedef unsigned long long CUmemGenericAllocationHandle;

enum { CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1, CUDA_ERROR_NOT_PERMITTED = 800 };
enum { GRANULARITY = 2 << 20, HEADER_BYTES = 4096 };

typedef struct {
    int type;
    int id;
} CUmemLocation;

typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;

typedef struct {
    unsigned int numDevices;
    size_t size;
    unsigned long long handleTypes;
    unsigned long long flags;
} CUmulticastObjectProp;

struct Handle {
    int device;  // the GPU an allocation is on (cuMemCreate's location); 0 for a multicast object
    int fd;
    int multicast;
    size_t size;
    unsigned long inode;
    int *header;  // multicast only: [devices, added, bound], shared through the memfd
};

static unsigned long inode_of(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? (unsigned long)st.st_ino : 0;
}

// A multicast object's memfd holds its bytes, then the header page.
static int *map_header(int fd, size_t size) {
    void *at = mmap(NULL, HEADER_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)size);
    return at == MAP_FAILED ? NULL : at;
}

static struct Handle *wrap(int fd, int multicast, size_t size) {
    struct Handle *h = calloc(1, sizeof *h);
    h->fd = fd;
    h->multicast = multicast;
    h->size = size;
    h->inode = inode_of(fd);
    if (multicast) h->header = map_header(fd, size);
    return h;
}

static struct Handle *handle_of(CUmemGenericAllocationHandle value) { return (struct Handle *)(uintptr_t)value; }

DOUBLE_API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (granularity == NULL || prop == NULL) return CUDA_ERROR_INVALID_VALUE;
    *granularity = GRANULARITY;
    double_log("cuMemGetAllocationGranularity", "option=%d", option);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, unsigned long long flags) {
    if (double_fails("cuMemCreate")) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (handle == NULL || prop == NULL || flags != 0 || size == 0 || size % GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.id < 0 || prop->location.id > 1 || prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = memfd_create("gpucomm-double-mem", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) return CUDA_ERROR_UNKNOWN;
    struct Handle *h = wrap(fd, 0, size);
    h->device = prop->location.id;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    double_log("cuMemCreate", "pid=%d inode=%lu size=%zu device=%d", getpid(), h->inode, size, h->device);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle, int type, unsigned long long flags) {
    struct Handle *h = handle_of(handle);
    if (shareable == NULL || h == NULL || flags != 0 || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
    int fd = dup(h->fd);
    if (fd < 0) return CUDA_ERROR_UNKNOWN;
    *(int *)shareable = fd;
    double_log("cuMemExportToShareableHandle", "pid=%d inode=%lu multicast=%d", getpid(), h->inode, h->multicast);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle, int type) {
    if (double_fails("cuMemImportFromShareableHandle")) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (handle == NULL || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
    int fd = dup((int)(intptr_t)os_handle);  // the caller closes its descriptor; the handle keeps its own
    if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
    struct stat st;
    if (fstat(fd, &st) != 0) return CUDA_ERROR_INVALID_VALUE;
    // A multicast object's memfd is its bytes plus the header page: tell them apart by that page.
    int multicast = st.st_size % GRANULARITY == HEADER_BYTES;
    size_t size = (size_t)st.st_size - (multicast ? HEADER_BYTES : 0);
    struct Handle *h = wrap(fd, multicast, size);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    double_log("cuMemImportFromShareableHandle", "pid=%d inode=%lu multicast=%d size=%zu", getpid(), h->inode, multicast, size);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    struct Handle *h = handle_of(handle);
    if (h == NULL) return CUDA_ERROR_INVALID_HANDLE;
    int bound = h->header != NULL ? __atomic_load_n(&h->header[2], __ATOMIC_SEQ_CST) : -1;
    double_log("cuMemRelease", "pid=%d inode=%lu multicast=%d bound=%d", getpid(), h->inode, h->multicast, bound);
    if (h->header != NULL) munmap(h->header, HEADER_BYTES);
    close(h->fd);
    free(h);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (ptr == NULL || size == 0 || size % GRANULARITY || addr != 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    void *at = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (at == MAP_FAILED) return CUDA_ERROR_UNKNOWN;
    *ptr = (CUdeviceptr)(uintptr_t)at;
    double_log("cuMemAddressReserve", "pid=%d ptr=%#llx size=%zu alignment=%zu", getpid(), *ptr, size, alignment);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    if (munmap((void *)(uintptr_t)ptr, size) != 0) return CUDA_ERROR_INVALID_VALUE;
    double_log("cuMemAddressFree", "pid=%d ptr=%#llx size=%zu", getpid(), ptr, size);
    return CUDA_SUCCESS;
}

// What this process mapped where, and on which GPU the memory is (cuMemsetD8 runs only in that
// GPU's context). An imported allocation is taken to be on device 0: its exporter's GPU is not in
// its descriptor, and every test process that imports one drives device 0.
enum { MAPPINGS = 256 };
static struct {
    CUdeviceptr ptr;
    size_t size;
    int device;
} mappings[MAPPINGS];

static void note_mapping(CUdeviceptr ptr, size_t size, int device) {
    for (int i = 0; i < MAPPINGS; i++) {
        if (mappings[i].size == 0 || mappings[i].ptr == ptr) {
            mappings[i].ptr = ptr, mappings[i].size = size, mappings[i].device = device;
            return;
        }
    }
}

static int device_of(CUdeviceptr ptr) {
    for (int i = 0; i < MAPPINGS; i++)
        if (mappings[i].size != 0 && ptr >= mappings[i].ptr && ptr < mappings[i].ptr + mappings[i].size) return mappings[i].device;
    return 0;
}

DOUBLE_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags) {
    struct Handle *h = handle_of(handle);
    if (h == NULL || flags != 0 || offset + size > h->size) return CUDA_ERROR_INVALID_VALUE;
    void *at = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)offset);
    if (at == MAP_FAILED) return CUDA_ERROR_UNKNOWN;
    note_mapping(ptr, size, h->device);
    double_log("cuMemMap", "pid=%d ptr=%#llx size=%zu inode=%lu multicast=%d", getpid(), ptr, size, h->inode, h->multicast);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    if (double_fails("cuMemUnmap")) return CUDA_ERROR_OUT_OF_MEMORY;
    // Back to reserved, inaccessible address space, as the driver leaves it.
    void *at = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (at == MAP_FAILED) return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < MAPPINGS; i++)
        if (mappings[i].size != 0 && mappings[i].ptr == ptr) mappings[i].size = 0;
    double_log("cuMemUnmap", "pid=%d ptr=%#llx size=%zu", getpid(), ptr, size);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    if (desc == NULL || count != 1 || desc->location.id < 0 || desc->location.id > 1) return CUDA_ERROR_INVALID_VALUE;
    int prot = (desc->flags & 1 ? PROT_READ : 0) | (desc->flags & 2 ? PROT_WRITE : 0);
    if (mprotect((void *)(uintptr_t)ptr, size, prot) != 0) return CUDA_ERROR_INVALID_VALUE;
    double_log("cuMemSetAccess", "pid=%d ptr=%#llx size=%zu flags=%d", getpid(), ptr, size, desc->flags);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMemsetD8_v2(CUdeviceptr ptr, unsigned char value, size_t count) {
    // From another GPU's context than the memory's the driver's memset would fault.
    if (double_current_device() != device_of(ptr)) return CUDA_ERROR_INVALID_CONTEXT;
    unsigned char *at = (unsigned char *)(uintptr_t)ptr;
    for (size_t i = 0; i < count; i++) at[i] = value;
    double_log("cuMemsetD8", "pid=%d ptr=%#llx count=%zu value=%u", getpid(), ptr, count, value);
    return CUDA_SUCCESS;
}

// -- multicast objects --------------------------------------------------------------------------
// The virtual-memory, POSIX-descriptor and multicast attributes (cuda.h's 102, 103, 132): the
// double's GPU has them all. core.c's cuDeviceGetAttribute asks here for those it does not know.
int double_attribute(int attribute, int *value) {
    if (attribute == 102 || attribute == 103 || attribute == 132) {
        *value = 1;
        return 1;
    }
    return 0;
}

DOUBLE_API CUresult cuMulticastGetGranularity(size_t *granularity, const CUmulticastObjectProp *prop, int option) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (granularity == NULL || prop == NULL) return CUDA_ERROR_INVALID_VALUE;
    // As on a GPU, the recommended granularity (option 1) is larger than the minimum (0), which
    // is what creating and binding require.
    *granularity = option == 1 ? 4 * (size_t)GRANULARITY : GRANULARITY;
    double_log("cuMulticastGetGranularity", "option=%d", option);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMulticastCreate(CUmemGenericAllocationHandle *handle, const CUmulticastObjectProp *prop) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (double_fails("cuMulticastCreate")) return CUDA_ERROR_OUT_OF_MEMORY;
    if (handle == NULL || prop == NULL || prop->numDevices == 0 || prop->size % GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
    if (prop->handleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
    int fd = memfd_create("gpucomm-double-multicast", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)(prop->size + HEADER_BYTES)) != 0) return CUDA_ERROR_UNKNOWN;
    struct Handle *h = wrap(fd, 1, prop->size);
    if (h->header == NULL) return CUDA_ERROR_UNKNOWN;
    h->header[0] = (int)prop->numDevices;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    double_log("cuMulticastCreate", "pid=%d inode=%lu devices=%u size=%zu", getpid(), h->inode, prop->numDevices, prop->size);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMulticastAddDevice(CUmemGenericAllocationHandle handle, CUdevice device) {
    struct Handle *h = handle_of(handle);
    if (h == NULL || !h->multicast || device < 0 || device > 1) return CUDA_ERROR_INVALID_VALUE;
    int added = __atomic_add_fetch(&h->header[1], 1, __ATOMIC_SEQ_CST);
    if (added > h->header[0]) return CUDA_ERROR_INVALID_VALUE;
    double_log("cuMulticastAddDevice", "pid=%d inode=%lu device=%d added=%d", getpid(), h->inode, device, added);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMulticastBindMem(CUmemGenericAllocationHandle mc, size_t mc_offset, CUmemGenericAllocationHandle mem, size_t mem_offset, size_t size, unsigned long long flags) {
    struct Handle *m = handle_of(mc), *h = handle_of(mem);
    if (m == NULL || h == NULL || !m->multicast || h->multicast || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (double_fails("cuMulticastBindMem")) return CUDA_ERROR_OUT_OF_MEMORY;
    if (mc_offset + size > m->size || mem_offset + size > h->size) return CUDA_ERROR_INVALID_VALUE;
    int added = __atomic_load_n(&m->header[1], __ATOMIC_SEQ_CST);
    if (added < m->header[0]) {
        double_log("cuMulticastBindMem", "pid=%d inode=%lu refused=1 added=%d devices=%d", getpid(), m->inode, added, m->header[0]);
        return CUDA_ERROR_NOT_PERMITTED;
    }
    int bound = __atomic_add_fetch(&m->header[2], 1, __ATOMIC_SEQ_CST);
    double_log("cuMulticastBindMem", "pid=%d inode=%lu mem=%lu size=%zu bound=%d", getpid(), m->inode, h->inode, size, bound);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuMulticastUnbind(CUmemGenericAllocationHandle mc, CUdevice device, size_t mc_offset, size_t size) {
    struct Handle *m = handle_of(mc);
    if (m == NULL || !m->multicast || device < 0 || device > 1) return CUDA_ERROR_INVALID_VALUE;
    double_log("cuMulticastUnbind", "pid=%d inode=%lu offset=%zu size=%zu", getpid(), m->inode, mc_offset, size);
    return CUDA_SUCCESS;
}
