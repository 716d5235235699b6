/*
 * A stand-in for NVIDIA's Fabric Manager SDK library (libnvfm.so.1) on the simulated node,
 * built from nvfm_sdk.h by nodesim.fabricmanager with the machine's C compiler.
 *
 * FM keeps its state in its daemon, behind a unix socket or a TCP port; every process that
 * connects sees the same partitions. Here the "daemon" is a state file beside the socket
 * path (<socket>.state; NVFM_STANDIN_STATE names it for a TCP address) that every call reads
 * and writes under flock(2), so the device plugin, katamgr and the tests share one fabric.
 * The socket path existing is FM running. Where it is a listening socket (the simulated node's
 * FM daemon, nodesim.fabricmanager.daemon) every call connects to it and is handed the state
 * file's descriptor (SCM_RIGHTS): a process that sees FM's directory read-only, as a pod does
 * through the chart's mount, reaches FM through its socket alone, as it reaches the real one.
 *
 * The partition tables are the guide's "GPU Partitions" chapter (default Shared NVSwitch
 * partitions): HGX H100 8-GPU (also H200, H800, H20) and HGX A100 8-GPU (one baseboard strapped
 * for the bottom tray: physical IDs 1-8). What FM refuses follows the guide's section 5
 * return values and its "Partition Life Cycle Errors" table.
 *
 * State file lines:  mode shared|baremetal   platform hgx-h100|hgx-a100   restarting 0|1
 *                    gpu <physicalId> <pci bus id> <uuid>   active <id>...   delay_ms <n>
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "nvfm_sdk.h"

#define MAX_GPUS 16

typedef struct { unsigned id; unsigned n; unsigned gpus[16]; unsigned nvlinks; } Partition;

/* HGX H100 8-GPU: the guide's "DGX H100 and NVIDIA HGX H100, Default GPU Partitions". */
static const Partition H100[] = {
    {0, 8, {1, 2, 3, 4, 5, 6, 7, 8}, 18},
    {1, 4, {1, 2, 3, 4}, 18}, {2, 4, {5, 6, 7, 8}, 18},
    {3, 2, {1, 3}, 18}, {4, 2, {2, 4}, 18}, {5, 2, {5, 7}, 18}, {6, 2, {6, 8}, 18},
    {7, 1, {1}, 0}, {8, 1, {2}, 0}, {9, 1, {3}, 0}, {10, 1, {4}, 0},
    {11, 1, {5}, 0}, {12, 1, {6}, 0}, {13, 1, {7}, 0}, {14, 1, {8}, 0},
};

/* HGX A100: the guide's "DGX A100 and NVIDIA HGX A100, Default GPU Partitions" (two
 * baseboards, physical IDs 1-16); FM drops the partitions whose GPUs are absent. */
static const Partition A100[] = {
    {0, 16, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, 12},
    {1, 8, {1, 2, 3, 4, 5, 6, 7, 8}, 12}, {2, 8, {9, 10, 11, 12, 13, 14, 15, 16}, 12},
    {3, 8, {1, 2, 3, 4, 9, 10, 11, 12}, 12}, {4, 8, {5, 6, 7, 8, 13, 14, 15, 16}, 12},
    {5, 8, {1, 2, 3, 4, 13, 14, 15, 16}, 12}, {6, 8, {5, 6, 7, 8, 9, 10, 11, 12}, 12},
    {7, 4, {1, 2, 3, 4}, 12}, {8, 4, {5, 6, 7, 8}, 12}, {9, 4, {9, 10, 11, 12}, 12}, {10, 4, {13, 14, 15, 16}, 12},
    {11, 2, {1, 2}, 12}, {12, 2, {3, 4}, 12}, {13, 2, {5, 6}, 12}, {14, 2, {7, 8}, 12},
    {15, 2, {9, 10}, 12}, {16, 2, {11, 12}, 12}, {17, 2, {13, 14}, 12}, {18, 2, {15, 16}, 12},
    {19, 1, {1}, 0}, {20, 1, {2}, 0}, {21, 1, {3}, 0}, {22, 1, {4}, 0}, {23, 1, {5}, 0}, {24, 1, {6}, 0},
    {25, 1, {7}, 0}, {26, 1, {8}, 0}, {27, 1, {9}, 0}, {28, 1, {10}, 0}, {29, 1, {11}, 0}, {30, 1, {12}, 0},
    {31, 1, {13}, 0}, {32, 1, {14}, 0}, {33, 1, {15}, 0}, {34, 1, {16}, 0},
};

typedef struct {
    int shared, restarting, delay_ms;
    char platform[32];
    int present[MAX_GPUS + 1];
    char bdf[MAX_GPUS + 1][FM_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    char uuid[MAX_GPUS + 1][FM_UUID_BUFFER_SIZE];
    int nactive;
    unsigned active[FM_MAX_FABRIC_PARTITIONS];
} State;

typedef struct { char socket[FM_MAX_STR_LENGTH]; char state[FM_MAX_STR_LENGTH + 8]; int unix_socket; } Conn;

static int initialised;

static const Partition *table(const State *s, size_t *n) {
    if (strcmp(s->platform, "hgx-a100") == 0) { *n = sizeof A100 / sizeof A100[0]; return A100; }
    *n = sizeof H100 / sizeof H100[0];
    return H100;
}

static int is_h100(const State *s) { return strcmp(s->platform, "hgx-a100") != 0; }

/* Whether FM reports the partition: on HGX H100 every default partition, whatever the GPUs'
 * state ("Supported GPU Partitions"); on HGX A100 only those whose GPUs are all present. */
static int supported(const State *s, const Partition *p) {
    if (is_h100(s)) return 1;
    for (unsigned i = 0; i < p->n; i++) if (!s->present[p->gpus[i]]) return 0;
    return 1;
}

static int is_active(const State *s, unsigned id) {
    for (int i = 0; i < s->nactive; i++) if (s->active[i] == id) return 1;
    return 0;
}

static int read_state(FILE *f, State *s) {
    char line[512];
    memset(s, 0, sizeof *s);
    strcpy(s->platform, "hgx-h100");
    s->shared = 1;
    rewind(f);
    while (fgets(line, sizeof line, f)) {
        char word[32] = "", a[128] = "", b[128] = "";
        unsigned n = 0;
        if (sscanf(line, "%31s", word) != 1) continue;
        if (strcmp(word, "mode") == 0 && sscanf(line, "%*s %127s", a) == 1) s->shared = strcmp(a, "shared") == 0;
        else if (strcmp(word, "platform") == 0) sscanf(line, "%*s %31s", s->platform);
        else if (strcmp(word, "restarting") == 0) sscanf(line, "%*s %d", &s->restarting);
        else if (strcmp(word, "delay_ms") == 0) sscanf(line, "%*s %d", &s->delay_ms);
        else if (strcmp(word, "gpu") == 0 && sscanf(line, "%*s %u %127s %127s", &n, a, b) >= 1 && n >= 1 && n <= MAX_GPUS) {
            s->present[n] = 1;
            snprintf(s->bdf[n], sizeof s->bdf[n], "%s", strcmp(a, "-") ? a : "");
            snprintf(s->uuid[n], sizeof s->uuid[n], "%s", strcmp(b, "-") && b[0] ? b : "");
        } else if (strcmp(word, "active") == 0) {
            char *rest = line + 6;
            int used = 0;
            while (s->nactive < FM_MAX_FABRIC_PARTITIONS && sscanf(rest, "%u%n", &n, &used) == 1) {
                s->active[s->nactive++] = n;
                rest += used;
            }
        }
    }
    return 0;
}

static void write_state(FILE *f, const State *s) {
    rewind(f);
    if (ftruncate(fileno(f), 0) != 0) return;
    fprintf(f, "mode %s\nplatform %s\nrestarting %d\ndelay_ms %d\n", s->shared ? "shared" : "baremetal",
            s->platform, s->restarting, s->delay_ms);
    for (int n = 1; n <= MAX_GPUS; n++)
        if (s->present[n]) fprintf(f, "gpu %d %s %s\n", n, s->bdf[n][0] ? s->bdf[n] : "-", s->uuid[n][0] ? s->uuid[n] : "-");
    fprintf(f, "active");
    for (int i = 0; i < s->nactive; i++) fprintf(f, " %u", s->active[i]);
    fprintf(f, "\n");
    fflush(f);
}

static int is_listening_socket(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISSOCK(st.st_mode);
}

/* The state's descriptor from the FM daemon at ``path`` (SCM_RIGHTS), or -1. */
static int state_from_daemon(const char *path) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) return -1;
    strcpy(addr.sun_path, path);
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0) return -1;
    struct timeval tv = {5, 0};  /* bounded, as FM's own calls are */
    setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    int fd = -1;
    char byte;
    union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } control;
    struct iovec iov = {&byte, 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    if (connect(sock, (struct sockaddr *)&addr, sizeof addr) == 0 && recvmsg(sock, &msg, 0) > 0) {
        struct cmsghdr *h = CMSG_FIRSTHDR(&msg);
        if (h && h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(h), sizeof fd);
    }
    close(sock);
    return fd;
}

/* Opens FM's state under an exclusive lock: FM answers one request at a time. */
static fmReturn_t open_fm(const Conn *c, FILE **f, State *s) {
    if (c->unix_socket && access(c->socket, F_OK) != 0) return FM_ST_CONNECTION_NOT_VALID;
    if (c->unix_socket && !getenv("NVFM_STANDIN_STATE") && is_listening_socket(c->socket)) {
        int fd = state_from_daemon(c->socket);
        *f = fd < 0 ? NULL : fdopen(fd, "r+");
        if (!*f && fd >= 0) close(fd);
    } else {
        *f = fopen(c->state, "r+");
    }
    if (!*f) return FM_ST_CONNECTION_NOT_VALID;
    flock(fileno(*f), LOCK_EX);
    read_state(*f, s);
    if (s->delay_ms > 0) {
        struct timespec ts = {s->delay_ms / 1000, (long)(s->delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    return FM_ST_SUCCESS;
}

static fmReturn_t close_fm(FILE *f, const State *s, fmReturn_t ret) {
    if (s) write_state(f, s);
    flock(fileno(f), LOCK_UN);
    fclose(f);
    return ret;
}

fmReturn_t fmLibInit(void) {
    if (initialised) return FM_ST_IN_USE;
    initialised = 1;
    return FM_ST_SUCCESS;
}

fmReturn_t fmLibShutdown(void) {
    if (!initialised) return FM_ST_UNINITIALIZED;
    initialised = 0;
    return FM_ST_SUCCESS;
}

fmReturn_t fmConnect(void *params, fmHandle_t *handle) {
    if (!initialised) return FM_ST_UNINITIALIZED;
    if (!params || !handle) return FM_ST_BADPARAM;
    fmConnectParams_v1 *p = params;
    if (p->version != MAKE_FM_PARAM_VERSION(fmConnectParams_v1, 1)
        && p->version != MAKE_FM_PARAM_VERSION(fmConnectParams_v2, 2)) return FM_ST_VERSION_MISMATCH;
    if (!p->addressInfo[0] || memchr(p->addressInfo, 0, FM_MAX_STR_LENGTH) == NULL) return FM_ST_BADPARAM;
    Conn *c = calloc(1, sizeof *c);
    if (!c) return FM_ST_GENERIC_ERROR;
    snprintf(c->socket, sizeof c->socket, "%s", p->addressInfo);
    c->unix_socket = p->addressIsUnixSocket != 0;
    const char *env = getenv("NVFM_STANDIN_STATE");
    if (env && *env) snprintf(c->state, sizeof c->state, "%s", env);
    else if (c->unix_socket) snprintf(c->state, sizeof c->state, "%s.state", c->socket);
    int daemon = c->unix_socket && !(env && *env) && is_listening_socket(c->socket);
    if (!c->state[0] || (!daemon && access(c->state, F_OK) != 0) || (c->unix_socket && access(c->socket, F_OK) != 0)) {
        free(c);
        return FM_ST_CONNECTION_NOT_VALID;
    }
    *handle = c;
    return FM_ST_SUCCESS;
}

fmReturn_t fmDisconnect(fmHandle_t handle) {
    if (!initialised) return FM_ST_UNINITIALIZED;
    if (!handle) return FM_ST_BADPARAM;
    free(handle);
    return FM_ST_SUCCESS;
}

/* The checks every partition call shares: library, handle, FM reachable, shared mode, not
 * waiting for the activated list after a restart (the guide's "Resiliency": partition
 * operations are rejected until fmSetActivatedFabricPartitions). */
static fmReturn_t begin(fmHandle_t handle, FILE **f, State *s, int allow_restarting) {
    if (!initialised) return FM_ST_UNINITIALIZED;
    if (!handle) return FM_ST_BADPARAM;
    fmReturn_t ret = open_fm(handle, f, s);
    if (ret != FM_ST_SUCCESS) return ret;
    if (!s->shared) return close_fm(*f, NULL, FM_ST_NOT_SUPPORTED);
    if (s->restarting && !allow_restarting) return close_fm(*f, NULL, FM_ST_NOT_CONFIGURED);
    return FM_ST_SUCCESS;
}

static const Partition *find(const State *s, unsigned id) {
    size_t n;
    const Partition *t = table(s, &n);
    for (size_t i = 0; i < n; i++) if (t[i].id == id && supported(s, &t[i])) return &t[i];
    return NULL;
}

fmReturn_t fmGetSupportedFabricPartitions(fmHandle_t handle, fmFabricPartitionList_t *list) {
    if (list && list->version != MAKE_FM_PARAM_VERSION(fmFabricPartitionList_t, 1)) return FM_ST_VERSION_MISMATCH;
    if (!list) return FM_ST_BADPARAM;
    FILE *f;
    State s;
    fmReturn_t ret = begin(handle, &f, &s, 0);
    if (ret != FM_ST_SUCCESS) return ret;
    size_t n;
    const Partition *t = table(&s, &n);
    unsigned version = list->version;
    memset(list, 0, sizeof *list);
    list->version = version;
    list->maxNumPartitions = (unsigned)n;
    for (size_t i = 0; i < n; i++) {
        if (!supported(&s, &t[i])) continue;
        fmFabricPartitionInfo_t *info = &list->partitionInfo[list->numPartitions++];
        info->partitionId = t[i].id;
        info->isActive = (unsigned)is_active(&s, t[i].id);
        info->numGpus = t[i].n;
        for (unsigned g = 0; g < t[i].n; g++) {
            fmFabricPartitionGpuInfo_t *gpu = &info->gpuInfo[g];
            unsigned id = t[i].gpus[g];
            gpu->physicalId = id;
            gpu->numNvLinksAvailable = t[i].nvlinks;
            gpu->maxNumNvLinks = is_h100(&s) ? 18 : 12;
            /* H100 and later: uuid and pciBusId empty; the hypervisor matches GPUs by
             * physical ID, the module ID (guide 5.1, note). */
            if (!is_h100(&s)) {
                snprintf(gpu->pciBusId, sizeof gpu->pciBusId, "%s", s.bdf[id]);
                snprintf(gpu->uuid, sizeof gpu->uuid, "%s", s.uuid[id]);
            }
        }
    }
    return close_fm(f, NULL, FM_ST_SUCCESS);
}

fmReturn_t fmActivateFabricPartition(fmHandle_t handle, fmFabricPartitionId_t id) {
    FILE *f;
    State s;
    fmReturn_t ret = begin(handle, &f, &s, 0);
    if (ret != FM_ST_SUCCESS) return ret;
    const Partition *p = find(&s, id);
    if (!p) return close_fm(f, NULL, FM_ST_BADPARAM);
    if (is_active(&s, id)) return close_fm(f, NULL, FM_ST_IN_USE);
    for (int i = 0; i < s.nactive; i++) {
        const Partition *other = find(&s, s.active[i]);
        for (unsigned a = 0; other && a < other->n; a++)
            for (unsigned b = 0; b < p->n; b++)
                if (other->gpus[a] == p->gpus[b]) return close_fm(f, NULL, FM_ST_IN_USE);
    }
    /* A GPU FM cannot reach (off the bus, failed): the fabric cannot be set up for it. */
    for (unsigned g = 0; g < p->n; g++) if (!s.present[p->gpus[g]]) return close_fm(f, NULL, FM_ST_GENERIC_ERROR);
    s.active[s.nactive++] = id;
    return close_fm(f, &s, FM_ST_SUCCESS);
}

fmReturn_t fmDeactivateFabricPartition(fmHandle_t handle, fmFabricPartitionId_t id) {
    FILE *f;
    State s;
    fmReturn_t ret = begin(handle, &f, &s, 0);
    if (ret != FM_ST_SUCCESS) return ret;
    if (!find(&s, id)) return close_fm(f, NULL, FM_ST_BADPARAM);
    for (int i = 0; i < s.nactive; i++) {
        if (s.active[i] != id) continue;
        s.active[i] = s.active[--s.nactive];
        return close_fm(f, &s, FM_ST_SUCCESS);
    }
    return close_fm(f, NULL, FM_ST_UNINITIALIZED);  /* the guide: "specified partition is not activated" */
}

fmReturn_t fmSetActivatedFabricPartitions(fmHandle_t handle, fmActivatedFabricPartitionList_t *list) {
    if (list && list->version != MAKE_FM_PARAM_VERSION(fmActivatedFabricPartitionList_t, 1)) return FM_ST_VERSION_MISMATCH;
    if (!list || list->numPartitions > FM_MAX_FABRIC_PARTITIONS) return FM_ST_BADPARAM;
    FILE *f;
    State s;
    fmReturn_t ret = begin(handle, &f, &s, 1);
    if (ret != FM_ST_SUCCESS) return ret;
    for (unsigned i = 0; i < list->numPartitions; i++)
        if (!find(&s, list->partitionIds[i])) return close_fm(f, NULL, FM_ST_BADPARAM);
    s.nactive = (int)list->numPartitions;
    memcpy(s.active, list->partitionIds, list->numPartitions * sizeof list->partitionIds[0]);
    s.restarting = 0;
    return close_fm(f, &s, FM_ST_SUCCESS);
}
