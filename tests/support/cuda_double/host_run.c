// Host images: kernels built for the host, run by the double's launches (double.h, "Host images").
//
// With them a launch through gpucomm's launcher moves data on a host without a GPU: the launcher
// packs the parameters once, cuLaunchKernel hands the double the packed buffer, and the double
// calls the library's gpucomm_host_launch with a pointer to each parameter, as a GPU's driver hands
// them to the kernel. A launch runs to its end before cuLaunchKernel returns (a stream here is
// always idle), and a captured one runs at each replay of its graph, never at the capture.

#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "double.h"

enum { PATH_BYTES = 4096, LIBRARIES = 64, HOST_PARAMS = 64 };

struct HostRun {
    HostLaunch launch;
    char *name;
    unsigned grid_x, block_x;
    unsigned char *packed;
    int count;
    size_t offsets[HOST_PARAMS];
};

// Libraries loaded so far, by path: a module loaded twice shares one library (its kernels' static
// state too, as two modules of one image never do on a GPU; gpucomm loads each image once).
static struct {
    char *path;
    HostLaunch launch;
} libraries[LIBRARIES];
static pthread_mutex_t libraries_lock = PTHREAD_MUTEX_INITIALIZER;

// The seed of every launch: the blocks' order, which must be the same on every rank (blocks run one
// after the other, and block b of each rank waits for block b of its peers): GPUCOMM_CUDA_EMULATE_SEED
// as gpucomm's own host launches take it (gpucomm.config.cuda_emulation), 0 where unset.
static unsigned long long launch_seed(void) {
    const char *text = getenv("GPUCOMM_CUDA_EMULATE_SEED");
    return text != NULL && *text != '\0' ? strtoull(text, NULL, 10) : 0;
}

HostLaunch double_host_library(const unsigned char *image, int *failed) {
    *failed = 0;
    const size_t tag = strlen(HOST_IMAGE_TAG);
    if (strncmp((const char *)image, HOST_IMAGE_TAG, tag) != 0) return NULL;
    const char *path = (const char *)image + tag;
    const char *end = strchr(path, '\n');
    size_t length = end != NULL ? (size_t)(end - path) : strlen(path);
    if (length == 0 || length >= PATH_BYTES) {
        *failed = 1;
        return NULL;
    }
    char name[PATH_BYTES];
    memcpy(name, path, length);
    name[length] = '\0';
    HostLaunch found = NULL;
    pthread_mutex_lock(&libraries_lock);
    int i = 0;
    for (; i < LIBRARIES && libraries[i].path != NULL; i++) {
        if (strcmp(libraries[i].path, name) == 0) {
            found = libraries[i].launch;
            break;
        }
    }
    if (found == NULL && i < LIBRARIES) {
        void *library = dlopen(name, RTLD_NOW | RTLD_LOCAL);
        found = library != NULL ? (HostLaunch)dlsym(library, "gpucomm_host_launch") : NULL;
        if (found != NULL) {
            libraries[i].path = strdup(name);
            libraries[i].launch = found;
        }
        double_log("doubleHostImage", "path=%s loaded=%d", name, found != NULL);
    }
    pthread_mutex_unlock(&libraries_lock);
    *failed = found == NULL;
    return found;
}

struct HostRun *double_host_run_new(HostLaunch launch, const char *name, unsigned grid_x, unsigned block_x,
                                    const unsigned char *packed, size_t bytes, const size_t *offsets, int count) {
    if (count > HOST_PARAMS) return NULL;
    struct HostRun *run = calloc(1, sizeof *run);
    run->launch = launch;
    run->name = strdup(name);
    run->grid_x = grid_x;
    run->block_x = block_x;
    run->packed = malloc(bytes > 0 ? bytes : 1);
    memcpy(run->packed, packed, bytes);
    run->count = count;
    memcpy(run->offsets, offsets, sizeof(size_t) * (size_t)count);
    return run;
}

CUresult double_host_run(const struct HostRun *run) {
    void *params[HOST_PARAMS];
    for (int i = 0; i < run->count; i++) params[i] = run->packed + run->offsets[i];
    unsigned long long seed = launch_seed();
    int failed = run->launch(run->name, run->grid_x, run->block_x, params, seed);
    double_log("doubleHostRun", "name=%s grid=%u block=%u seed=%llu failed=%d", run->name, run->grid_x, run->block_x,
               seed, failed);
    return failed ? CUDA_ERROR_LAUNCH_FAILED : CUDA_SUCCESS;
}

void double_host_run_free(struct HostRun *run) {
    free(run->name);
    free(run->packed);
    free(run);
}
