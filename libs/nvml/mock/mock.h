/* The mock libnvidia-ml's internals: the node (static facts from the node file written by
 * gpuslice_nvml.mock), the shared state file (the fake's, read and written under flock), the
 * handle tables and the library lock. Every public entry point takes the lock with ENTER and
 * leaves with LEAVE; helpers here assume it is held. */
#ifndef GPUSLICE_MOCK_H
#define GPUSLICE_MOCK_H

#include <pthread.h>

#include "json.h"
#include "nvml.h"

#define MAX_GPUS 16
#define MAX_GI 15 /* GPU-instance ids 0..14: the memory-slice tree */
#define MAX_CI 8
#define MAX_PROFILES 18
#define MAX_PLACEMENTS 16
#define COMPUTE_SLICES 7
#define NO_ID 0xFFFFFFFFu
#define MIB (1024ULL * 1024ULL)
#define NODE_ENV "GPUSLICE_NVML_MOCK_NODE"
/* Without NODE_ENV: the node file next to the library itself (a driver root of files). */
#define NODE_FILE_NAME "gpuslice-nvml-mock-node.json"
#define NODE_FORMAT_VERSION 1
#define STATE_SCHEMA_VERSION 1

typedef struct { unsigned start, size; } placement;

typedef struct {
    unsigned nvml_profile, id, slice_count, instance_count, multiprocessors;
    char name[64];
    unsigned n_placements;
    placement placements[MAX_PLACEMENTS];
} ci_profile;

typedef struct {
    unsigned nvml_profile, id, slice_count, memory_slices, instance_count, multiprocessors;
    unsigned long long memory_mib;
    unsigned copy_engines, decoders, encoders, jpeg_decoders, ofa_engines, p2p;
    char name[64];
    unsigned n_placements;
    placement placements[MAX_PLACEMENTS];
    unsigned n_ci;
    ci_profile ci[9];
} gi_profile;

typedef struct {
    char uuid[96], name[96], bus_id[32];
    unsigned brand, architecture, cc_major, cc_minor, multiprocessors, gpu_cores;
    unsigned long long memory_mib;
    unsigned domain, bus, device, function, pci_device_id;
    int numa_node, addressing_mode, mig_capable;
    int topology[MAX_GPUS];
    unsigned n_links;
    int link_peer[NVML_NVLINK_MAX_LINKS]; /* GPU index at the far end */
    unsigned n_profiles;
    gi_profile profiles[MAX_PROFILES];
    char mig_uuid[MAX_GI][MAX_CI][96];
} gpu_facts;

typedef struct {
    char digest[80], driver_version[80], state_path[4096], lock_path[4200];
    long long cuda_driver_version, utilization_sample_ms;
    unsigned n_gpus;
    gpu_facts gpus[MAX_GPUS];
    jv *initial_state;
} node_facts;

/* Handles: pointers into fixed tables, valid from nvmlInit to the last nvmlShutdown. */
struct nvmlDevice_st { int gpu, gi, ci; }; /* gi = ci = -1: the whole GPU */
struct nvmlGpuInstance_st { int gpu, gi; };
struct nvmlComputeInstance_st { int gpu, gi, ci; };

extern pthread_mutex_t g_lock;
extern node_facts *g_node;
extern struct nvmlDevice_st g_gpu_handles[MAX_GPUS];
extern struct nvmlDevice_st g_mig_handles[MAX_GPUS][MAX_GI][MAX_CI];
extern struct nvmlGpuInstance_st g_gi_handles[MAX_GPUS][MAX_GI];
extern struct nvmlComputeInstance_st g_ci_handles[MAX_GPUS][MAX_GI][MAX_CI];

#define ENTER()                                          \
    do {                                                 \
        pthread_mutex_lock(&g_lock);                     \
        if (!g_node) {                                   \
            pthread_mutex_unlock(&g_lock);               \
            return NVML_ERROR_UNINITIALIZED;             \
        }                                                \
    } while (0)
#define LEAVE(rc)                                        \
    do {                                                 \
        nvmlReturn_t leave_rc_ = (rc);                   \
        pthread_mutex_unlock(&g_lock);                   \
        return leave_rc_;                                \
    } while (0)

/* node.c: the node file and the state file */
nvmlReturn_t node_load(const char *path, node_facts **out);
void node_free(node_facts *node);
/* The current state, or NULL with *rc set (created from the initial state when missing). */
jv *state_read(nvmlReturn_t *rc);
/* Lock exclusively and load; state_commit writes it back and unlocks, state_abort unlocks. */
jv *state_begin(int *lock_fd, nvmlReturn_t *rc);
nvmlReturn_t state_commit(int lock_fd, jv *state);
void state_abort(int lock_fd, jv *state);

/* State lookups; all take the parsed state. */
jv *gpu_state(jv *state, int gpu);
jv *find_gi(jv *gpu_st, unsigned gi_id, size_t *index);
jv *find_ci(jv *gi_st, unsigned ci_id, size_t *index);
int process_live(const jv *process);
const gi_profile *profile_by_id(const gpu_facts *gpu, unsigned id);
const gi_profile *profile_by_enum(const gpu_facts *gpu, unsigned nvml_profile);

/* Handle checks: NVML_SUCCESS with the GPU's index, or the error for a bad/lost handle. */
nvmlReturn_t check_device(nvmlDevice_t device, jv *state, int *gpu);
int is_gpu_handle(nvmlDevice_t device);
int is_mig_handle(nvmlDevice_t device);

/* mig.c: the layout helpers compute.c shares. */
int overlaps(placement a, placement b);
placement placement_of(const jv *inst);
nvmlReturn_t check_gi(nvmlGpuInstance_t handle, jv *state, jv **gi, const gi_profile **gp);
nvmlReturn_t put_placements(const placement *list, unsigned n, void *out, unsigned int *count);
unsigned free_placements(const placement *all, unsigned n, jv *list, placement *out);
unsigned count_profile(jv *list, unsigned profile_id);
void max_disjoint(const placement *c, unsigned n, unsigned from, placement *chosen, unsigned k,
                  unsigned limit, unsigned *best);
jv *new_instance(unsigned id, unsigned profile_id, placement pl, int with_cis);
int insert_sorted(jv *list, jv *inst);
int busy(jv *state, int gpu, long long gi, long long ci); /* a process runs in the instance */

/* Getter bodies: the state read once, freed on every way out. */
#define READ_STATE(state)             \
    nvmlReturn_t rc;                  \
    jv *state = state_read(&rc);      \
    if (!state) LEAVE(rc)
#define DONE(state, value)  \
    do {                    \
        json_free(state);   \
        LEAVE(value);       \
    } while (0)

#endif
