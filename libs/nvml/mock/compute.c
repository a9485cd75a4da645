/* MIG compute instances (profiles, placements, create/destroy, listing) and MIG device handles,
 * by the fake's rules (gpuslice_nvml.fake.mig; see mig.c): a size the GPU instance does not offer
 * is INVALID_ARGUMENT, no room INSUFFICIENT_RESOURCES, processes inside IN_USE; the highest free
 * start is taken and the lowest free compute-instance id. */
#include "mock.h"

#include <stdio.h>
#include <string.h>

static const ci_profile *ci_profile_by_id(const gi_profile *gp, unsigned id) {
    for (unsigned i = 0; i < gp->n_ci; i++)
        if (gp->ci[i].id == id) return &gp->ci[i];
    return NULL;
}

static nvmlReturn_t check_ci(nvmlComputeInstance_t handle, jv *state, jv **gi, jv **ci) {
    const struct nvmlComputeInstance_st *first = &g_ci_handles[0][0][0];
    if (!handle || handle < first || handle >= first + MAX_GPUS * MAX_GI * MAX_CI ||
        handle->gpu >= (int)g_node->n_gpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    const gi_profile *gp;
    nvmlReturn_t rc = check_gi(&g_gi_handles[handle->gpu][handle->gi], state, gi, &gp);
    if (rc != NVML_SUCCESS) return rc;
    return (*ci = find_ci(*gi, (unsigned)handle->ci, NULL)) ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

static const ci_profile *ci_profile_by_enum(const gi_profile *gp, unsigned profile) {
    for (unsigned i = 0; i < gp->n_ci; i++)
        if (gp->ci[i].nvml_profile == profile) return &gp->ci[i];
    return NULL;
}

static nvmlReturn_t ci_profile_lookup(nvmlGpuInstance_t gpuInstance, unsigned profile, unsigned engProfile,
                                      const gi_profile **gp, const ci_profile **cp, jv **state) {
    nvmlReturn_t rc;
    jv *gi;
    if (!(*state = state_read(&rc))) return rc;
    if ((rc = check_gi(gpuInstance, *state, &gi, gp)) != NVML_SUCCESS) return rc;
    if (profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT || engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        return NVML_ERROR_INVALID_ARGUMENT;
    *cp = ci_profile_by_enum(*gp, profile);
    return *cp ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                  unsigned int engProfile,
                                                                  nvmlComputeInstanceProfileInfo_t *info) {
    ENTER();
    const gi_profile *gp;
    const ci_profile *cp;
    jv *state = NULL;
    nvmlReturn_t rc = ci_profile_lookup(gpuInstance, profile, engProfile, &gp, &cp, &state);
    if (rc != NVML_SUCCESS) DONE(state, rc);
    if (!info) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *info = (nvmlComputeInstanceProfileInfo_t){cp->id, cp->slice_count, cp->instance_count, cp->multiprocessors,
                                               gp->copy_engines, gp->decoders, gp->encoders, gp->jpeg_decoders,
                                               gp->ofa_engines};
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                   unsigned int engProfile,
                                                                   nvmlComputeInstanceProfileInfo_v2_t *info) {
    ENTER();
    const gi_profile *gp;
    const ci_profile *cp;
    jv *state = NULL;
    nvmlReturn_t rc = ci_profile_lookup(gpuInstance, profile, engProfile, &gp, &cp, &state);
    if (rc != NVML_SUCCESS) DONE(state, rc);
    if (!info) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    snprintf(name, sizeof name, "MIG %s", cp->name);
    if (info->version == nvmlComputeInstanceProfileInfo_v3) {
        nvmlComputeInstanceProfileInfo_v3_t *v3 = (nvmlComputeInstanceProfileInfo_v3_t *)info;
        *v3 = (nvmlComputeInstanceProfileInfo_v3_t){nvmlComputeInstanceProfileInfo_v3, cp->id, cp->slice_count,
                                                    cp->instance_count, cp->multiprocessors, gp->copy_engines,
                                                    gp->decoders, gp->encoders, gp->jpeg_decoders,
                                                    gp->ofa_engines, {0}, 0};
        memcpy(v3->name, name, sizeof name);
        DONE(state, NVML_SUCCESS);
    }
    if (info->version != nvmlComputeInstanceProfileInfo_v2) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *info = (nvmlComputeInstanceProfileInfo_v2_t){nvmlComputeInstanceProfileInfo_v2, cp->id, cp->slice_count,
                                                  cp->instance_count, cp->multiprocessors, gp->copy_engines,
                                                  gp->decoders, gp->encoders, gp->jpeg_decoders,
                                                  gp->ofa_engines, {0}};
    memcpy(info->name, name, sizeof name);
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstancePossiblePlacements(nvmlGpuInstance_t gpuInstance,
                                                                         unsigned int profileId,
                                                                         nvmlComputeInstancePlacement_t *placements,
                                                                         unsigned int *count) {
    ENTER();
    READ_STATE(state);
    jv *gi;
    const gi_profile *gp;
    if ((rc = check_gi(gpuInstance, state, &gi, &gp)) != NVML_SUCCESS) DONE(state, rc);
    const ci_profile *cp = ci_profile_by_id(gp, profileId);
    if (!cp) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    DONE(state, put_placements(cp->placements, cp->n_placements, placements, count));
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstanceRemainingCapacity(nvmlGpuInstance_t gpuInstance,
                                                                        unsigned int profileId, unsigned int *count) {
    ENTER();
    READ_STATE(state);
    jv *gi;
    const gi_profile *gp;
    if ((rc = check_gi(gpuInstance, state, &gi, &gp)) != NVML_SUCCESS) DONE(state, rc);
    const ci_profile *cp = ci_profile_by_id(gp, profileId);
    if (!cp || !count) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    jv *cis = jget(gi, "computeInstances");
    int limit = (int)cp->instance_count - (int)count_profile(cis, profileId);
    placement free[MAX_PLACEMENTS], chosen[MAX_PLACEMENTS];
    unsigned n = free_placements(cp->placements, cp->n_placements, cis, free), best = 0;
    if (limit > 0) max_disjoint(free, n, 0, chosen, 0, (unsigned)limit, &best);
    *count = best;
    DONE(state, NVML_SUCCESS);
}

static nvmlReturn_t create_ci(nvmlGpuInstance_t gpuInstance, unsigned profileId,
                              const nvmlComputeInstancePlacement_t *want, nvmlComputeInstance_t *out) {
    int fd;
    nvmlReturn_t rc;
    jv *state = state_begin(&fd, &rc), *gi;
    const gi_profile *gp;
    if (!state) return rc;
    if ((rc = check_gi(gpuInstance, state, &gi, &gp)) != NVML_SUCCESS) goto abort;
    const ci_profile *cp = ci_profile_by_id(gp, profileId);
    rc = NVML_ERROR_INVALID_ARGUMENT;
    if (!cp || !out) goto abort;
    jv *cis = jget(gi, "computeInstances");
    placement free[MAX_PLACEMENTS], pl;
    unsigned n = free_placements(cp->placements, cp->n_placements, cis, free);
    if (want) {
        int offered = 0, is_free = 0;
        for (unsigned i = 0; i < cp->n_placements; i++)
            offered |= cp->placements[i].start == want->start && cp->placements[i].size == want->size;
        for (unsigned i = 0; i < n; i++) is_free |= free[i].start == want->start;
        if (!offered) goto abort;
        rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
        if (!is_free) goto abort;
        pl = (placement){want->start, want->size};
    }
    rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
    if (count_profile(cis, profileId) >= cp->instance_count || !n) goto abort;
    if (!want) {
        pl = free[0];
        for (unsigned i = 1; i < n; i++)
            if (free[i].start > pl.start) pl = free[i];
    }
    unsigned id = 0;
    while (id < MAX_CI && find_ci(gi, id, NULL)) id++;
    if (id >= MAX_CI || insert_sorted(cis, new_instance(id, profileId, pl, 0))) {
        rc = NVML_ERROR_UNKNOWN;
        goto abort;
    }
    *out = &g_ci_handles[gpuInstance->gpu][gpuInstance->gi][id];
    return state_commit(fd, state);
abort:
    state_abort(fd, state);
    return rc;
}

nvmlReturn_t DECLDIR nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                          nvmlComputeInstance_t *computeInstance) {
    ENTER();
    LEAVE(create_ci(gpuInstance, profileId, NULL, computeInstance));
}

nvmlReturn_t DECLDIR nvmlGpuInstanceCreateComputeInstanceWithPlacement(nvmlGpuInstance_t gpuInstance,
                                                                       unsigned int profileId,
                                                                       const nvmlComputeInstancePlacement_t *placement,
                                                                       nvmlComputeInstance_t *computeInstance) {
    ENTER();
    if (!placement) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    LEAVE(create_ci(gpuInstance, profileId, placement, computeInstance));
}

nvmlReturn_t DECLDIR nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance) {
    ENTER();
    int fd;
    nvmlReturn_t rc;
    jv *state = state_begin(&fd, &rc), *gi, *ci;
    if (!state) LEAVE(rc);
    if ((rc = check_ci(computeInstance, state, &gi, &ci)) == NVML_SUCCESS &&
        busy(state, computeInstance->gpu, computeInstance->gi, computeInstance->ci))
        rc = NVML_ERROR_IN_USE;
    if (rc != NVML_SUCCESS) {
        state_abort(fd, state);
        LEAVE(rc);
    }
    size_t index;
    find_ci(gi, (unsigned)computeInstance->ci, &index);
    jremove(jget(gi, "computeInstances"), index);
    LEAVE(state_commit(fd, state));
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                        nvmlComputeInstance_t *computeInstances, unsigned int *count) {
    ENTER();
    READ_STATE(state);
    jv *gi;
    const gi_profile *gp;
    if ((rc = check_gi(gpuInstance, state, &gi, &gp)) != NVML_SUCCESS) DONE(state, rc);
    if (!ci_profile_by_id(gp, profileId) || !computeInstances || !count) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    jv *cis = jget(gi, "computeInstances");
    unsigned n = 0;
    for (size_t i = 0; i < jlen(cis); i++)
        if (jint(jget(jat(cis, i), "profileId"), -1) == profileId)
            computeInstances[n++] = &g_ci_handles[gpuInstance->gpu][gpuInstance->gi][jint(jget(jat(cis, i), "id"), 0)];
    *count = n;
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                           nvmlComputeInstance_t *computeInstance) {
    ENTER();
    READ_STATE(state);
    jv *gi;
    const gi_profile *gp;
    if ((rc = check_gi(gpuInstance, state, &gi, &gp)) != NVML_SUCCESS) DONE(state, rc);
    if (!computeInstance || id >= MAX_CI) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (!find_ci(gi, id, NULL)) DONE(state, NVML_ERROR_NOT_FOUND);
    *computeInstance = &g_ci_handles[gpuInstance->gpu][gpuInstance->gi][id];
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                                   nvmlComputeInstanceInfo_t *info) {
    ENTER();
    READ_STATE(state);
    jv *gi, *ci;
    if ((rc = check_ci(computeInstance, state, &gi, &ci)) != NVML_SUCCESS) DONE(state, rc);
    if (!info) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    placement pl = placement_of(ci);
    int g = computeInstance->gpu;
    *info = (nvmlComputeInstanceInfo_t){&g_gpu_handles[g], &g_gi_handles[g][computeInstance->gi],
                                        (unsigned)computeInstance->ci, (unsigned)jint(jget(ci, "profileId"), 0),
                                        {pl.start, pl.size}};
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    ENTER();
    READ_STATE(state);
    int gpu;
    if ((rc = check_device(device, state, &gpu)) != NVML_SUCCESS) DONE(state, rc);
    if (!count || device->gi >= 0) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    /* 0 with MIG off, as a real H200 (driver 580) answers */
    *count = g_node->gpus[gpu].mig_capable && jbool(jget(gpu_state(state, gpu), "migCurrent"), 0) ? COMPUTE_SLICES : 0;
    DONE(state, NVML_SUCCESS);
}

/* MIG devices by index: the compute instances in (GPU instance, compute instance) order. */
nvmlReturn_t DECLDIR nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                         nvmlDevice_t *migDevice) {
    ENTER();
    READ_STATE(state);
    int gpu;
    if ((rc = check_device(device, state, &gpu)) != NVML_SUCCESS) DONE(state, rc);
    if (!migDevice || device->gi >= 0 || index >= COMPUTE_SLICES) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (!g_node->gpus[gpu].mig_capable) DONE(state, NVML_ERROR_NOT_SUPPORTED);
    jv *gs = gpu_state(state, gpu), *gis = jget(gs, "gpuInstances");
    unsigned n = 0;
    for (size_t i = 0; i < jlen(gis) && jbool(jget(gs, "migCurrent"), 0); i++) {
        jv *cis = jget(jat(gis, i), "computeInstances");
        for (size_t k = 0; k < jlen(cis); k++, n++) {
            if (n == index) {
                *migDevice = &g_mig_handles[gpu][jint(jget(jat(gis, i), "id"), 0)][jint(jget(jat(cis, k), "id"), 0)];
                DONE(state, NVML_SUCCESS);
            }
        }
    }
    DONE(state, NVML_ERROR_NOT_FOUND);
}

nvmlReturn_t DECLDIR nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device) {
    ENTER();
    READ_STATE(state);
    int gpu;
    if ((rc = check_device(migDevice, state, &gpu)) != NVML_SUCCESS) DONE(state, rc);
    if (!device || migDevice->gi < 0) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    *device = &g_gpu_handles[gpu];
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    ENTER();
    if (!device || !isMigDevice || (!is_gpu_handle(device) && !is_mig_handle(device)))
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *isMigDevice = device->gi >= 0;
    LEAVE(NVML_SUCCESS);
}

static nvmlReturn_t mig_id(nvmlDevice_t device, unsigned int *id, int which) {
    ENTER();
    READ_STATE(state);
    int gpu;
    if ((rc = check_device(device, state, &gpu)) != NVML_SUCCESS) DONE(state, rc);
    if (!id) DONE(state, NVML_ERROR_INVALID_ARGUMENT);
    if (device->gi < 0) DONE(state, NVML_ERROR_NOT_SUPPORTED);
    *id = (unsigned)(which ? device->ci : device->gi);
    DONE(state, NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) { return mig_id(device, id, 0); }

nvmlReturn_t DECLDIR nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    return mig_id(device, id, 1);
}
