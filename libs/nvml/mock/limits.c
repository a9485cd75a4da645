/* Driver memory partitioning by cgroup (driver 615+), as gpuslice_nvml.fake.partition models
 * it: limits per (GPU, cgroup v2 directory) in the state's memoryLimits; an older driver has no
 * such calls (FUNCTION_NOT_FOUND); MIG mode is NOT_SUPPORTED; a missing directory NOT_FOUND and
 * a directory outside cgroup v2 NOT_SUPPORTED; soft 0 with hard NVML_DEVICE_MEMORY_LIMIT_MAX
 * clears; a removed cgroup loses its limits; currentUsed is what the live real processes in the
 * cgroup (or below it) hold on the GPU. */
#include "mock.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#define CGROUP2_SUPER_MAGIC 0x63677270
#define MIN_DRIVER 615

static nvmlReturn_t check_namespace(const char *ns, char *resolved) {
    struct stat st;
    struct statfs fs;
    char procs[PATH_MAX + 16];
    if (!ns || ns[0] != '/') return NVML_ERROR_INVALID_ARGUMENT;
    if (stat(ns, &st) || !S_ISDIR(st.st_mode) || !realpath(ns, resolved)) return NVML_ERROR_NOT_FOUND;
    snprintf(procs, sizeof procs, "%s/cgroup.procs", resolved);
    if (access(procs, F_OK) || statfs(resolved, &fs) || fs.f_type != CGROUP2_SUPER_MAGIC)
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

static int within(const char *path, const char *dir) {
    size_t n = strlen(dir);
    return !strncmp(path, dir, n) && (path[n] == 0 || path[n] == '/' || (n == 1 && dir[0] == '/'));
}

/* The cgroup v2 directory of a process: the unified mount point + its "0::" line. */
static int cgroup_dir(long long pid, char *out, size_t size) {
    char path[64], line[PATH_MAX], mount[PATH_MAX] = "", rel[PATH_MAX] = "";
    FILE *f = fopen("/proc/self/mounts", "r");
    while (f && fgets(line, sizeof line, f)) {
        char dev[256], dir[PATH_MAX], type[64];
        if (sscanf(line, "%255s %4095s %63s", dev, dir, type) == 3 && !strcmp(type, "cgroup2")) {
            snprintf(mount, sizeof mount, "%s", dir);
            break;
        }
    }
    if (f) fclose(f);
    snprintf(path, sizeof path, "/proc/%lld/cgroup", pid);
    f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f)) {
        if (!strncmp(line, "0::", 3)) {
            line[strcspn(line, "\n")] = 0;
            snprintf(rel, sizeof rel, "%s", line + 3);
        }
    }
    if (f) fclose(f);
    if (!mount[0] || !rel[0]) return -1;
    snprintf(out, size, "%s%s", mount, strcmp(rel, "/") ? rel : "");
    return 0;
}

static unsigned long long used_in(jv *state, int gpu, const char *ns) {
    unsigned long long total = 0;
    jv *procs = jget(state, "processes");
    for (size_t i = 0; i < jlen(procs); i++) {
        jv *p = jat(procs, i);
        char dir[PATH_MAX + 8];
        if (jint(jget(p, "gpu"), -1) != gpu || !jbool(jget(p, "real"), 0) || !process_live(p)) continue;
        if (!cgroup_dir(jint(jget(p, "pid"), 0), dir, sizeof dir) && within(dir, ns))
            total += (unsigned long long)jint(jget(p, "usedMemory"), 0);
    }
    return total;
}

/* Limits go up to 2^64 - 1, past jint's range: read and write them as unsigned text. */
static unsigned long long number(const jv *v, unsigned long long dflt) {
    return v && v->t == J_NUM ? strtoull(v->s, NULL, 10) : dflt;
}

static jv *new_number(unsigned long long value) {
    jv *v = jnew_int(0);
    char text[32];
    snprintf(text, sizeof text, "%llu", value);
    if (v) {
        free(v->s);
        v->s = strdup(text);
    }
    return v;
}

static nvmlReturn_t precheck(nvmlDevice_t device, jv *state, const char *ns, char *resolved, int *gpu) {
    if (atoi(g_node->driver_version) < MIN_DRIVER) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t rc = check_device(device, state, gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (device->gi >= 0 || jbool(jget(gpu_state(state, *gpu), "migCurrent"), 0)) return NVML_ERROR_NOT_SUPPORTED;
    return check_namespace(ns, resolved);
}

nvmlReturn_t DECLDIR nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits) {
    ENTER();
    if (!limits) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    int fd, gpu;
    nvmlReturn_t rc;
    char resolved[PATH_MAX];
    jv *state = state_begin(&fd, &rc);
    if (!state) LEAVE(rc);
    if ((rc = precheck(device, state, limits->nameSpace, resolved, &gpu)) == NVML_SUCCESS &&
        limits->softLimit > limits->hardLimit)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc != NVML_SUCCESS) {
        state_abort(fd, state);
        LEAVE(rc);
    }
    jv *list = jget(state, "memoryLimits");
    for (size_t i = jlen(list); i-- > 0;) {
        jv *lim = jat(list, i);
        struct stat st;
        const char *ns = jstr(jget(lim, "namespace"), "");
        if (stat(ns, &st) || !S_ISDIR(st.st_mode) ||
            (jint(jget(lim, "gpu"), -1) == gpu && !strcmp(ns, resolved)))
            jremove(list, i); /* removed cgroups lose their limits; this one is replaced */
    }
    if (limits->softLimit != 0 || limits->hardLimit != NVML_DEVICE_MEMORY_LIMIT_MAX) {
        jv *lim = jnew_obj();
        jset(lim, "gpu", jnew_int(gpu));
        jset(lim, "namespace", jnew_str(resolved));
        jset(lim, "softLimit", new_number(limits->softLimit));
        jset(lim, "hardLimit", new_number(limits->hardLimit));
        jpush(list, lim);
    }
    LEAVE(state_commit(fd, state));
}

nvmlReturn_t DECLDIR nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits) {
    ENTER();
    if (!limits) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t rc;
    int gpu;
    char resolved[PATH_MAX];
    jv *state = state_read(&rc);
    if (!state) LEAVE(rc);
    if ((rc = precheck(device, state, limits->nameSpace, resolved, &gpu)) != NVML_SUCCESS) {
        json_free(state);
        LEAVE(rc);
    }
    limits->softLimit = 0;
    limits->hardLimit = NVML_DEVICE_MEMORY_LIMIT_MAX;
    jv *list = jget(state, "memoryLimits");
    for (size_t i = 0; i < jlen(list); i++) {
        jv *lim = jat(list, i);
        if (jint(jget(lim, "gpu"), -1) == gpu && !strcmp(jstr(jget(lim, "namespace"), ""), resolved)) {
            limits->softLimit = number(jget(lim, "softLimit"), 0);
            limits->hardLimit = number(jget(lim, "hardLimit"), NVML_DEVICE_MEMORY_LIMIT_MAX);
        }
    }
    limits->currentUsed = used_in(state, gpu, resolved);
    json_free(state);
    LEAVE(NVML_SUCCESS);
}
