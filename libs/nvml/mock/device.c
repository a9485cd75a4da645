/* Start-up, the system, GPUs and MIG devices as devices: identity, PCI, memory, topology,
 * NVLink, utilization, compute mode and processes. */
#include "mock.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

static int g_refcount;

/* The node file: GPUSLICE_NVML_MOCK_NODE, else NODE_FILE_NAME in the directory this library was
 * loaded from (dladdr), so a program that loads the mock from a driver root (the node pods'
 * /driver-root/usr/lib/x86_64-linux-gnu/) needs no variable. 0 when there is none. */
static int node_path(char *out, size_t size) {
    const char *env = getenv(NODE_ENV);
    if (env && *env) {
        snprintf(out, size, "%s", env);
        return 1;
    }
    Dl_info info;
    if (!dladdr((void *)&nvmlInitWithFlags, &info) || !info.dli_fname) return 0;
    const char *slash = strrchr(info.dli_fname, '/');
    if (!slash) return 0; /* loaded by a bare name: no directory to look in */
    snprintf(out, size, "%.*s/%s", (int)(slash - info.dli_fname), info.dli_fname, NODE_FILE_NAME);
    return 1;
}

static void fill_handles(void) {
    for (int g = 0; g < MAX_GPUS; g++) {
        g_gpu_handles[g] = (struct nvmlDevice_st){g, -1, -1};
        for (int gi = 0; gi < MAX_GI; gi++) {
            g_gi_handles[g][gi] = (struct nvmlGpuInstance_st){g, gi};
            for (int ci = 0; ci < MAX_CI; ci++) {
                g_mig_handles[g][gi][ci] = (struct nvmlDevice_st){g, gi, ci};
                g_ci_handles[g][gi][ci] = (struct nvmlComputeInstance_st){g, gi, ci};
            }
        }
    }
}

nvmlReturn_t DECLDIR nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (g_refcount == 0) {
        char path[4096];
        if (!node_path(path, sizeof path)) {
            fprintf(stderr, "mock libnvidia-ml: " NODE_ENV " is not set and the library's own "
                    "directory is unknown; write a node file with "
                    "`python -m gpuslice_nvml.mock --config <fake node config>`\n");
            rc = NVML_ERROR_DRIVER_NOT_LOADED;
        } else if ((rc = node_load(path, &g_node)) == NVML_SUCCESS) {
            fill_handles();
            jv *state = state_read(&rc); /* creates the state file when missing */
            json_free(state);
            if (rc != NVML_SUCCESS) {
                node_free(g_node);
                g_node = NULL;
            }
        }
    }
    if (rc == NVML_SUCCESS) g_refcount++;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

nvmlReturn_t DECLDIR nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t DECLDIR nvmlShutdown(void) {
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (g_refcount == 0) rc = NVML_ERROR_UNINITIALIZED;
    else if (--g_refcount == 0) {
        node_free(g_node);
        g_node = NULL;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

const DECLDIR char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt request issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Version mismatch between the library and the argument";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t put_text(char *buf, unsigned int length, const char *text) {
    if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER();
    LEAVE(put_text(version, length, g_node->driver_version));
}

nvmlReturn_t DECLDIR nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    ENTER();
    char text[96];
    snprintf(text, sizeof text, "%d.%s", NVML_API_VERSION, g_node->driver_version);
    LEAVE(put_text(version, length, text));
}

nvmlReturn_t DECLDIR nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    ENTER();
    if (!cudaDriverVersion) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *cudaDriverVersion = (int)g_node->cuda_driver_version;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

nvmlReturn_t DECLDIR nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    ENTER();
    if (!deviceCount) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *deviceCount = g_node->n_gpus;
    LEAVE(NVML_SUCCESS);
}

/* Read the state and check a device handle: the body of most getters. */
#define READ_DEVICE(device, state, gpu)                                 \
    nvmlReturn_t rc_;                                                   \
    jv *state = state_read(&rc_);                                       \
    int gpu = -1;                                                       \
    if (!state) LEAVE(rc_);                                             \
    if ((rc_ = check_device(device, state, &gpu)) != NVML_SUCCESS) {    \
        json_free(state);                                               \
        LEAVE(rc_);                                                     \
    }

static nvmlReturn_t live_gpu_handle(unsigned index, nvmlDevice_t *device) {
    nvmlReturn_t rc;
    jv *state = state_read(&rc);
    if (!state) return rc;
    rc = jbool(jget(gpu_state(state, (int)index), "lost"), 0) ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
    if (rc == NVML_SUCCESS) *device = &g_gpu_handles[index];
    json_free(state);
    return rc;
}

nvmlReturn_t DECLDIR nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    ENTER();
    if (!device || index >= g_node->n_gpus) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    LEAVE(live_gpu_handle(index, device));
}

nvmlReturn_t DECLDIR nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    ENTER();
    if (!uuid || !device) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned g = 0; g < g_node->n_gpus; g++)
        if (!strcmp(g_node->gpus[g].uuid, uuid)) LEAVE(live_gpu_handle(g, device));
    if (strncmp(uuid, "MIG-", 4)) LEAVE(NVML_ERROR_NOT_FOUND);
    nvmlReturn_t rc;
    jv *state = state_read(&rc);
    if (!state) LEAVE(rc);
    rc = NVML_ERROR_NOT_FOUND;
    for (unsigned g = 0; g < g_node->n_gpus && rc == NVML_ERROR_NOT_FOUND; g++) {
        jv *gs = gpu_state(state, (int)g);
        jv *gis = jget(gs, "gpuInstances");
        for (size_t i = 0; i < jlen(gis) && jbool(jget(gs, "migCurrent"), 0); i++) {
            jv *cis = jget(jat(gis, i), "computeInstances");
            long long gi = jint(jget(jat(gis, i), "id"), 0);
            for (size_t k = 0; k < jlen(cis); k++) {
                long long ci = jint(jget(jat(cis, k), "id"), 0);
                if (gi < MAX_GI && ci < MAX_CI && !strcmp(g_node->gpus[g].mig_uuid[gi][ci], uuid)) {
                    rc = jbool(jget(gs, "lost"), 0) ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
                    *device = &g_mig_handles[g][gi][ci];
                }
            }
        }
    }
    DONE(state, rc);
}

nvmlReturn_t DECLDIR nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    ENTER();
    unsigned domain, bus, dev, fn = 0;
    if (!pciBusId || !device || sscanf(pciBusId, "%x:%x:%x.%x", &domain, &bus, &dev, &fn) < 3)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned g = 0; g < g_node->n_gpus; g++) {
        const gpu_facts *f = &g_node->gpus[g];
        if (f->domain == domain && f->bus == bus && f->device == dev && f->function == fn)
            LEAVE(live_gpu_handle(g, device));
    }
    LEAVE(NVML_ERROR_NOT_FOUND);
}

/* MIG device (GPU instance, compute instance) state and profiles, for a MIG handle. */
static void mig_profiles(jv *state, nvmlDevice_t device, const gi_profile **gp, const ci_profile **cp) {
    jv *gi = find_gi(gpu_state(state, device->gpu), (unsigned)device->gi, NULL);
    jv *ci = find_ci(gi, (unsigned)device->ci, NULL);
    *gp = profile_by_id(&g_node->gpus[device->gpu], (unsigned)jint(jget(gi, "profileId"), 0));
    *cp = NULL;
    for (unsigned i = 0; *gp && i < (*gp)->n_ci; i++)
        if ((*gp)->ci[i].id == (unsigned)jint(jget(ci, "profileId"), 0)) *cp = &(*gp)->ci[i];
}

nvmlReturn_t DECLDIR nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    const char *text = device->gi >= 0 ? g_node->gpus[gpu].mig_uuid[device->gi][device->ci]
                                       : g_node->gpus[gpu].uuid;
    DONE(state, put_text(uuid, length, text));
}

nvmlReturn_t DECLDIR nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    char text[192];
    snprintf(text, sizeof text, "%s", g_node->gpus[gpu].name);
    if (device->gi >= 0) {
        const gi_profile *gp;
        const ci_profile *cp;
        mig_profiles(state, device, &gp, &cp);
        snprintf(text, sizeof text, "%s MIG %s", g_node->gpus[gpu].name, cp ? cp->name : "");
    }
    DONE(state, put_text(name, length, text));
}

#define GPU_ONLY(device, state) \
    if (device->gi >= 0) DONE(state, NVML_ERROR_NOT_SUPPORTED)

nvmlReturn_t DECLDIR nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    if (!type) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *type = (nvmlBrandType_t)g_node->gpus[gpu].brand;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetArchitecture(nvmlDevice_t device, nvmlDeviceArchitecture_t *arch) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    if (!arch) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *arch = g_node->gpus[gpu].architecture;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    if (!index) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned)gpu;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    GPU_ONLY(device, state);
    if (!minorNumber) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *minorNumber = (unsigned)gpu; /* as the fake: /dev/nvidia<index> */
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    if (!pci) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    const gpu_facts *f = &g_node->gpus[gpu];
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT,
             f->domain & 0xFFFF, f->bus, f->device);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", f->domain, f->bus, f->device,
             f->function);
    pci->domain = f->domain;
    pci->bus = f->bus;
    pci->device = f->device;
    pci->pciDeviceId = f->pci_device_id;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    if (!major || !minor) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *major = (int)g_node->gpus[gpu].cc_major;
    *minor = (int)g_node->gpus[gpu].cc_minor;
    DONE(state, NVML_SUCCESS);
}

/* Like the H100 driver the project met: only MIG device handles answer; a whole GPU's SM count
 * comes from nvmlDeviceGetNumGpuCores. */
nvmlReturn_t DECLDIR nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    if (!attributes) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (device->gi < 0) DONE(state, NVML_ERROR_NOT_SUPPORTED);
    const gi_profile *gp;
    const ci_profile *cp;
    mig_profiles(state, device, &gp, &cp);
    if (!gp || !cp) DONE(state, NVML_ERROR_UNKNOWN);
    memset(attributes, 0, sizeof *attributes);
    attributes->multiprocessorCount = cp->multiprocessors;
    attributes->sharedCopyEngineCount = gp->copy_engines;
    attributes->sharedDecoderCount = gp->decoders;
    attributes->sharedEncoderCount = gp->encoders;
    attributes->sharedJpegCount = gp->jpeg_decoders;
    attributes->sharedOfaCount = gp->ofa_engines;
    attributes->gpuInstanceSliceCount = gp->slice_count;
    attributes->computeInstanceSliceCount = cp->slice_count;
    attributes->memorySizeMB = gp->memory_mib;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetNumGpuCores(nvmlDevice_t device, unsigned int *numCores) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    GPU_ONLY(device, state);
    if (!numCores) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (!g_node->gpus[gpu].gpu_cores) DONE(state, NVML_ERROR_NOT_SUPPORTED);
    *numCores = g_node->gpus[gpu].gpu_cores;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    if (!node) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (g_node->gpus[gpu].numa_node < 0) DONE(state, NVML_ERROR_NOT_SUPPORTED);
    *node = (unsigned)g_node->gpus[gpu].numa_node;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetAddressingMode(nvmlDevice_t device, nvmlDeviceAddressingMode_t *mode) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    if (!mode) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (g_node->gpus[gpu].addressing_mode < 0) DONE(state, NVML_ERROR_NOT_SUPPORTED);
    if (mode->version != nvmlDeviceAddressingMode_v1) DONE(state, NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    mode->value = (unsigned)g_node->gpus[gpu].addressing_mode;
    DONE(state, NVML_SUCCESS);
}

/* Memory: a GPU's framebuffer, or its GPU instance's for a MIG device; used is what the live
 * processes on it hold (the compute instances of one GPU instance share its memory). */
static void memory_of(jv *state, nvmlDevice_t device, unsigned long long *total, unsigned long long *used) {
    const gpu_facts *f = &g_node->gpus[device->gpu];
    *total = f->memory_mib * MIB;
    if (device->gi >= 0) {
        const gi_profile *gp;
        const ci_profile *cp;
        mig_profiles(state, device, &gp, &cp);
        *total = gp ? gp->memory_mib * MIB : 0;
    }
    *used = 0;
    jv *procs = jget(state, "processes");
    for (size_t i = 0; i < jlen(procs); i++) {
        jv *p = jat(procs, i);
        if (jint(jget(p, "gpu"), -1) != device->gpu || !process_live(p)) continue;
        if (device->gi >= 0 && jint(jget(p, "gpuInstanceId"), -1) != device->gi) continue;
        *used += (unsigned long long)jint(jget(p, "usedMemory"), 0);
    }
    if (*used > *total) *used = *total;
}

nvmlReturn_t DECLDIR nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    if (!memory) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    memory_of(state, device, &memory->total, &memory->used);
    memory->free = memory->total - memory->used;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    if (!memory) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != nvmlMemory_v2) DONE(state, NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory_of(state, device, &memory->total, &memory->used);
    memory->reserved = 0;
    memory->free = memory->total - memory->used;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    GPU_ONLY(device, state);
    if (!utilization) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (jbool(jget(gpu_state(state, gpu), "migCurrent"), 0)) DONE(state, NVML_ERROR_NOT_SUPPORTED);
    long long sm = 0, mem = 0;
    jv *procs = jget(state, "processes");
    for (size_t i = 0; i < jlen(procs); i++) {
        jv *p = jat(procs, i);
        if (jint(jget(p, "gpu"), -1) != gpu || !process_live(p)) continue;
        sm += jint(jget(p, "smPercent"), 0);
        mem += jint(jget(p, "memoryPercent"), 0);
    }
    utilization->gpu = (unsigned)(sm > 100 ? 100 : sm);
    utilization->memory = (unsigned)(mem > 100 ? 100 : mem);
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                         nvmlGpuTopologyLevel_t *pathInfo) {
    ENTER();
    READ_DEVICE(device1, state, gpu);
    int other = -1;
    nvmlReturn_t rc = check_device(device2, state, &other);
    if (rc != NVML_SUCCESS) DONE(state, rc);
    if (!pathInfo || device1->gi >= 0 || device2->gi >= 0) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *pathInfo = (nvmlGpuTopologyLevel_t)g_node->gpus[gpu].topology[other];
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    GPU_ONLY(device, state);
    if (!isActive || link >= NVML_NVLINK_MAX_LINKS) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (!g_node->gpus[gpu].n_links) DONE(state, NVML_ERROR_NOT_SUPPORTED);
    *isActive = link < g_node->gpus[gpu].n_links ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    GPU_ONLY(device, state);
    const gpu_facts *f = &g_node->gpus[gpu];
    if (!pci || link >= NVML_NVLINK_MAX_LINKS) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (!f->n_links) DONE(state, NVML_ERROR_NOT_SUPPORTED);
    if (link >= f->n_links) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    const gpu_facts *peer = &g_node->gpus[f->link_peer[link]];
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT,
             peer->domain & 0xFFFF, peer->bus, peer->device);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", peer->domain, peer->bus,
             peer->device, peer->function);
    pci->domain = peer->domain;
    pci->bus = peer->bus;
    pci->device = peer->device;
    pci->pciDeviceId = peer->pci_device_id;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                         nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    GPU_ONLY(device, state);
    if (!pNvLinkDeviceType || link >= g_node->gpus[gpu].n_links) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *pNvLinkDeviceType = NVML_NVLINK_DEVICE_TYPE_GPU; /* the fake wires GPUs directly */
    DONE(state, NVML_SUCCESS);
}

/* nvmlComputeMode_t by the names the fake stores. */
static const char *const COMPUTE_MODES[] = {"DEFAULT", "EXCLUSIVE_THREAD", "PROHIBITED", "EXCLUSIVE_PROCESS"};

nvmlReturn_t DECLDIR nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    GPU_ONLY(device, state);
    if (!mode) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    const char *name = jstr(jget(gpu_state(state, gpu), "computeMode"), "DEFAULT");
    for (int m = 0; m < 4; m++)
        if (!strcmp(name, COMPUTE_MODES[m])) {
            *mode = (nvmlComputeMode_t)m;
            DONE(state, NVML_SUCCESS);
        }
    DONE(state, NVML_ERROR_UNKNOWN);
}

nvmlReturn_t DECLDIR nvmlDeviceSetComputeMode(nvmlDevice_t device, nvmlComputeMode_t mode) {
    ENTER();
    if ((unsigned)mode >= 4) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    int fd, gpu = -1;
    nvmlReturn_t rc;
    jv *state = state_begin(&fd, &rc);
    if (!state) LEAVE(rc);
    if ((rc = check_device(device, state, &gpu)) == NVML_SUCCESS && device->gi >= 0) rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc != NVML_SUCCESS) {
        state_abort(fd, state);
        LEAVE(rc);
    }
    jset(gpu_state(state, gpu), "computeMode", jnew_str(COMPUTE_MODES[mode]));
    LEAVE(state_commit(fd, state));
}

/* Processes. Like the driver (seen on an H100 under MPS), the compute list has every process
 * with a CUDA context on the device, MPS clients included; the MPS list has the clients only. */
static nvmlReturn_t list_processes(nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos,
                                   int mps_only) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    if (!infoCount) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    unsigned n = 0;
    jv *procs = jget(state, "processes");
    for (size_t i = 0; i < jlen(procs); i++) {
        jv *p = jat(procs, i);
        if (jint(jget(p, "gpu"), -1) != gpu || !process_live(p)) continue;
        if (mps_only && !jbool(jget(p, "mpsClient"), 0)) continue;
        long long gi = jint(jget(p, "gpuInstanceId"), -1), ci = jint(jget(p, "computeInstanceId"), -1);
        if (device->gi >= 0 && (gi != device->gi || ci != device->ci)) continue;
        if (infos && n < *infoCount) {
            infos[n].pid = (unsigned)jint(jget(p, "pid"), 0);
            infos[n].usedGpuMemory = (unsigned long long)jint(jget(p, "usedMemory"), 0);
            infos[n].gpuInstanceId = gi < 0 ? NO_ID : (unsigned)gi;
            infos[n].computeInstanceId = ci < 0 ? NO_ID : (unsigned)ci;
        }
        n++;
    }
    nvmlReturn_t rc = n > *infoCount ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    if (rc == NVML_SUCCESS && n && !infos) rc = NVML_ERROR_INVALID_ARGUMENT;
    *infoCount = n;
    DONE(state, rc);
}

nvmlReturn_t DECLDIR nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                             nvmlProcessInfo_t *infos) {
    return list_processes(device, infoCount, infos, 0);
}

nvmlReturn_t DECLDIR nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                nvmlProcessInfo_t *infos) {
    return list_processes(device, infoCount, infos, 1);
}

/* Samples as the fake's configured figures: one per process with a context of its own (MPS
 * clients have none; their server has) that uses SM or memory, stamped with the driver's last
 * sample time (utilizationSampleMs) or now. */
nvmlReturn_t DECLDIR nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                     unsigned int *processSamplesCount,
                                                     unsigned long long lastSeenTimeStamp) {
    ENTER();
    READ_DEVICE(device, state, gpu);
    GPU_ONLY(device, state);
    if (!processSamplesCount) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (jbool(jget(gpu_state(state, gpu), "migCurrent"), 0)) DONE(state, NVML_ERROR_NOT_SUPPORTED);
    struct timeval tv;
    gettimeofday(&tv, NULL);
    unsigned long long now = (unsigned long long)tv.tv_sec * 1000000ULL + (unsigned long long)tv.tv_usec;
    unsigned long long period = (unsigned long long)g_node->utilization_sample_ms * 1000ULL;
    if (period) now -= now % period;
    unsigned n = 0;
    jv *procs = jget(state, "processes");
    for (size_t i = 0; i < jlen(procs) && now > lastSeenTimeStamp; i++) {
        jv *p = jat(procs, i);
        long long sm = jint(jget(p, "smPercent"), 0), mem = jint(jget(p, "memoryPercent"), 0);
        if (jint(jget(p, "gpu"), -1) != gpu || !process_live(p) || jbool(jget(p, "mpsClient"), 0) || !(sm || mem))
            continue;
        if (utilization && n < *processSamplesCount) {
            memset(&utilization[n], 0, sizeof utilization[n]);
            utilization[n].pid = (unsigned)jint(jget(p, "pid"), 0);
            utilization[n].timeStamp = now;
            utilization[n].smUtil = (unsigned)sm;
            utilization[n].memUtil = (unsigned)mem;
        }
        n++;
    }
    nvmlReturn_t rc = !n ? NVML_ERROR_NOT_FOUND
                         : (!utilization || n > *processSamplesCount) ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    *processSamplesCount = n;
    DONE(state, rc);
}
