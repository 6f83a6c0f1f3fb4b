// The driver double's core: the log, initialisation, the current context, entry-point lookup
// (cuGetProcAddress, which NVIDIA's cuda.bindings resolves every driver function through), and
// stream capture into graphs that replay what they captured.

#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "double.h"

static int log_fd = -1;
static int initialised;
static void *self;  // this library, for cuGetProcAddress's lookups

__attribute__((constructor)) static void double_load(void) {
    const char *path = getenv("DRIVER_DOUBLE_LOG");
    if (path != NULL && path[0] != '\0') log_fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    Dl_info info;
    if (dladdr((void *)double_load, &info) && info.dli_fname != NULL) self = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
}

// Test-only: record from now on into the file at `path` (NULL: nowhere), for a process that loaded
// the double before it knew where its records should go.
DOUBLE_API int doubleLogTo(const char *path) {
    int fd = path == NULL ? -1 : open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (path != NULL && fd < 0) return -1;
    if (log_fd >= 0) close(log_fd);
    log_fd = fd;
    return 0;
}

// Every line ends with ` ctx=D`: the device of the context current in the calling thread at the
// call (-1: none), so that a test sees which GPU each call acted on.
void double_log(const char *entry, const char *format, ...) {
    if (log_fd < 0) return;
    char line[65536];
    int n = snprintf(line, sizeof line, "%s ", entry);
    va_list args;
    va_start(args, format);
    n += vsnprintf(line + n, sizeof line - (size_t)n - 32, format, args);
    va_end(args);
    if (n > (int)sizeof line - 32) n = (int)sizeof line - 32;
    n += snprintf(line + n, 32, " ctx=%d", double_current_device());
    line[n++] = '\n';
    ssize_t written = write(log_fd, line, (size_t)n);
    (void)written;
}

void double_hex(char *out, const void *bytes, size_t n) {
    static const char digits[] = "0123456789abcdef";
    const unsigned char *b = bytes;
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
    out[2 * n] = '\0';
}

int double_initialised(void) { return initialised; }

DOUBLE_API CUresult cuInit(unsigned int flags) {
    initialised = 1;
    double_log("cuInit", "flags=%u", flags);
    return CUDA_SUCCESS;
}

// The version the double claims: CUDA 12.8, new enough for every entry point it has.
DOUBLE_API CUresult cuDriverGetVersion(int *version) {
    if (version == NULL) return CUDA_ERROR_INVALID_VALUE;
    *version = 12080;
    return CUDA_SUCCESS;
}

// cuGetProcAddress: the double's own function of that name (cuda.bindings asks for every entry
// point it uses this way). Versioned names (foo_v2) are tried first, as the driver maps a request
// to the newest variant at or below the version asked for.
static CUresult proc_address(const char *symbol, void **pfn, int *status) {
    if (symbol == NULL || pfn == NULL) return CUDA_ERROR_INVALID_VALUE;
    char versioned[256];
    void *found = NULL;
    for (int v = 3; v >= 2 && found == NULL; v--) {
        snprintf(versioned, sizeof versioned, "%s_v%d", symbol, v);
        if (self != NULL) found = dlsym(self, versioned);
    }
    if (found == NULL && self != NULL) found = dlsym(self, symbol);
    *pfn = found;
    if (status != NULL) *status = found != NULL ? 0 : 1;  // CU_GET_PROC_ADDRESS_SUCCESS / _SYMBOL_NOT_FOUND
    double_log("cuGetProcAddress", "symbol=%s found=%d", symbol, found != NULL);
    return found != NULL ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

DOUBLE_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
    (void)version, (void)flags;
    return proc_address(symbol, pfn, status);
}

DOUBLE_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    (void)version, (void)flags;
    return proc_address(symbol, pfn, NULL);
}

DOUBLE_API CUresult cuGetErrorName(CUresult error, const char **name) {
    if (name == NULL) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
        case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; break;
        case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
        case CUDA_ERROR_OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
        case CUDA_ERROR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
        case CUDA_ERROR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
        case CUDA_ERROR_INVALID_IMAGE: *name = "CUDA_ERROR_INVALID_IMAGE"; break;
        case CUDA_ERROR_LAUNCH_FAILED: *name = "CUDA_ERROR_LAUNCH_FAILED"; break;
        case CUDA_ERROR_INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
        case CUDA_ERROR_INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
        case CUDA_ERROR_NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; break;
        case CUDA_ERROR_NOT_SUPPORTED: *name = "CUDA_ERROR_NOT_SUPPORTED"; break;
        default: *name = "CUDA_ERROR_UNKNOWN"; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuGetErrorString(CUresult error, const char **text) { return cuGetErrorName(error, text); }

int double_fails(const char *entry) {
    const char *failing = getenv("DRIVER_DOUBLE_FAIL");
    return failing != NULL && strcmp(failing, entry) == 0;
}

// Devices (their count, attributes, UUIDs, peers, visibility) and their primary contexts: devices.c.

// -- contexts: current per thread -------------------------------------------------------------
// cuCtxSetCurrent, push and pop are recorded (the device made current), so that a test sees every
// switch; every other record names the context current at its call (double_log's ctx field).
static __thread CUcontext current;
enum { CONTEXT_STACK = 8 };
static __thread CUcontext pushed[CONTEXT_STACK];
static __thread int depth;

DOUBLE_API CUresult cuCtxPushCurrent_v2(CUcontext context) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (context == NULL || depth == CONTEXT_STACK) return CUDA_ERROR_INVALID_VALUE;
    pushed[depth++] = current;
    current = context;
    double_log("cuCtxPushCurrent", "device=%d", double_context_device(context));
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuCtxPopCurrent_v2(CUcontext *context) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (context != NULL) *context = current;
    current = pushed[--depth];
    double_log("cuCtxPopCurrent", "device=%d", current == NULL ? -1 : double_context_device(current));
    return CUDA_SUCCESS;
}

int double_current_device(void) { return current == NULL ? -1 : double_context_device(current); }

DOUBLE_API CUresult cuCtxGetCurrent(CUcontext *context) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    *context = current;
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuCtxSetCurrent(CUcontext context) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    current = context;
    double_log("cuCtxSetCurrent", "device=%d", context == NULL ? -1 : double_context_device(context));
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuCtxGetDevice(CUdevice *device) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (current == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    *device = double_context_device(current);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuCtxSynchronize(void) { return initialised ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED; }

// -- stream capture: a graph keeps the lines of the launches captured into it ----------------------
enum { CAPTURES = 16, GRAPH_LAUNCHES = 64 };

struct DoubleGraph {
    int launches;
    char *lines[GRAPH_LAUNCHES];
    struct HostRun *runs[GRAPH_LAUNCHES];  // a captured launch of a host image, run at each replay; else NULL
};

static struct {
    CUstream stream;
    CUgraph graph;
} captures[CAPTURES];

CUgraph double_capturing(CUstream stream) {
    for (int i = 0; i < CAPTURES; i++)
        if (captures[i].graph != NULL && captures[i].stream == stream) return captures[i].graph;
    return NULL;
}

void double_graph_add(CUgraph graph, const char *line, struct HostRun *run) {
    if (graph->launches < GRAPH_LAUNCHES) {
        graph->runs[graph->launches] = run;
        graph->lines[graph->launches++] = strdup(line);
    } else if (run != NULL) {
        double_host_run_free(run);
    }
}

DOUBLE_API CUresult cuStreamBeginCapture_v2(CUstream stream, int mode) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (double_capturing(stream) != NULL) return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < CAPTURES; i++) {
        if (captures[i].graph == NULL) {
            captures[i].stream = stream;
            captures[i].graph = calloc(1, sizeof(struct DoubleGraph));
            double_log("cuStreamBeginCapture", "stream=%#llx mode=%d", (unsigned long long)(uintptr_t)stream, mode);
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_NOT_SUPPORTED;
}

DOUBLE_API CUresult cuStreamEndCapture(CUstream stream, CUgraph *graph) {
    for (int i = 0; i < CAPTURES; i++) {
        if (captures[i].graph != NULL && captures[i].stream == stream) {
            *graph = captures[i].graph;
            captures[i].graph = NULL;
            double_log("cuStreamEndCapture", "stream=%#llx launches=%d", (unsigned long long)(uintptr_t)stream, (*graph)->launches);
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

DOUBLE_API CUresult cuStreamIsCapturing(CUstream stream, int *status) {
    *status = double_capturing(stream) != NULL;  // CU_STREAM_CAPTURE_STATUS_NONE / _ACTIVE
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long flags) {
    (void)flags;
    *exec = graph;  // the double's executable graph is the graph itself
    return CUDA_SUCCESS;
}

// Replaying a graph logs each captured launch again, as it was captured (its `stream` the one it was
// captured on), with the stream replayed on as `graph_stream`, and runs it again where it launched
// a host image's kernel: with the parameters it was captured with, as a GPU replays a graph.
DOUBLE_API CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream) {
    if (exec == NULL) return CUDA_ERROR_INVALID_HANDLE;
    for (int i = 0; i < exec->launches; i++) {
        double_log("cuGraphLaunch", "graph_stream=%#llx %s", (unsigned long long)(uintptr_t)stream, exec->lines[i]);
        if (exec->runs[i] != NULL) {
            CUresult ran = double_host_run(exec->runs[i]);
            if (ran != CUDA_SUCCESS) return ran;
        }
    }
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuGraphDestroy(CUgraph graph) {
    if (graph == NULL) return CUDA_ERROR_INVALID_HANDLE;
    for (int i = 0; i < graph->launches; i++) {
        free(graph->lines[i]);
        if (graph->runs[i] != NULL) double_host_run_free(graph->runs[i]);
    }
    free(graph);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuGraphExecDestroy(CUgraphExec exec) {
    (void)exec;  // destroyed with its graph
    return CUDA_SUCCESS;
}
