/* A stand-in for libnvidia-ml.so.1 on machines without a GPU, for tests only.
 *
 * It implements NVML's C ABI for every call appliance/gpu/nvml.py makes through pynvml
 * (nvidia-ml-py), so that the real bindings' ctypes calls and NvmlBackend run in tests:
 * nvmlInitWithFlags/nvmlInit_v2/nvmlShutdown, nvmlErrorString, nvmlDeviceGetCount_v2,
 * nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetHandleByUUID, nvmlDeviceGetMemoryInfo,
 * nvmlDeviceGetUUID, nvmlDeviceGetName, nvmlDeviceGetMinorNumber, nvmlDeviceGetMigMode,
 * nvmlDeviceGetComputeMode, nvmlDeviceGetComputeRunningProcesses_v3 and
 * nvmlDeviceGetMPSComputeRunningProcesses_v3 (nvmlProcessInfo_v2_t: pid, usedGpuMemory,
 * gpuInstanceId, computeInstanceId, as pynvml lays it out for v3).
 *
 * The simulated host is a text file, $STUB_NVML_STATE, re-read on every call (tests/nvml_standin.py
 * writes it), one record per line:
 *
 *   hostns <inode>                       the PID namespace the listed host PIDs belong to
 *   init <code>                          nvmlInit fails with this NVML error (e.g. 9: driver not loaded)
 *   fault <code>                         every device call fails with this NVML error
 *   device <minor> <total_mb> <foreign_mb> <mig> <mode> <uuid> <name...>
 *   proc <device> <host_pid> <used_mb|na> <ns_inode> <ns_pid> <freed_at_ms> <compute|mps>
 *
 * It is as unkind as the driver of the open-kernel-module era: a process's PID is translated
 * into the caller's PID namespace (host PID in the host's, ns_pid in the namespace the process
 * lives in) and processes the caller cannot see are left out of the list, though their memory
 * counts in the device's; usedGpuMemory is NVML_VALUE_NOT_AVAILABLE where the record says `na`
 * (MPS, some virtualised setups); a dead process stays listed until its memory is freed
 * (freed_at_ms, wall clock in ms; 0: not yet), whether or not it still runs; and the first
 * call of a process-list function with *count 0 answers NVML_ERROR_INSUFFICIENT_SIZE with the
 * number it needs, as pynvml expects.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_UNKNOWN 999
#define NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFULL
#define MIB (1024ULL * 1024ULL)
#define MAX_DEVICES 64
#define MAX_PROCS 1024

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

struct device {
    int index;
    unsigned int minor, mig, mode;
    unsigned long long total_mb, foreign_mb;
    char uuid[96], name[96];
};

struct proc {
    int device;
    unsigned int host_pid, ns_pid;
    unsigned long long ns, freed_at_ms;
    long long used_mb;  /* -1: not available */
    int mps;
};

static struct device devices[MAX_DEVICES];
static struct proc procs[MAX_PROCS];
static int n_devices, n_procs, init_error, fault, initialised;
static unsigned long long host_ns;

static unsigned long long now_ms(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (unsigned long long)tv.tv_sec * 1000ULL + (unsigned long long)tv.tv_usec / 1000ULL;
}

/* The simulated host as the state file says now; a missing file is a host without the driver. */
static int load(void) {
    const char *path = getenv("STUB_NVML_STATE");
    char line[512];
    FILE *fh = path ? fopen(path, "r") : NULL;
    n_devices = n_procs = init_error = fault = 0;
    host_ns = 0;
    if (fh == NULL) {
        init_error = NVML_ERROR_DRIVER_NOT_LOADED;
        return -1;
    }
    while (fgets(line, sizeof line, fh)) {
        line[strcspn(line, "\n")] = '\0';
        if (strncmp(line, "hostns ", 7) == 0) {
            host_ns = strtoull(line + 7, NULL, 10);
        } else if (strncmp(line, "init ", 5) == 0) {
            init_error = atoi(line + 5);
        } else if (strncmp(line, "fault ", 6) == 0) {
            fault = atoi(line + 6);
        } else if (strncmp(line, "device ", 7) == 0 && n_devices < MAX_DEVICES) {
            struct device *d = &devices[n_devices];
            int used = 0;
            if (sscanf(line + 7, "%u %llu %llu %u %u %95s %n", &d->minor, &d->total_mb, &d->foreign_mb,
                       &d->mig, &d->mode, d->uuid, &used) >= 6) {
                snprintf(d->name, sizeof d->name, "%s", used ? line + 7 + used : "Stand-in GPU");
                d->index = n_devices++;
            }
        } else if (strncmp(line, "proc ", 5) == 0 && n_procs < MAX_PROCS) {
            struct proc *p = &procs[n_procs];
            char used[32], kind[16] = "compute";
            if (sscanf(line + 5, "%d %u %31s %llu %u %llu %15s", &p->device, &p->host_pid, used, &p->ns,
                       &p->ns_pid, &p->freed_at_ms, kind) >= 6) {
                p->used_mb = strcmp(used, "na") == 0 ? -1 : atoll(used);
                p->mps = strcmp(kind, "mps") == 0;
                n_procs++;
            }
        }
    }
    fclose(fh);
    return 0;
}

static unsigned long long caller_ns(void) {
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (unsigned long long)st.st_ino : 0;
}

static int alive(const struct proc *p) { return p->freed_at_ms == 0 || now_ms() < p->freed_at_ms; }

/* The PID of p as the caller's namespace numbers it; 0 where the caller cannot see it. */
static unsigned int visible_pid(const struct proc *p, unsigned long long mine) {
    if (mine == host_ns) return p->host_pid;
    if (mine == p->ns) return p->ns_pid;
    return 0;
}

static nvmlReturn_t ready(void) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (load() != 0) return NVML_ERROR_DRIVER_NOT_LOADED;
    return fault;
}

static struct device *of(void *handle) {
    struct device *d = handle;
    if (d < devices || d >= devices + n_devices) return NULL;
    return d;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    load();
    if (init_error) return init_error;
    initialised++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    initialised--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case 15: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    nvmlReturn_t rc = ready();
    if (rc) return rc;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)n_devices;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    nvmlReturn_t rc = ready();
    if (rc) return rc;
    if (device == NULL || index >= (unsigned int)n_devices) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, void **device) {
    nvmlReturn_t rc = ready();
    if (rc) return rc;
    if (uuid == NULL || device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < n_devices; i++) {
        if (strcmp(devices[i].uuid, uuid) == 0) {
            *device = &devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* Every process holding memory on the device counts in its used memory, whether or not the
 * caller may see it, and whether or not NVML can tell how much is whose. */
nvmlReturn_t nvmlDeviceGetMemoryInfo(void *handle, nvmlMemory_t *memory) {
    nvmlReturn_t rc = ready();
    struct device *d;
    if (rc) return rc;
    if ((d = of(handle)) == NULL || memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long used = d->foreign_mb;
    for (int i = 0; i < n_procs; i++)
        if (procs[i].device == d->index && alive(&procs[i]) && procs[i].used_mb > 0) used += procs[i].used_mb;
    if (used > d->total_mb) used = d->total_mb;
    memory->total = d->total_mb * MIB;
    memory->used = used * MIB;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

static nvmlReturn_t text(const char *value, char *out, unsigned int length) {
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(void *handle, char *uuid, unsigned int length) {
    nvmlReturn_t rc = ready();
    struct device *d;
    if (rc) return rc;
    if ((d = of(handle)) == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    return text(d->uuid, uuid, length);
}

nvmlReturn_t nvmlDeviceGetName(void *handle, char *name, unsigned int length) {
    nvmlReturn_t rc = ready();
    struct device *d;
    if (rc) return rc;
    if ((d = of(handle)) == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    return text(d->name, name, length);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(void *handle, unsigned int *minor) {
    nvmlReturn_t rc = ready();
    struct device *d;
    if (rc) return rc;
    if ((d = of(handle)) == NULL || minor == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = d->minor;
    return NVML_SUCCESS;
}

/* mig 2 in the state file: a GPU without MIG support (NVML answers Not Supported). */
nvmlReturn_t nvmlDeviceGetMigMode(void *handle, unsigned int *current, unsigned int *pending) {
    nvmlReturn_t rc = ready();
    struct device *d;
    if (rc) return rc;
    if ((d = of(handle)) == NULL || current == NULL || pending == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->mig > 1) return NVML_ERROR_NOT_SUPPORTED;
    *current = *pending = d->mig;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeMode(void *handle, int *mode) {
    nvmlReturn_t rc = ready();
    struct device *d;
    if (rc) return rc;
    if ((d = of(handle)) == NULL || mode == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = (int)d->mode;
    return NVML_SUCCESS;
}

static nvmlReturn_t running(void *handle, unsigned int *count, nvmlProcessInfo_t *infos, int mps) {
    nvmlReturn_t rc = ready();
    struct device *d;
    unsigned long long mine = caller_ns();
    unsigned int n = 0;
    if (rc) return rc;
    if ((d = of(handle)) == NULL || count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < n_procs; i++)
        if (procs[i].device == d->index && procs[i].mps == mps && alive(&procs[i]) && visible_pid(&procs[i], mine))
            n++;
    if (*count < n || (infos == NULL && n > 0)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *count = 0;
    for (int i = 0; i < n_procs; i++) {
        const struct proc *p = &procs[i];
        unsigned int pid = visible_pid(p, mine);
        if (p->device != d->index || p->mps != mps || !alive(p) || pid == 0) continue;
        infos[*count].pid = pid;
        infos[*count].usedGpuMemory = p->used_mb < 0 ? NOT_AVAILABLE : (unsigned long long)p->used_mb * MIB;
        infos[*count].gpuInstanceId = 0xFFFFFFFFu;  /* no MIG instance */
        infos[*count].computeInstanceId = 0xFFFFFFFFu;
        (*count)++;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *handle, unsigned int *count, nvmlProcessInfo_t *infos) {
    return running(handle, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(void *handle, unsigned int *count, nvmlProcessInfo_t *infos) {
    return running(handle, count, infos, 1);
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    return text("580.95.05", version, length);
}
