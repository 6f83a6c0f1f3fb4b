// The driver double's node: its GPUs, what each process sees of them, their attributes and UUIDs,
// which pairs reach each other, and each visible device's primary context.
//
// The node is read from the environment when the library loads (each rank process loads its own):
// - DRIVER_DOUBLE_GPUS: how many GPUs the node has (default 8, at most MAX_GPUS);
// - DRIVER_DOUBLE_SMS, DRIVER_DOUBLE_CC: each GPU's SM count and compute capability (default 132
//   and "9.0": an H100 SXM);
// - DRIVER_DOUBLE_LINKS: how GPUs reach each other: "nvswitch" (default; an HGX node: peer access
//   and native peer atomics between every pair), "pcie" (peer access, no native peer atomics) or
//   "none" (no peer access);
// - DRIVER_DOUBLE_GPU_UUID: GPU 0's UUID (32 hex digits), so that test processes can each have a
//   node of their own or share one; GPU g's is GPU 0's with g folded into its last two bytes;
// - CUDA_VISIBLE_DEVICES: the GPUs this process sees, as the driver reads it: a comma-separated
//   list of the node's ordinals, cut at the first entry that is not one (or repeats one); visible
//   device d is the list's d-th GPU. Unset: every GPU, in order. UUID entries are not modelled.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "double.h"

enum { MAX_GPUS = 64, LINKS_NONE = 0, LINKS_PCIE = 1, LINKS_NVSWITCH = 2 };

struct DoubleContext {
    int device;  // the visible ordinal (what the process calls it)
    int gpu;  // the node's GPU it is
};

static struct {
    int gpus, sms, major, minor, links;
    int visible;  // devices this process sees
    int gpu_of[MAX_GPUS];  // visible ordinal -> the node's GPU
    struct DoubleContext primary[MAX_GPUS];
} node;

static int env_int(const char *name, int fallback, int low, int high) {
    const char *text = getenv(name);
    if (text == NULL || text[0] == '\0') return fallback;
    char *end;
    long value = strtol(text, &end, 10);
    return *end == '\0' && value >= low && value <= high ? (int)value : fallback;
}

static void read_visible(void) {
    const char *list = getenv("CUDA_VISIBLE_DEVICES");
    node.visible = 0;
    if (list == NULL) {
        for (int g = 0; g < node.gpus; g++) node.gpu_of[node.visible++] = g;
        return;
    }
    const char *at = list;
    while (*at != '\0' && node.visible < MAX_GPUS) {
        char *end;
        long g = strtol(at, &end, 10);
        if (end == at || (*end != ',' && *end != '\0') || g < 0 || g >= node.gpus) return;
        for (int i = 0; i < node.visible; i++)
            if (node.gpu_of[i] == g) return;
        node.gpu_of[node.visible++] = (int)g;
        at = *end == ',' ? end + 1 : end;
    }
}

__attribute__((constructor)) static void devices_load(void) {
    node.gpus = env_int("DRIVER_DOUBLE_GPUS", 8, 1, MAX_GPUS);
    node.sms = env_int("DRIVER_DOUBLE_SMS", 132, 1, 1 << 16);
    node.major = 9, node.minor = 0;
    const char *cc = getenv("DRIVER_DOUBLE_CC");
    if (cc != NULL && sscanf(cc, "%d.%d", &node.major, &node.minor) != 2) node.major = 9, node.minor = 0;
    const char *links = getenv("DRIVER_DOUBLE_LINKS");
    node.links = links == NULL || strcmp(links, "nvswitch") == 0 ? LINKS_NVSWITCH
                 : strcmp(links, "pcie") == 0                   ? LINKS_PCIE
                                                                 : LINKS_NONE;
    read_visible();
    for (int d = 0; d < node.visible; d++) node.primary[d] = (struct DoubleContext){d, node.gpu_of[d]};
}

static int known_device(CUdevice device) { return device >= 0 && device < node.visible; }

int double_context_device(CUcontext context) { return context->device; }

DOUBLE_API CUresult cuDeviceGetCount(int *count) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    *count = node.visible;
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (!known_device(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuDeviceGetName(char *name, int length, CUdevice device) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (!known_device(device) || length <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)length, "gpucomm driver double GPU %d (sm_%d%d)", node.gpu_of[device], node.major, node.minor);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuDeviceGetPCIBusId(char *bus, int length, CUdevice device) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (!known_device(device) || length <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(bus, (size_t)length, "0000:%02X:00.0", 0x18 + 0x10 * node.gpu_of[device]);
    return CUDA_SUCCESS;
}

typedef struct {
    char bytes[16];
} CUuuid;

// GPU g's UUID is GPU 0's with g's low bit in the last byte's high bit and the rest in the byte
// before: GPU 1's is GPU 0's with its last byte's high bit flipped, as when the double had two.
DOUBLE_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice device) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (!known_device(device) || uuid == NULL) return CUDA_ERROR_INVALID_VALUE;
    const char *hex = getenv("DRIVER_DOUBLE_GPU_UUID");
    for (int i = 0; i < 16; i++) {
        unsigned byte = 0x60 + (unsigned)i;
        if (hex != NULL && strlen(hex) == 32) sscanf(hex + 2 * i, "%2x", &byte);
        uuid->bytes[i] = (char)byte;
    }
    int gpu = node.gpu_of[device];
    uuid->bytes[15] = (char)(uuid->bytes[15] ^ ((gpu & 1) << 7));
    uuid->bytes[14] = (char)(uuid->bytes[14] ^ (gpu >> 1));
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice device) { return cuDeviceGetUuid_v2(uuid, device); }

// Attributes by cuda.h's numbering; the ones not listed read 0.
DOUBLE_API CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (!known_device(device) || value == NULL) return CUDA_ERROR_INVALID_VALUE;
    switch (attribute) {
        case 1: *value = 1024; break;  // MAX_THREADS_PER_BLOCK
        case 8: *value = 49152; break;  // MAX_SHARED_MEMORY_PER_BLOCK
        case 10: *value = 32; break;  // WARP_SIZE
        case 16: *value = node.sms; break;  // MULTIPROCESSOR_COUNT
        case 33: *value = 0x18 + 0x10 * node.gpu_of[device]; break;  // PCI_BUS_ID
        case 75: *value = node.major; break;  // COMPUTE_CAPABILITY_MAJOR
        case 76: *value = node.minor; break;  // COMPUTE_CAPABILITY_MINOR
        case 97: *value = 232448; break;  // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        default:
            if (!double_attribute(attribute, value)) *value = 0;
    }
    return CUDA_SUCCESS;
}

// -- peers: every pair alike, by DRIVER_DOUBLE_LINKS ---------------------------------------------
DOUBLE_API CUresult cuDeviceCanAccessPeer(int *can, CUdevice device, CUdevice peer) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (!known_device(device) || !known_device(peer) || can == NULL) return CUDA_ERROR_INVALID_DEVICE;
    *can = device != peer && node.links != LINKS_NONE;
    return CUDA_SUCCESS;
}

// cuda.h's CUdevice_P2PAttribute: 1 performance rank, 2 access supported, 3 native atomics
// supported, 4 CUDA array access supported. A device with itself is an invalid pair, as the driver has it.
DOUBLE_API CUresult cuDeviceGetP2PAttribute(int *value, int attribute, CUdevice src, CUdevice dst) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (!known_device(src) || !known_device(dst) || src == dst || value == NULL) return CUDA_ERROR_INVALID_DEVICE;
    switch (attribute) {
        case 1: *value = 0; break;
        case 2:
        case 4: *value = node.links != LINKS_NONE; break;
        case 3: *value = node.links == LINKS_NVSWITCH; break;
        default: return CUDA_ERROR_INVALID_VALUE;
    }
    double_log("cuDeviceGetP2PAttribute", "attribute=%d src=%d dst=%d value=%d", attribute, src, dst, *value);
    return CUDA_SUCCESS;
}

// -- primary contexts, one per visible device ------------------------------------------------------
// Retaining one records the visible ordinal and the node's GPU it is (gpu=), so that a test sees
// which physical GPU each rank's context is on whatever the process can see.
DOUBLE_API CUresult cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device) {
    if (!double_initialised()) return CUDA_ERROR_NOT_INITIALIZED;
    if (!known_device(device)) return CUDA_ERROR_INVALID_DEVICE;
    *context = &node.primary[device];
    double_log("cuDevicePrimaryCtxRetain", "device=%d gpu=%d", device, node.gpu_of[device]);
    return CUDA_SUCCESS;
}

DOUBLE_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    return known_device(device) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}
