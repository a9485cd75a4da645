/* MIG: modes, GPU-instance profiles and placements, GPU instances, and the layout helpers
 * compute.c shares (compute instances and MIG device handles live there).
 *
 * The rules are the fake's (gpuslice_nvml.fake.mig), applied to the same state: NOT_SUPPORTED
 * without MIG mode, INVALID_ARGUMENT for a profile or placement the GPU does not offer,
 * INSUFFICIENT_RESOURCES when there is no room, IN_USE when something still runs inside.
 * GPU-instance ids follow the memory-slice tree; without a placement the highest free start is
 * taken; compute instances take the lowest free id. Profile tables come from the node file. */
#include "mock.h"

#include <stdio.h>
#include <string.h>

static const unsigned SWIZZLE_BASE[9] = {0, 7, 3, 0, 1, 0, 0, 0, 0}; /* by placement size */

int overlaps(placement a, placement b) {
    return a.start < b.start + b.size && b.start < a.start + a.size;
}

placement placement_of(const jv *inst) {
    return (placement){(unsigned)jint(jget(inst, "start"), 0), (unsigned)jint(jget(inst, "size"), 0)};
}

/* A GPU handle whose GPU is MIG capable (and, with enabled, in MIG mode). */
static nvmlReturn_t mig_gpu(nvmlDevice_t device, jv *state, int enabled, int *gpu) {
    nvmlReturn_t rc = check_device(device, state, gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (device->gi >= 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g_node->gpus[*gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    if (enabled && !jbool(jget(gpu_state(state, *gpu), "migCurrent"), 0)) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

/* A GPU-instance handle whose instance exists. */
nvmlReturn_t check_gi(nvmlGpuInstance_t handle, jv *state, jv **gi, const gi_profile **gp) {
    const struct nvmlGpuInstance_st *first = &g_gi_handles[0][0];
    if (!handle || handle < first || handle >= first + MAX_GPUS * MAX_GI || handle->gpu >= (int)g_node->n_gpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    jv *gs = gpu_state(state, handle->gpu);
    if (jbool(jget(gs, "lost"), 0)) return NVML_ERROR_GPU_IS_LOST;
    if (!jbool(jget(gs, "migCurrent"), 0) || !(*gi = find_gi(gs, (unsigned)handle->gi, NULL)))
        return NVML_ERROR_INVALID_ARGUMENT;
    *gp = profile_by_id(&g_node->gpus[handle->gpu], (unsigned)jint(jget(*gi, "profileId"), 0));
    return *gp ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

nvmlReturn_t DECLDIR nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    ENTER();
    READ_STATE(state);
    int gpu;
    if ((rc = mig_gpu(device, state, 0, &gpu)) != NVML_SUCCESS) DONE(state, rc);
    if (!currentMode || !pendingMode) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *currentMode = (unsigned)jbool(jget(gpu_state(state, gpu), "migCurrent"), 0);
    *pendingMode = (unsigned)jbool(jget(gpu_state(state, gpu), "migPending"), 0);
    DONE(state, NVML_SUCCESS);
}

/* The mode becomes pending; it takes effect at a GPU reset (fake.mig.reset), which NVML has no
 * call for: activationStatus says a reset is required while current and pending differ. */
nvmlReturn_t DECLDIR nvmlDeviceSetMigMode(nvmlDevice_t device, unsigned int mode, nvmlReturn_t *activationStatus) {
    ENTER();
    if (!activationStatus || mode > NVML_DEVICE_MIG_ENABLE) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    int fd, gpu;
    nvmlReturn_t rc;
    jv *state = state_begin(&fd, &rc);
    if (!state) LEAVE(rc);
    jv *gs = NULL;
    if ((rc = mig_gpu(device, state, 0, &gpu)) == NVML_SUCCESS) {
        gs = gpu_state(state, gpu);
        if (!mode && jlen(jget(gs, "gpuInstances"))) rc = NVML_ERROR_IN_USE;
    }
    if (rc != NVML_SUCCESS) {
        state_abort(fd, state);
        LEAVE(rc);
    }
    jset(gs, "migPending", jnew_bool((int)mode));
    *activationStatus = jbool(jget(gs, "migCurrent"), 0) == (int)mode ? NVML_SUCCESS : NVML_ERROR_RESET_REQUIRED;
    LEAVE(state_commit(fd, state));
}

static nvmlReturn_t gi_profile_lookup(nvmlDevice_t device, unsigned profile, const gi_profile **gp, jv **state) {
    nvmlReturn_t rc;
    int gpu;
    if (!(*state = state_read(&rc))) return rc;
    if ((rc = mig_gpu(device, *state, 0, &gpu)) != NVML_SUCCESS) return rc;
    if (profile >= NVML_GPU_INSTANCE_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    *gp = profile_by_enum(&g_node->gpus[gpu], profile);
    return *gp ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                         nvmlGpuInstanceProfileInfo_t *info) {
    ENTER();
    const gi_profile *gp;
    jv *state = NULL;
    nvmlReturn_t rc = gi_profile_lookup(device, profile, &gp, &state);
    if (rc != NVML_SUCCESS) DONE(state, rc);
    if (!info) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *info = (nvmlGpuInstanceProfileInfo_t){gp->id, gp->p2p, gp->slice_count, gp->instance_count,
                                           gp->multiprocessors, gp->copy_engines, gp->decoders,
                                           gp->encoders, gp->jpeg_decoders, gp->ofa_engines, gp->memory_mib};
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                          nvmlGpuInstanceProfileInfo_v2_t *info) {
    ENTER();
    const gi_profile *gp;
    jv *state = NULL;
    nvmlReturn_t rc = gi_profile_lookup(device, profile, &gp, &state);
    if (rc != NVML_SUCCESS) DONE(state, rc);
    if (!info) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    snprintf(name, sizeof name, "MIG %s", gp->name);
    if (info->version == nvmlGpuInstanceProfileInfo_v3) {
        nvmlGpuInstanceProfileInfo_v3_t *v3 = (nvmlGpuInstanceProfileInfo_v3_t *)info;
        *v3 = (nvmlGpuInstanceProfileInfo_v3_t){nvmlGpuInstanceProfileInfo_v3, gp->id, gp->slice_count,
                                                gp->instance_count, gp->multiprocessors, gp->copy_engines,
                                                gp->decoders, gp->encoders, gp->jpeg_decoders,
                                                gp->ofa_engines, gp->memory_mib, {0}, 0};
        memcpy(v3->name, name, sizeof name);
        DONE(state, NVML_SUCCESS);
    }
    if (info->version != nvmlGpuInstanceProfileInfo_v2) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *info = (nvmlGpuInstanceProfileInfo_v2_t){nvmlGpuInstanceProfileInfo_v2, gp->id, gp->p2p, gp->slice_count,
                                              gp->instance_count, gp->multiprocessors, gp->copy_engines,
                                              gp->decoders, gp->encoders, gp->jpeg_decoders,
                                              gp->ofa_engines, gp->memory_mib, {0}};
    memcpy(info->name, name, sizeof name);
    DONE(state, NVML_SUCCESS);
}

/* Copy n placements out, NVML style: NULL asks for the count. */
nvmlReturn_t put_placements(const placement *list, unsigned n, void *out, unsigned int *count) {
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (!out) {
        *count = n;
        return NVML_SUCCESS;
    }
    if (*count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    nvmlGpuInstancePlacement_t *dst = out; /* same layout as nvmlComputeInstancePlacement_t */
    for (unsigned i = 0; i < n; i++) dst[i] = (nvmlGpuInstancePlacement_t){list[i].start, list[i].size};
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                                   nvmlGpuInstancePlacement_t *placements,
                                                                   unsigned int *count) {
    ENTER();
    READ_STATE(state);
    int gpu;
    if ((rc = mig_gpu(device, state, 0, &gpu)) != NVML_SUCCESS) DONE(state, rc);
    const gi_profile *gp = profile_by_id(&g_node->gpus[gpu], profileId);
    if (!gp) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    DONE(state, put_placements(gp->placements, gp->n_placements, placements, count));
}

static unsigned compute_slices_used(int gpu, jv *gs) {
    unsigned used = 0;
    jv *gis = jget(gs, "gpuInstances");
    for (size_t i = 0; i < jlen(gis); i++) {
        const gi_profile *gp = profile_by_id(&g_node->gpus[gpu], (unsigned)jint(jget(jat(gis, i), "profileId"), 0));
        used += gp ? gp->slice_count : 0;
    }
    return used;
}

/* The profile's placements that overlap no instance in list (GPU or compute instances). */
unsigned free_placements(const placement *all, unsigned n, jv *list, placement *out) {
    unsigned k = 0;
    for (unsigned i = 0; i < n; i++) {
        int taken = 0;
        for (size_t j = 0; j < jlen(list) && !taken; j++) taken = overlaps(all[i], placement_of(jat(list, j)));
        if (!taken) out[k++] = all[i];
    }
    return k;
}

unsigned count_profile(jv *list, unsigned profile_id) {
    unsigned n = 0;
    for (size_t i = 0; i < jlen(list); i++) n += jint(jget(jat(list, i), "profileId"), -1) == profile_id;
    return n;
}

void max_disjoint(const placement *c, unsigned n, unsigned from, placement *chosen, unsigned k,
                         unsigned limit, unsigned *best) {
    if (k > *best) *best = k;
    if (*best >= limit) return;
    for (unsigned i = from; i < n; i++) {
        int ok = 1;
        for (unsigned j = 0; j < k && ok; j++) ok = !overlaps(c[i], chosen[j]);
        if (!ok) continue;
        chosen[k] = c[i];
        max_disjoint(c, n, i + 1, chosen, k + 1, limit, best);
    }
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t device, unsigned int profileId,
                                                               unsigned int *count) {
    ENTER();
    READ_STATE(state);
    int gpu;
    /* answered with MIG off too (a real H200, driver 580): the layout is empty then */
    if ((rc = mig_gpu(device, state, 0, &gpu)) != NVML_SUCCESS) DONE(state, rc);
    const gi_profile *gp = profile_by_id(&g_node->gpus[gpu], profileId);
    if (!gp || !count) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    jv *gs = gpu_state(state, gpu), *gis = jget(gs, "gpuInstances");
    int limit = (int)gp->instance_count - (int)count_profile(gis, profileId);
    int by_slices = (int)(COMPUTE_SLICES - compute_slices_used(gpu, gs)) / (int)gp->slice_count;
    if (by_slices < limit) limit = by_slices;
    placement free[MAX_PLACEMENTS], chosen[MAX_PLACEMENTS];
    unsigned n = free_placements(gp->placements, gp->n_placements, gis, free), best = 0;
    if (limit > 0) max_disjoint(free, n, 0, chosen, 0, (unsigned)limit, &best);
    *count = limit > 0 && best > (unsigned)limit ? (unsigned)limit : best;
    DONE(state, NVML_SUCCESS);
}

jv *new_instance(unsigned id, unsigned profile_id, placement pl, int with_cis) {
    jv *o = jnew_obj();
    jset(o, "id", jnew_int(id));
    jset(o, "profileId", jnew_int(profile_id));
    jset(o, "start", jnew_int(pl.start));
    jset(o, "size", jnew_int(pl.size));
    if (with_cis) jset(o, "computeInstances", jnew_arr());
    return o;
}

/* Insert keeping the list sorted by id, as the fake does. */
int insert_sorted(jv *list, jv *inst) {
    size_t at = 0;
    long long id = jint(jget(inst, "id"), 0);
    while (at < jlen(list) && jint(jget(jat(list, at), "id"), 0) < id) at++;
    return jinsert(list, at, inst);
}

static nvmlReturn_t create_gi(nvmlDevice_t device, unsigned profileId, const nvmlGpuInstancePlacement_t *want,
                              nvmlGpuInstance_t *out) {
    int fd, gpu;
    nvmlReturn_t rc;
    jv *state = state_begin(&fd, &rc);
    if (!state) return rc;
    if ((rc = mig_gpu(device, state, 1, &gpu)) != NVML_SUCCESS) goto abort;
    const gi_profile *gp = profile_by_id(&g_node->gpus[gpu], profileId);
    rc = NVML_ERROR_INVALID_ARGUMENT;
    if (!gp || !out) goto abort;
    placement pl = {0, 0};
    if (want) {
        int offered = 0;
        for (unsigned i = 0; i < gp->n_placements; i++)
            offered |= gp->placements[i].start == want->start && gp->placements[i].size == want->size;
        if (!offered) goto abort;
        pl = (placement){want->start, want->size};
    }
    jv *gs = gpu_state(state, gpu), *gis = jget(gs, "gpuInstances");
    rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
    if (count_profile(gis, profileId) >= gp->instance_count) goto abort;
    if (gp->slice_count > COMPUTE_SLICES - compute_slices_used(gpu, gs)) goto abort;
    if (want) {
        for (size_t i = 0; i < jlen(gis); i++)
            if (overlaps(pl, placement_of(jat(gis, i)))) goto abort;
    } else {
        placement free[MAX_PLACEMENTS];
        unsigned n = free_placements(gp->placements, gp->n_placements, gis, free);
        if (!n) goto abort;
        pl = free[0];
        for (unsigned i = 1; i < n; i++)
            if (free[i].start > pl.start) pl = free[i];
    }
    unsigned id = SWIZZLE_BASE[pl.size] + pl.start / pl.size;
    if (id >= MAX_GI || insert_sorted(gis, new_instance(id, profileId, pl, 1))) {
        rc = NVML_ERROR_UNKNOWN;
        goto abort;
    }
    *out = &g_gi_handles[gpu][id];
    return state_commit(fd, state);
abort:
    state_abort(fd, state);
    return rc;
}

nvmlReturn_t DECLDIR nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId,
                                                 nvmlGpuInstance_t *gpuInstance) {
    ENTER();
    LEAVE(create_gi(device, profileId, NULL, gpuInstance));
}

nvmlReturn_t DECLDIR nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                              const nvmlGpuInstancePlacement_t *placement,
                                                              nvmlGpuInstance_t *gpuInstance) {
    ENTER();
    if (!placement) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    LEAVE(create_gi(device, profileId, placement, gpuInstance));
}

int busy(jv *state, int gpu, long long gi, long long ci) {
    jv *procs = jget(state, "processes");
    for (size_t i = 0; i < jlen(procs); i++) {
        jv *p = jat(procs, i);
        if (jint(jget(p, "gpu"), -1) == gpu && jint(jget(p, "gpuInstanceId"), -1) == gi &&
            (ci < 0 || jint(jget(p, "computeInstanceId"), -1) == ci))
            return 1;
    }
    return 0;
}

nvmlReturn_t DECLDIR nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance) {
    ENTER();
    int fd;
    nvmlReturn_t rc;
    jv *state = state_begin(&fd, &rc), *gi = NULL;
    if (!state) LEAVE(rc);
    const gi_profile *gp;
    if ((rc = check_gi(gpuInstance, state, &gi, &gp)) == NVML_SUCCESS &&
        (jlen(jget(gi, "computeInstances")) || busy(state, gpuInstance->gpu, gpuInstance->gi, -1)))
        rc = NVML_ERROR_IN_USE;
    if (rc != NVML_SUCCESS) {
        state_abort(fd, state);
        LEAVE(rc);
    }
    size_t index;
    jv *gs = gpu_state(state, gpuInstance->gpu);
    find_gi(gs, (unsigned)gpuInstance->gi, &index);
    jremove(jget(gs, "gpuInstances"), index);
    LEAVE(state_commit(fd, state));
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                               nvmlGpuInstance_t *gpuInstances, unsigned int *count) {
    ENTER();
    READ_STATE(state);
    int gpu;
    if ((rc = mig_gpu(device, state, 0, &gpu)) != NVML_SUCCESS) DONE(state, rc); /* as above */
    if (!profile_by_id(&g_node->gpus[gpu], profileId) || !gpuInstances || !count)
        DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    jv *gis = jget(gpu_state(state, gpu), "gpuInstances");
    unsigned n = 0;
    for (size_t i = 0; i < jlen(gis); i++) {
        jv *gi = jat(gis, i);
        if (jint(jget(gi, "profileId"), -1) == profileId)
            gpuInstances[n++] = &g_gi_handles[gpu][jint(jget(gi, "id"), 0)];
    }
    *count = n;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *gpuInstance) {
    ENTER();
    READ_STATE(state);
    int gpu;
    if ((rc = mig_gpu(device, state, 1, &gpu)) != NVML_SUCCESS) DONE(state, rc);
    if (!gpuInstance || id >= MAX_GI) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (!find_gi(gpu_state(state, gpu), id, NULL)) DONE(state, NVML_ERROR_NOT_FOUND);
    *gpuInstance = &g_gi_handles[gpu][id];
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info) {
    ENTER();
    READ_STATE(state);
    jv *gi;
    const gi_profile *gp;
    if ((rc = check_gi(gpuInstance, state, &gi, &gp)) != NVML_SUCCESS) DONE(state, rc);
    if (!info) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    placement pl = placement_of(gi);
    *info = (nvmlGpuInstanceInfo_t){&g_gpu_handles[gpuInstance->gpu], (unsigned)gpuInstance->gi, gp->id,
                                    {pl.start, pl.size}};
    DONE(state, NVML_SUCCESS);
}
