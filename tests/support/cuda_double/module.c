// The driver double's modules, functions and launches: what a launcher hands the driver, recorded.
//
// A module keeps a copy of its image; a function is found by name only where the image holds that
// name (a cubin's string table does), so a launcher that asks for a kernel its cubin lacks fails
// here as on a GPU. A module lives in the context current when it was loaded (its device; -1 where
// none was), and its functions launch only there: a launch from another GPU's context fails with
// CUDA_ERROR_INVALID_CONTEXT, as a handle of another context does on the driver. Launches are
// recorded: name, grid, block, shared memory, stream and the parameter bytes. Only the kernels of a
// host image (double.h, host_run.c) run; any other launch is recorded and runs nothing. Parameters passed as one buffer (cuLaunchKernel's `extra`,
// CU_LAUNCH_PARAM_BUFFER_POINTER/SIZE) are recorded as given; parameters passed as an array of
// pointers (`kernelParams`) can be read only with their sizes, which a test hands the double with
// doubleSetParamInfo (the real driver reads them from the cubin) and cuFuncGetParamInfo answers.
//
// Loading is lazy, as the driver's default since CUDA 12.2 (CUDA_MODULE_LOADING=LAZY): a function
// handed out by cuModuleGetFunction is not loaded until cuFuncLoad loads it or its first launch
// does (on a GPU that launch can then wait behind a kernel that spins on a flag). Each launch
// records whether its function was loaded before it (`loaded=`); CUDA_MODULE_LOADING=EAGER, read
// at each cuModuleGetFunction, hands out functions loaded.

#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "double.h"

enum { NAME_BYTES = 256, MAX_PARAMS = 64, KNOWN_LAYOUTS = 128, PARAM_BYTES = 4096 };

struct DoubleModule {
    int device;  // of the context it was loaded into, -1: none was current
    size_t bytes;
    unsigned char *image;
    HostLaunch host;  // a host image's launch entry (host_run.c); NULL: its launches run nothing
};

struct DoubleFunction {
    char name[NAME_BYTES];
    CUmodule module;
    int loaded;
};

// cuda.h's CUfunctionLoadingState.
enum { FUNCTION_UNLOADED = 0, FUNCTION_LOADED = 1 };

static int eager_loading(void) {
    const char *mode = getenv("CUDA_MODULE_LOADING");
    return mode != NULL && strcmp(mode, "EAGER") == 0;
}

// Parameter layouts the test declared, by kernel name.
static struct {
    char name[NAME_BYTES];
    int count;
    size_t offsets[MAX_PARAMS], sizes[MAX_PARAMS];
} layouts[KNOWN_LAYOUTS];

static unsigned long long launches;

// The image's size: an ELF cubin says it in its header; anything else is read as PTX text (NUL-ended).
static size_t image_bytes(const unsigned char *image) {
    if (memcmp(image, "\177ELF", 4) == 0 && image[4] == 2) {  // ELFCLASS64
        uint64_t shoff;
        uint16_t shentsize, shnum;
        memcpy(&shoff, image + 0x28, 8);
        memcpy(&shentsize, image + 0x3A, 2);
        memcpy(&shnum, image + 0x3C, 2);
        return (size_t)(shoff + (uint64_t)shentsize * shnum);
    }
    return strlen((const char *)image) + 1;
}

DOUBLE_API CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (module == NULL || image == NULL) return CUDA_ERROR_INVALID_VALUE;
    int failed;
    HostLaunch host = double_host_library(image, &failed);
    if (failed) return CUDA_ERROR_INVALID_IMAGE;
    size_t bytes = image_bytes(image);
    CUmodule m = malloc(sizeof *m);
    m->host = host;
    m->device = double_current_device();
    m->bytes = bytes;
    m->image = malloc(bytes);
    memcpy(m->image, image, bytes);
    *module = m;
    double_log("cuModuleLoadData", "module=%#llx bytes=%zu elf=%d host=%d", (unsigned long long)(uintptr_t)m, bytes,
               memcmp(image, "\177ELF", 4) == 0, host != NULL);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuModuleUnload(CUmodule module) {
    if (module == NULL) return CUDA_ERROR_INVALID_HANDLE;
    double_log("cuModuleUnload", "module=%#llx", (unsigned long long)(uintptr_t)module);
    free(module->image);
    free(module);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (module == NULL) return CUDA_ERROR_INVALID_HANDLE;
    size_t length = strlen(name);
    // A cubin's string table ends the name with a NUL; PTX text names it in `.entry name(`.
    int elf = memcmp(module->image, "\177ELF", 4) == 0;
    if (length >= NAME_BYTES || memmem(module->image, module->bytes, name, length + (size_t)elf) == NULL) {
        double_log("cuModuleGetFunction", "module=%#llx name=%s found=0", (unsigned long long)(uintptr_t)module, name);
        return CUDA_ERROR_NOT_FOUND;
    }
    CUfunction f = calloc(1, sizeof *f);
    memcpy(f->name, name, length + 1);
    f->module = module;
    f->loaded = eager_loading();
    *function = f;
    double_log("cuModuleGetFunction", "module=%#llx name=%s found=1 function=%#llx loaded=%d", (unsigned long long)(uintptr_t)module, name,
               (unsigned long long)(uintptr_t)f, f->loaded);
    return CUDA_SUCCESS;
}

// cuFuncLoad (CUDA 12.4): load the function now; no effect on one already loaded.
DOUBLE_API CUresult cuFuncLoad(CUfunction function) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (function == NULL) return CUDA_ERROR_INVALID_HANDLE;
    double_log("cuFuncLoad", "name=%s function=%#llx was_loaded=%d", function->name, (unsigned long long)(uintptr_t)function, function->loaded);
    function->loaded = 1;
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuFuncIsLoaded(int *state, CUfunction function) {
    if (function == NULL) return CUDA_ERROR_INVALID_HANDLE;
    if (state == NULL) return CUDA_ERROR_INVALID_VALUE;
    *state = function->loaded ? FUNCTION_LOADED : FUNCTION_UNLOADED;
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuFuncSetAttribute(CUfunction function, int attribute, int value) {
    if (function == NULL) return CUDA_ERROR_INVALID_HANDLE;
    double_log("cuFuncSetAttribute", "name=%s attribute=%d value=%d", function->name, attribute, value);
    return CUDA_SUCCESS;
}

// NUM_REGS (4), LOCAL_SIZE_BYTES (3) read 0; MAX_THREADS_PER_BLOCK (0) 1024, as Triton's loader asks.
DOUBLE_API CUresult cuFuncGetAttribute(int *value, int attribute, CUfunction function) {
    if (function == NULL) return CUDA_ERROR_INVALID_HANDLE;
    *value = attribute == 0 ? 1024 : 0;
    return CUDA_SUCCESS;
}

// Test-only: the parameters of kernels named `name`, as the cubin would give them to the driver.
DOUBLE_API int doubleSetParamInfo(const char *name, int count, const size_t *offsets, const size_t *sizes) {
    if (count > MAX_PARAMS || strlen(name) >= NAME_BYTES) return -1;
    for (int i = 0; i < KNOWN_LAYOUTS; i++) {
        if (layouts[i].name[0] == '\0' || strcmp(layouts[i].name, name) == 0) {
            strcpy(layouts[i].name, name);
            layouts[i].count = count;
            memcpy(layouts[i].offsets, offsets, sizeof(size_t) * (size_t)count);
            memcpy(layouts[i].sizes, sizes, sizeof(size_t) * (size_t)count);
            return 0;
        }
    }
    return -1;
}

// Test- and bench-only: launches recorded so far by this process (counted with or without a log).
DOUBLE_API unsigned long long doubleLaunches(void) { return launches; }

static int layout_of(const char *name) {
    for (int i = 0; i < KNOWN_LAYOUTS; i++)
        if (layouts[i].name[0] != '\0' && strcmp(layouts[i].name, name) == 0) return i;
    return -1;
}

DOUBLE_API CUresult cuFuncGetParamInfo(CUfunction function, size_t index, size_t *offset, size_t *size) {
    if (function == NULL) return CUDA_ERROR_INVALID_HANDLE;
    int known = layout_of(function->name);
    if (known < 0) return CUDA_ERROR_NOT_SUPPORTED;  // the double has not been told this kernel's parameters
    if (index >= (size_t)layouts[known].count) return CUDA_ERROR_INVALID_VALUE;
    *offset = layouts[known].offsets[index];
    *size = layouts[known].sizes[index];
    return CUDA_SUCCESS;
}

// cuLaunchKernel's `extra` keys (cuda.h).
#define LAUNCH_PARAM_END ((void *)0)
#define LAUNCH_PARAM_BUFFER_POINTER ((void *)1)
#define LAUNCH_PARAM_BUFFER_SIZE ((void *)2)

// The parameter bytes of a launch, packed into out (PARAM_BYTES) with their length in *bytes; the
// form they came in, or NULL if unreadable.
static const char *param_bytes(unsigned char *out, size_t *bytes, CUfunction f, void **params, void **extra) {
    if (extra != NULL) {
        const void *buffer = NULL;
        int sized = 0;
        for (int i = 0; extra[i] != LAUNCH_PARAM_END; i += 2) {
            if (extra[i] == LAUNCH_PARAM_BUFFER_POINTER) buffer = extra[i + 1];
            else if (extra[i] == LAUNCH_PARAM_BUFFER_SIZE) *bytes = *(size_t *)extra[i + 1], sized = 1;
            else return NULL;
        }
        if (buffer == NULL || !sized || *bytes > PARAM_BYTES || params != NULL) return NULL;
        memcpy(out, buffer, *bytes);
        return "buffer";
    }
    int known = layout_of(f->name);
    if (params == NULL || known < 0) return NULL;
    memset(out, 0, PARAM_BYTES);
    size_t end = 0;
    for (int i = 0; i < layouts[known].count; i++) {
        size_t at = layouts[known].offsets[i], n = layouts[known].sizes[i];
        if (at + n > PARAM_BYTES) return NULL;
        memcpy(out + at, params[i], n);
        if (at + n > end) end = at + n;
    }
    *bytes = end;
    return "pointers";
}

// The run of a launch of a host image's kernel, its parameters at the offsets the test declared
// (doubleSetParamInfo: the double cannot read them from a host library); NULL where the layout is
// unknown or the packed bytes are shorter than it.
static struct HostRun *host_run_of(CUfunction f, unsigned gx, unsigned bx, const unsigned char *packed, size_t bytes) {
    int known = layout_of(f->name);
    if (known < 0) return NULL;
    int count = layouts[known].count;
    if (count > 0 && layouts[known].offsets[count - 1] + layouts[known].sizes[count - 1] > bytes) return NULL;
    return double_host_run_new(f->module->host, f->name, gx, bx, packed, bytes, layouts[known].offsets, count);
}

static CUresult record_launch(const char *entry, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                              unsigned shared, CUstream stream, void **params, void **extra) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (f == NULL) return CUDA_ERROR_INVALID_HANDLE;
    if (f->module->device != double_current_device()) {
        double_log(entry, "name=%s refused=1 module_device=%d", f->name, f->module->device);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || (unsigned long long)bx * by * bz > 1024) return CUDA_ERROR_INVALID_VALUE;
    // On the stack: threads of one process may launch at once (a host image's launch takes a while).
    unsigned char packed[PARAM_BYTES];
    char hex[2 * PARAM_BYTES + 1];
    size_t bytes = 0;
    const char *form = param_bytes(packed, &bytes, f, params, extra);
    if (form == NULL) return CUDA_ERROR_INVALID_VALUE;
    double_hex(hex, packed, bytes);
    struct HostRun *run = NULL;
    if (f->module->host != NULL) {
        // A host image's kernel runs (a grid of y or z > 1 is beyond what gpucomm launches).
        if (gy != 1 || gz != 1 || by != 1 || bz != 1) return CUDA_ERROR_INVALID_VALUE;
        run = host_run_of(f, gx, bx, packed, bytes);
        if (run == NULL) {
            double_log(entry, "name=%s refused=1 host_layout_unknown=1", f->name);
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    launches++;
    char line[2 * PARAM_BYTES + 512];
    CUgraph graph = double_capturing(stream);
    snprintf(line, sizeof line, "name=%s grid=%u,%u,%u block=%u,%u,%u shared=%u stream=%#llx captured=%d loaded=%d form=%s params=%s", f->name, gx, gy,
             gz, bx, by, bz, shared, (unsigned long long)(uintptr_t)stream, graph != NULL, f->loaded, form, hex);
    f->loaded = 1;  // a lazy function loads at its first launch
    double_log(entry, "%s", line);
    if (graph != NULL) {
        double_graph_add(graph, line, run);  // runs at each replay, not now
        return CUDA_SUCCESS;
    }
    if (run == NULL) return CUDA_SUCCESS;
    CUresult ran = double_host_run(run);
    double_host_run_free(run);
    return ran;
}

DOUBLE_API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared,
                                   CUstream stream, void **params, void **extra) {
    return record_launch("cuLaunchKernel", f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
}

// cuLaunchKernelEx's configuration (cuda.h's CUlaunchConfig); attributes are not read.
typedef struct {
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned numAttrs;
} CUlaunchConfig;

DOUBLE_API CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
    return record_launch("cuLaunchKernelEx", f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ, c->sharedMemBytes,
                         c->hStream, params, extra);
}
