/* A stand-in for libcuda.so.1 on machines without a GPU, for tests only.
 *
 * It implements the few driver-API calls the appliance's jails make, and makes its CUDA
 * "context" an MPS client of the simulated daemon (appliance/gpu/mps_simulated.py): the
 * primary context connects to $CUDA_MPS_PIPE_DIRECTORY/sim-client, and every allocation is
 * granted or refused (CUDA_ERROR_OUT_OF_MEMORY) by that daemon against the limit it fixed
 * for this client when it connected, as the real MPS daemon does. Like a real MPS client it
 * must map the daemon's shared memory (the daemon names the file; the real one keeps it in
 * /dev/shm): where the file cannot be opened (a jail's private, empty /dev/shm) the context
 * fails with CUDA_ERROR_MPS_CONNECTION_FAILED.
 *
 * Without an MPS daemon (no $CUDA_MPS_PIPE_DIRECTORY/sim-client), the context is a plain GPU's:
 * it connects to the socket `sim-gpu` next to this library, where the acceptance kit's
 * simulated device memory (benchmarks/gpu_acceptance.py, SimulatedGpuMemory) charges the
 * context's own memory (hundreds of MiB, as NVML counts a real context), grants allocations
 * up to the device's size and reports both to the simulated NVML backend.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <libgen.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_DEVICES_UNAVAILABLE 46
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_MPS_CONNECTION_FAILED 805

static int initialised = 0;
static int client = -1;
static long long limit_mb = -1;  /* what the daemon fixed for this client; -1: none */

static int ask(const char *line, char *reply, size_t size) {
    size_t len = strlen(line), got = 0;
    if (write(client, line, len) != (ssize_t)len) return -1;
    while (got + 1 < size) {
        ssize_t n = read(client, reply + got, 1);
        if (n <= 0) return -1;
        if (reply[got++] == '\n') break;
    }
    reply[got] = '\0';
    return 0;
}

int cuInit(unsigned int flags) { (void)flags; initialised = 1; return CUDA_SUCCESS; }

int cuDeviceGet(int *device, int ordinal) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    *device = ordinal;
    return CUDA_SUCCESS;
}

static int char_device(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISCHR(st.st_mode);
}

/* Where the process has GPU device nodes (/dev/nvidiactl), a device is usable only if its own
 * node /dev/nvidia<i> is there too (device GPU-SIM-<i>), as the real driver opens the node: a
 * jail that names another GPU in CUDA_VISIBLE_DEVICES still cannot reach it. Without any node
 * (a simulated host), the variable alone decides. */
static int reachable(const char *uuid, size_t len) {
    char node[64];
    int minor;
    if (!char_device("/dev/nvidiactl")) return 1;
    if (len <= 8 || strncmp(uuid, "GPU-SIM-", 8) != 0) return 0;
    minor = atoi(uuid + 8);
    snprintf(node, sizeof node, "/dev/nvidia%d", minor);
    return char_device(node);
}

/* The devices a process may use are those CUDA_VISIBLE_DEVICES names (comma-separated UUIDs,
 * as the appliance sets it); unset, every device of the simulated host (STUB_CUDA_DEVICES,
 * default 8), as the real driver shows every GPU when the variable is unset. Either way only
 * the reachable ones (above). */
static int visible(int ordinal, char *uuid, size_t size) {
    const char *list = getenv("CUDA_VISIBLE_DEVICES");
    char name[64];
    int n = 0;
    if (list == NULL) {
        const char *all = getenv("STUB_CUDA_DEVICES");
        int total = all ? atoi(all) : 8;
        for (int i = 0; i < total; i++) {
            snprintf(name, sizeof name, "GPU-SIM-%d", i);
            if (!reachable(name, strlen(name))) continue;
            if (uuid != NULL && n == ordinal) snprintf(uuid, size, "%s", name);
            n++;
        }
        return n;
    }
    for (const char *p = list; *p; ) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len > 0 && reachable(p, len)) {
            if (uuid != NULL && n == ordinal) snprintf(uuid, size, "%.*s", (int)len, p);
            n++;
        }
        if (!end) break;
        p = end + 1;
    }
    return n;
}

int cuDeviceGetCount(int *count) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    *count = visible(-1, NULL, 0);
    return CUDA_SUCCESS;
}

/* The device's 16-byte UUID. A real one is the hex of "GPU-xxxxxxxx-xxxx-..."; a simulated
 * UUID ("GPU-SIM-0") is not hex, so its bytes are the text after "GPU-", NUL-padded (the
 * acceptance kit's uuid_bytes() reads both forms). */
int cuDeviceGetUuid(unsigned char *bytes, int device) {
    char uuid[128] = "";
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (device < 0 || device >= visible(-1, NULL, 0)) return CUDA_ERROR_INVALID_DEVICE;
    visible(device, uuid, sizeof uuid);
    memset(bytes, 0, 16);
    strncpy((char *)bytes, strncmp(uuid, "GPU-", 4) == 0 ? uuid + 4 : uuid, 16);
    return CUDA_SUCCESS;
}

int cuDeviceGetUuid_v2(unsigned char *bytes, int device) { return cuDeviceGetUuid(bytes, device); }

/* A plain GPU's context: the simulated device memory next to this library. */
static int plain_context(const char *uuid) {
    Dl_info info;
    char path[512], line[256], reply[64];
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (dladdr((void *)plain_context, &info) == 0 || info.dli_fname == NULL) return CUDA_ERROR_DEVICES_UNAVAILABLE;
    snprintf(path, sizeof path, "%s", info.dli_fname);
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s/sim-gpu", dirname(path));
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        if (fd >= 0) close(fd);
        return CUDA_ERROR_DEVICES_UNAVAILABLE;
    }
    client = fd;
    reply[0] = '\0';
    snprintf(line, sizeof line, "gpu %s\n", uuid ? uuid : "");
    if (ask(line, reply, sizeof reply) != 0 || strncmp(reply, "ok", 2) != 0) {
        /* "oom": a context takes device memory of its own, and the device has not that much
         * left (as the real driver fails cuDevicePrimaryCtxRetain on a full GPU). */
        int rc = strncmp(reply, "oom", 3) == 0 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_DEVICES_UNAVAILABLE;
        close(client);
        client = -1;
        return rc;
    }
    return CUDA_SUCCESS;
}

int cuDevicePrimaryCtxRetain(void **ctx, int device) {
    (void)device;
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (client < 0) {
        const char *pipe = getenv("CUDA_MPS_PIPE_DIRECTORY");
        char sock[512];
        struct stat sst;
        snprintf(sock, sizeof sock, "%s/sim-client", pipe ? pipe : "/tmp/nvidia-mps");
        if (stat(sock, &sst) != 0) {  /* no MPS daemon: a plain GPU */
            int rc = plain_context(getenv("CUDA_VISIBLE_DEVICES"));
            if (rc != CUDA_SUCCESS) return rc;
            *ctx = (void *)&client;
            return CUDA_SUCCESS;
        }
        const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
        const char *uuid = getenv("CUDA_VISIBLE_DEVICES");
        struct sockaddr_un addr = {.sun_family = AF_UNIX};
        char line[256], reply[64], shm[512];
        struct stat st;
        snprintf(addr.sun_path, sizeof addr.sun_path, "%s/sim-client", dir ? dir : "/tmp/nvidia-mps");
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
            if (fd >= 0) close(fd);
            return CUDA_ERROR_DEVICES_UNAVAILABLE;  /* as on an EXCLUSIVE_PROCESS GPU */
        }
        client = fd;
        snprintf(line, sizeof line, "hello %s\n", uuid ? uuid : "");
        if (ask(line, shm, sizeof shm) != 0 || strncmp(shm, "shm ", 4) != 0) {
            close(client);
            client = -1;
            return CUDA_ERROR_DEVICES_UNAVAILABLE;
        }
        shm[strcspn(shm, "\n")] = '\0';
        if (stat(shm + 4, &st) != 0) {  /* the daemon's shared memory is not there to map */
            close(client);
            client = -1;
            return CUDA_ERROR_MPS_CONNECTION_FAILED;
        }
        snprintf(line, sizeof line, "attach %llu\n", (unsigned long long)st.st_ino);
        if (ask(line, reply, sizeof reply) != 0 || strncmp(reply, "ok", 2) != 0) {
            close(client);
            client = -1;
            return CUDA_ERROR_MPS_CONNECTION_FAILED;
        }
        limit_mb = strncmp(reply, "ok none", 7) == 0 ? -1 : atoll(reply + 3);
    }
    *ctx = (void *)&client;
    return CUDA_SUCCESS;
}

int cuCtxSetCurrent(void *ctx) { return ctx == (void *)&client ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT; }

int cuMemAlloc_v2(unsigned long long *ptr, size_t bytes) {
    char line[64], reply[16];
    static unsigned long long next = 0x10000000ULL;
    if (client < 0) return CUDA_ERROR_INVALID_CONTEXT;
    snprintf(line, sizeof line, "alloc %zu\n", bytes);
    if (ask(line, reply, sizeof reply) != 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (strncmp(reply, "ok", 2) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = next;
    next += bytes;
    return CUDA_SUCCESS;
}

/* Not a CUDA call: lets a test read the limit the simulated daemon gave this client. */
long long simClientLimitMB(void) { return limit_mb; }
