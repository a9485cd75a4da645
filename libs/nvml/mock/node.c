/* The node file (static facts) and the fake node's shared state file.
 *
 * The state file protocol is gpuslice_nvml.fake.state's: <state>.lock is flock'ed exclusively
 * to change the state, the JSON is read whole, and a change is written to a temp file in the
 * same directory, fsync'ed and renamed over the state. A read takes no lock (the rename means it
 * sees a whole file): a client the enforcer froze while it held the lock must not stop the
 * watchdog's sample that would thaw it. A missing state, or one made from
 * another config or schema, starts over from the node file's initialState with the event
 * numbers carried on, as StateStore._fresh does. */
#include "mock.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
node_facts *g_node;
struct nvmlDevice_st g_gpu_handles[MAX_GPUS];
struct nvmlDevice_st g_mig_handles[MAX_GPUS][MAX_GI][MAX_CI];
struct nvmlGpuInstance_st g_gi_handles[MAX_GPUS][MAX_GI];
struct nvmlComputeInstance_st g_ci_handles[MAX_GPUS][MAX_GI][MAX_CI];

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        char *bigger = realloc(buf, cap *= 2);
        if (!bigger) { free(buf); buf = NULL; }
        else buf = bigger;
    }
    fclose(f);
    if (len) *len = n;
    return buf;
}

static void copy_str(char *dst, size_t size, const jv *v) {
    snprintf(dst, size, "%s", jstr(v, ""));
}

static unsigned read_placements(const jv *list, placement *out) {
    unsigned n = 0;
    for (size_t i = 0; i < jlen(list) && n < MAX_PLACEMENTS; i++, n++) {
        out[n].start = (unsigned)jint(jat(jat(list, i), 0), 0);
        out[n].size = (unsigned)jint(jat(jat(list, i), 1), 0);
    }
    return n;
}

static void read_profile(const jv *p, gi_profile *gp) {
    gp->nvml_profile = (unsigned)jint(jget(p, "nvmlProfile"), 0);
    gp->id = (unsigned)jint(jget(p, "id"), 0);
    copy_str(gp->name, sizeof gp->name, jget(p, "name"));
    gp->slice_count = (unsigned)jint(jget(p, "sliceCount"), 0);
    gp->memory_slices = (unsigned)jint(jget(p, "memorySlices"), 0);
    gp->instance_count = (unsigned)jint(jget(p, "instanceCount"), 0);
    gp->multiprocessors = (unsigned)jint(jget(p, "multiprocessors"), 0);
    gp->memory_mib = (unsigned long long)jint(jget(p, "memoryMib"), 0);
    gp->copy_engines = (unsigned)jint(jget(p, "copyEngines"), 0);
    gp->decoders = (unsigned)jint(jget(p, "decoders"), 0);
    gp->encoders = (unsigned)jint(jget(p, "encoders"), 0);
    gp->jpeg_decoders = (unsigned)jint(jget(p, "jpegDecoders"), 0);
    gp->ofa_engines = (unsigned)jint(jget(p, "ofaEngines"), 0);
    gp->p2p = (unsigned)jbool(jget(p, "p2pSupported"), 0);
    gp->n_placements = read_placements(jget(p, "placements"), gp->placements);
    jv *cis = jget(p, "ciProfiles");
    for (size_t k = 0; k < jlen(cis) && gp->n_ci < 9; k++) {
        const jv *c = jat(cis, k);
        ci_profile *cp = &gp->ci[gp->n_ci++];
        cp->nvml_profile = (unsigned)jint(jget(c, "nvmlProfile"), 0);
        cp->id = (unsigned)jint(jget(c, "id"), 0);
        copy_str(cp->name, sizeof cp->name, jget(c, "name"));
        cp->slice_count = (unsigned)jint(jget(c, "sliceCount"), 0);
        cp->instance_count = (unsigned)jint(jget(c, "instanceCount"), 0);
        cp->multiprocessors = (unsigned)jint(jget(c, "multiprocessors"), 0);
        cp->n_placements = read_placements(jget(c, "placements"), cp->placements);
    }
}

static void read_gpu(const jv *g, gpu_facts *gf, const jv *gpus) {
    copy_str(gf->uuid, sizeof gf->uuid, jget(g, "uuid"));
    copy_str(gf->name, sizeof gf->name, jget(g, "name"));
    copy_str(gf->bus_id, sizeof gf->bus_id, jget(g, "pciBusId"));
    sscanf(gf->bus_id, "%x:%x:%x.%x", &gf->domain, &gf->bus, &gf->device, &gf->function);
    gf->brand = (unsigned)jint(jget(g, "brand"), 0);
    gf->architecture = (unsigned)jint(jget(g, "architecture"), 0);
    gf->cc_major = (unsigned)jint(jget(g, "ccMajor"), 0);
    gf->cc_minor = (unsigned)jint(jget(g, "ccMinor"), 0);
    gf->multiprocessors = (unsigned)jint(jget(g, "multiprocessors"), 0);
    gf->gpu_cores = (unsigned)jint(jget(g, "gpuCores"), 0);
    gf->memory_mib = (unsigned long long)jint(jget(g, "memoryMib"), 0);
    gf->pci_device_id = (unsigned)jint(jget(g, "pciDeviceId"), 0);
    gf->numa_node = (int)jint(jget(g, "numaNode"), -1);
    gf->addressing_mode = (int)jint(jget(g, "addressingMode"), -1);
    gf->mig_capable = jbool(jget(g, "migCapable"), 0);
    for (size_t i = 0; i < MAX_GPUS; i++) gf->topology[i] = (int)jint(jat(jget(g, "topology"), i), 50);
    jv *peers = jget(g, "nvlinkPeers");
    for (size_t i = 0; i < jlen(peers) && gf->n_links < NVML_NVLINK_MAX_LINKS; i++) {
        const char *bus = jstr(jat(peers, i), "");
        for (size_t k = 0; k < jlen(gpus); k++)
            if (!strcmp(jstr(jget(jat(gpus, k), "pciBusId"), ""), bus))
                gf->link_peer[gf->n_links++] = (int)k;
    }
    jv *profiles = jget(g, "giProfiles");
    for (size_t i = 0; i < jlen(profiles) && gf->n_profiles < MAX_PROFILES; i++)
        read_profile(jat(profiles, i), &gf->profiles[gf->n_profiles++]);
    jv *uuids = jget(g, "migUuids");
    for (size_t gi = 0; gi < MAX_GI; gi++)
        for (size_t ci = 0; ci < MAX_CI; ci++)
            copy_str(gf->mig_uuid[gi][ci], sizeof gf->mig_uuid[gi][ci], jat(jat(uuids, gi), ci));
}

nvmlReturn_t node_load(const char *path, node_facts **out) {
    size_t len;
    char *text = read_file(path, &len);
    if (!text) {
        fprintf(stderr, "mock libnvidia-ml: cannot read the node file %s: %s (set " NODE_ENV
                " or put " NODE_FILE_NAME " next to the library)\n", path, strerror(errno));
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    jv *doc = json_parse(text, len);
    free(text);
    if (!doc) {
        fprintf(stderr, "mock libnvidia-ml: the node file %s is not JSON\n", path);
        return NVML_ERROR_CORRUPTED_INFOROM;
    }
    if (jint(jget(doc, "formatVersion"), 0) != NODE_FORMAT_VERSION ||
        jint(jget(doc, "stateSchemaVersion"), 0) != STATE_SCHEMA_VERSION) {
        fprintf(stderr, "mock libnvidia-ml: %s is node file format %lld (state schema %lld); this "
                "library reads format %d (schema %d): rebuild it with hack/nvml-mock.sh\n", path,
                jint(jget(doc, "formatVersion"), 0), jint(jget(doc, "stateSchemaVersion"), 0),
                NODE_FORMAT_VERSION, STATE_SCHEMA_VERSION);
        json_free(doc);
        return NVML_ERROR_LIB_RM_VERSION_MISMATCH;
    }
    node_facts *node = calloc(1, sizeof *node);
    jv *gpus = jget(doc, "gpus");
    if (!node || jlen(gpus) > MAX_GPUS) {
        free(node);
        json_free(doc);
        return NVML_ERROR_MEMORY;
    }
    copy_str(node->digest, sizeof node->digest, jget(doc, "digest"));
    copy_str(node->driver_version, sizeof node->driver_version, jget(doc, "driverVersion"));
    copy_str(node->state_path, sizeof node->state_path, jget(doc, "statePath"));
    snprintf(node->lock_path, sizeof node->lock_path, "%s.lock", node->state_path);
    node->cuda_driver_version = jint(jget(doc, "cudaDriverVersion"), 0);
    node->utilization_sample_ms = jint(jget(doc, "utilizationSampleMs"), 0);
    for (size_t i = 0; i < jlen(gpus); i++) read_gpu(jat(gpus, i), &node->gpus[node->n_gpus++], gpus);
    node->initial_state = jcopy(jget(doc, "initialState"));
    json_free(doc);
    if (!node->initial_state) {
        free(node);
        return NVML_ERROR_CORRUPTED_INFOROM;
    }
    *out = node;
    return NVML_SUCCESS;
}

void node_free(node_facts *node) {
    if (!node) return;
    json_free(node->initial_state);
    free(node);
}

static int lock_state(int mode) {
    int fd = open(g_node->lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) return -1;
    while (flock(fd, mode) < 0) {
        if (errno != EINTR) { close(fd); return -1; }
    }
    return fd;
}

/* The state on disk; NULL with *rc = SUCCESS when it is missing or from another config. */
static jv *load(nvmlReturn_t *rc) {
    size_t len;
    *rc = NVML_SUCCESS;
    char *text = read_file(g_node->state_path, &len);
    if (!text) {
        if (errno != ENOENT) *rc = NVML_ERROR_OPERATING_SYSTEM;
        return NULL;
    }
    jv *state = json_parse(text, len);
    free(text);
    if (!state) {
        fprintf(stderr, "mock libnvidia-ml: the fake NVML state %s is unreadable; delete it or "
                "run `python -m gpuslice_nvml.fake.ctl reset`\n", g_node->state_path);
        *rc = NVML_ERROR_CORRUPTED_INFOROM;
        return NULL;
    }
    if (jint(jget(state, "schemaVersion"), 0) != STATE_SCHEMA_VERSION ||
        strcmp(jstr(jget(state, "configDigest"), ""), g_node->digest)) {
        json_free(state);
        return NULL;
    }
    return state;
}

static jv *fresh(void) {
    jv *state = jcopy(g_node->initial_state);
    size_t len;
    char *text = state ? read_file(g_node->state_path, &len) : NULL;
    jv *old = text ? json_parse(text, len) : NULL;
    long long old_seq = jint(jget(old, "nextEventSeq"), 0);
    if (old_seq > jint(jget(state, "nextEventSeq"), 1)) jset(state, "nextEventSeq", jnew_int(old_seq));
    json_free(old);
    free(text);
    return state;
}

static nvmlReturn_t write_state(jv *state) {
    char *text = json_dump(state);
    if (!text) return NVML_ERROR_MEMORY;
    char tmp[4300];
    const char *slash = strrchr(g_node->state_path, '/');
    int dir_len = slash ? (int)(slash - g_node->state_path) : 1;
    snprintf(tmp, sizeof tmp, "%.*s/.%s.XXXXXX", dir_len, slash ? g_node->state_path : ".",
             slash ? slash + 1 : g_node->state_path);
    int fd = mkstemp(tmp);
    nvmlReturn_t rc = NVML_ERROR_OPERATING_SYSTEM;
    if (fd >= 0) {
        size_t len = strlen(text), done = 0;
        while (done < len) {
            ssize_t n = write(fd, text + done, len - done);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            done += (size_t)n;
        }
        if (done == len && fsync(fd) == 0 && fchmod(fd, 0644) == 0 && close(fd) == 0) {
            fd = -1;
            if (rename(tmp, g_node->state_path) == 0) rc = NVML_SUCCESS;
        }
        if (fd >= 0) close(fd);
        if (rc != NVML_SUCCESS) unlink(tmp);
    }
    free(text);
    return rc;
}

jv *state_begin(int *lock_fd, nvmlReturn_t *rc) {
    *lock_fd = lock_state(LOCK_EX);
    if (*lock_fd < 0) {
        *rc = NVML_ERROR_OPERATING_SYSTEM;
        return NULL;
    }
    jv *state = load(rc);
    if (!state && *rc == NVML_SUCCESS) state = fresh();
    if (!state) {
        if (*rc == NVML_SUCCESS) *rc = NVML_ERROR_MEMORY;
        close(*lock_fd);
    }
    return state;
}

nvmlReturn_t state_commit(int lock_fd, jv *state) {
    nvmlReturn_t rc = write_state(state);
    json_free(state);
    close(lock_fd);
    return rc;
}

void state_abort(int lock_fd, jv *state) {
    json_free(state);
    close(lock_fd);
}

jv *state_read(nvmlReturn_t *rc) {
    jv *state = load(rc); /* no lock: see the top of this file */
    if (state || *rc != NVML_SUCCESS) return state;
    int fd;
    state = state_begin(&fd, rc); /* missing or stale: create it, as the fake does */
    if (!state) return NULL;
    jv *copy = jcopy(state);
    *rc = state_commit(fd, state);
    if (*rc != NVML_SUCCESS) { json_free(copy); return NULL; }
    return copy;
}

jv *gpu_state(jv *state, int gpu) { return jat(jget(state, "gpus"), (size_t)gpu); }

jv *find_gi(jv *gpu_st, unsigned gi_id, size_t *index) {
    jv *gis = jget(gpu_st, "gpuInstances");
    for (size_t i = 0; i < jlen(gis); i++) {
        if (jint(jget(jat(gis, i), "id"), -1) == gi_id) {
            if (index) *index = i;
            return jat(gis, i);
        }
    }
    return NULL;
}

jv *find_ci(jv *gi_st, unsigned ci_id, size_t *index) {
    jv *cis = jget(gi_st, "computeInstances");
    for (size_t i = 0; i < jlen(cis); i++) {
        if (jint(jget(jat(cis, i), "id"), -1) == ci_id) {
            if (index) *index = i;
            return jat(cis, i);
        }
    }
    return NULL;
}

/* A process backed by an OS process counts only while that process lives (fake.procfs.alive):
 * /proc/<pid>/stat exists, is not a zombie, and started at the recorded time. */
int process_live(const jv *process) {
    if (!jbool(jget(process, "real"), 0)) return 1;
    char path[64];
    snprintf(path, sizeof path, "/proc/%lld/stat", jint(jget(process, "pid"), 0));
    char *text = read_file(path, NULL);
    if (!text) return 0;
    const char *p = strrchr(text, ')');
    int live = 0;
    if (p && p[1] == ' ' && p[2] != 'Z' && p[2] != 'X') {
        p += 2; /* field 3, the state */
        for (int field = 3; field < 22 && p; field++) p = strchr(p, ' ') ? strchr(p, ' ') + 1 : NULL;
        const jv *started = jget(process, "startTime");
        live = p && (!started || started->t != J_NUM || strtoll(p, NULL, 10) == jint(started, 0));
    }
    free(text);
    return live;
}

const gi_profile *profile_by_id(const gpu_facts *gpu, unsigned id) {
    for (unsigned i = 0; i < gpu->n_profiles; i++)
        if (gpu->profiles[i].id == id) return &gpu->profiles[i];
    return NULL;
}

const gi_profile *profile_by_enum(const gpu_facts *gpu, unsigned nvml_profile) {
    for (unsigned i = 0; i < gpu->n_profiles; i++)
        if (gpu->profiles[i].nvml_profile == nvml_profile) return &gpu->profiles[i];
    return NULL;
}

int is_gpu_handle(nvmlDevice_t device) {
    return device >= &g_gpu_handles[0] && device < &g_gpu_handles[g_node->n_gpus];
}

int is_mig_handle(nvmlDevice_t device) {
    const struct nvmlDevice_st *first = &g_mig_handles[0][0][0];
    return device >= first && device < first + MAX_GPUS * MAX_GI * MAX_CI &&
           device->gpu < (int)g_node->n_gpus;
}

nvmlReturn_t check_device(nvmlDevice_t device, jv *state, int *gpu) {
    if (!device || (!is_gpu_handle(device) && !is_mig_handle(device))) return NVML_ERROR_INVALID_ARGUMENT;
    jv *gs = gpu_state(state, device->gpu);
    if (jbool(jget(gs, "lost"), 0)) return NVML_ERROR_GPU_IS_LOST;
    if (device->gi >= 0) { /* a MIG device exists while its compute instance does */
        jv *gi = find_gi(gs, (unsigned)device->gi, NULL);
        if (!jbool(jget(gs, "migCurrent"), 0) || !gi || !find_ci(gi, (unsigned)device->ci, NULL))
            return NVML_ERROR_INVALID_ARGUMENT;
    }
    *gpu = device->gpu;
    return NVML_SUCCESS;
}
