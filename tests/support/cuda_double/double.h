// The driver double's shared declarations: the few CUDA driver types its entry points take, the
// result codes they return, and the recording facility every entry point writes through.
//
// Types are declared here (not taken from cuda.h) so that the double builds on a host without the
// CUDA toolkit; they follow cuda.h's sizes and the values of its enums, which is all a caller that
// was compiled against cuda.h (or that dlopen()s libcuda.so.1) relies on.

#ifndef GPUCOMM_CUDA_DOUBLE_H
#define GPUCOMM_CUDA_DOUBLE_H

#include <stddef.h>
#include <stdint.h>

#define DOUBLE_API __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct DoubleContext *CUcontext;
typedef struct DoubleModule *CUmodule;
typedef struct DoubleFunction *CUfunction;
typedef struct DoubleStream *CUstream;  // never dereferenced: a stream is its handle's value
typedef struct DoubleGraph *CUgraph;
typedef struct DoubleGraph *CUgraphExec;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_UNKNOWN = 999,
};

// What one call recorded: `entry key=value key=value ...`, one line, appended to the file named by
// DRIVER_DOUBLE_LOG (read once, when the library loads; unset: nothing is written) or given to
// doubleLogTo. Lines are written
// with one write() on an O_APPEND descriptor, so processes sharing a log never interleave a line.
void double_log(const char *entry, const char *format, ...) __attribute__((format(printf, 2, 3)));
// The bytes as lowercase hex, into out (2 * n + 1 chars).
void double_hex(char *out, const void *bytes, size_t n);
// Whether cuInit has been called (every other entry point but the version and proc-address queries
// returns CUDA_ERROR_NOT_INITIALIZED before it, as the driver does).
int double_initialised(void);

// Stream capture (core.c), for launch.c: the graph a stream is capturing into, or NULL.
CUgraph double_capturing(CUstream stream);
// A launch captured into a graph: replayed (logged again, and run again where `run` is not NULL)
// by every cuGraphLaunch of it.
struct HostRun;
void double_graph_add(CUgraph graph, const char *line, struct HostRun *run);

// Host images (host_run.c): a module image that starts with HOST_IMAGE_TAG names a shared library
// of kernels built for the host (gpucomm's CUDA C++ kernels under GPUCOMM_CUDA_EMULATE), which
// exports `int gpucomm_host_launch(const char *kernel, unsigned grid_x, unsigned block_x,
// void **params, unsigned long long seed)`: it runs a whole launch, every block and thread, and
// returns 0 (non-zero: an unknown kernel). The text after the tag is the library's path, a
// newline, then anything (`.entry name(` lines naming its kernels, so that cuModuleGetFunction
// finds them as in PTX).
#define HOST_IMAGE_TAG "//gpucomm-host-image "
typedef int (*HostLaunch)(const char *kernel, unsigned grid_x, unsigned block_x, void **params, unsigned long long seed);
// The library's launch entry for a host image (loaded once per path); NULL for any other image,
// and for a host image whose library cannot be loaded (*failed set then).
HostLaunch double_host_library(const unsigned char *image, int *failed);
// One launch to run: the kernel, its grid and block, and its parameters packed at `offsets`.
struct HostRun *double_host_run_new(HostLaunch launch, const char *name, unsigned grid_x, unsigned block_x,
                                    const unsigned char *packed, size_t bytes, const size_t *offsets, int count);
// Runs it now (returns CUDA_ERROR_LAUNCH_FAILED if the library refused it); frees nothing.
CUresult double_host_run(const struct HostRun *run);
void double_host_run_free(struct HostRun *run);

// Test-only: whether DRIVER_DOUBLE_FAIL names `entry`, which then fails in this process with
// CUDA_ERROR_OUT_OF_MEMORY (a rank whose driver refuses a call the others' make).
int double_fails(const char *entry);

// The device of the calling thread's current context, or -1 where none is current.
int double_current_device(void);
// The visible ordinal of a context's device (devices.c).
int double_context_device(CUcontext context);

// Device attributes another file answers (vmm.c: virtual memory, POSIX descriptors, multicast):
// 1 with *value set if it knows `attribute`, else 0.
int double_attribute(int attribute, int *value);

#endif
