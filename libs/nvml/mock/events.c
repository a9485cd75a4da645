/* Event sets over the state file's event log (fake.events does the same in Python): a set
 * starts at the state's nextEventSeq and nvmlEventSetWait polls the file every POLL_MS until an
 * event for a registered GPU and type arrives or the timeout passes. The library lock is not
 * held while sleeping, so other threads' calls go on; a set must not be waited on by two
 * threads at once (as in NVML). */
#include "mock.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define POLL_MS 10

/* What a real H200 (driver 580.159.04) answers; the state's events only ever carry XIDs, ECC
 * errors and lost GPUs, so the other types register but never fire. */
#define SUPPORTED_EVENTS 0xff9fULL

struct nvmlEventSet_st {
    unsigned long long mask[MAX_GPUS]; /* registered event types per GPU */
    long long cursor;                  /* the next event sequence number to look at */
};

nvmlReturn_t DECLDIR nvmlEventSetCreate(nvmlEventSet_t *set) {
    ENTER();
    if (!set) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t rc;
    jv *state = state_read(&rc);
    if (!state) LEAVE(rc);
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s) {
        json_free(state);
        LEAVE(NVML_ERROR_MEMORY);
    }
    s->cursor = jint(jget(state, "nextEventSeq"), 1);
    json_free(state);
    *set = s;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlEventSetFree(nvmlEventSet_t set) {
    ENTER();
    if (!set) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    free(set);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    ENTER();
    nvmlReturn_t rc;
    jv *state = state_read(&rc);
    int gpu;
    if (!state) LEAVE(rc);
    if ((rc = check_device(device, state, &gpu)) == NVML_SUCCESS && !eventTypes) rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) *eventTypes = SUPPORTED_EVENTS;
    json_free(state);
    LEAVE(rc);
}

nvmlReturn_t DECLDIR nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    ENTER();
    nvmlReturn_t rc;
    jv *state = state_read(&rc);
    int gpu;
    if (!state) LEAVE(rc);
    if ((rc = check_device(device, state, &gpu)) == NVML_SUCCESS && (!set || device->gi >= 0))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && (eventTypes & ~SUPPORTED_EVENTS)) rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS) set->mask[gpu] |= eventTypes;
    json_free(state);
    LEAVE(rc);
}

static unsigned long long event_type(const char *kind) {
    if (!strcmp(kind, "xid")) return nvmlEventTypeXidCriticalError;
    if (!strcmp(kind, "ecc-double-bit")) return nvmlEventTypeDoubleBitEccError;
    if (!strcmp(kind, "ecc-single-bit")) return nvmlEventTypeSingleBitEccError;
    if (!strcmp(kind, "gpu-lost")) return nvmlEventTypeGpuUnavailableError;
    return 0;
}

/* One look at the log: SUCCESS with data, TIMEOUT when nothing is due, or an error. */
static nvmlReturn_t poll_once(nvmlEventSet_t set, nvmlEventData_t *data) {
    nvmlReturn_t rc;
    jv *state = state_read(&rc);
    if (!state) return rc;
    rc = NVML_ERROR_TIMEOUT;
    jv *events = jget(state, "events");
    for (size_t i = 0; i < jlen(events) && rc == NVML_ERROR_TIMEOUT; i++) {
        jv *ev = jat(events, i);
        long long seq = jint(jget(ev, "seq"), 0), gpu = jint(jget(ev, "gpu"), -1);
        if (seq < set->cursor) continue;
        set->cursor = seq + 1;
        if (gpu < 0 || gpu >= (long long)g_node->n_gpus || !set->mask[gpu]) continue;
        unsigned long long type = event_type(jstr(jget(ev, "kind"), ""));
        if (type == nvmlEventTypeGpuUnavailableError && !(set->mask[gpu] & type)) {
            rc = NVML_ERROR_GPU_IS_LOST; /* a lost GPU fails the wait when it has no event for it */
            break;
        }
        if (!(set->mask[gpu] & type)) continue;
        long long gi = jint(jget(ev, "gpuInstanceId"), -1), ci = jint(jget(ev, "computeInstanceId"), -1);
        memset(data, 0, sizeof *data);
        data->device = &g_gpu_handles[gpu];
        data->eventType = type;
        data->eventData = type == nvmlEventTypeXidCriticalError ? (unsigned long long)jint(jget(ev, "xid"), 999) : 0;
        data->gpuInstanceId = gi < 0 ? NO_ID : (unsigned)gi;
        data->computeInstanceId = ci < 0 ? NO_ID : (unsigned)ci;
        rc = NVML_SUCCESS;
    }
    json_free(state);
    return rc;
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

nvmlReturn_t DECLDIR nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    long long deadline = now_ms() + timeoutms;
    for (;;) {
        ENTER();
        if (!set || !data) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
        nvmlReturn_t rc = poll_once(set, data);
        pthread_mutex_unlock(&g_lock);
        long long left = deadline - now_ms();
        if (rc != NVML_ERROR_TIMEOUT || left <= 0) return rc;
        struct timespec pause = {0, (left < POLL_MS ? left : POLL_MS) * 1000000L};
        nanosleep(&pause, NULL);
    }
}
