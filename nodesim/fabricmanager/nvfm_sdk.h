/*
 * The part of NVIDIA's Fabric Manager SDK (libnvfm.so.1, headers nv_fm_agent.h and
 * nv_fm_types.h) that kata-sandbox-manager calls, written down in our own words from
 * NVIDIA's "Fabric Manager User Guide" (docs.nvidia.com/datacenter/tesla/
 * fabric-manager-user-guide): section 5.1 (data structures), 5.2-5.10 (the calls) and the
 * "Partition Life Cycle Errors" table. Declarations only: the stand-in library beside
 * this file (libnvfm.c) implements them for the simulated node, and
 * gpunode/services/fabricmanager.py mirrors the same layouts with ctypes.
 *
 * Every structure passed by pointer starts with a version word: the structure's size in the
 * low 24 bits and its version number in the top 8 (the SDK's MAKE_FM_PARAM_VERSION). FM
 * answers FM_ST_VERSION_MISMATCH to any other word.
 */
#ifndef KSM_NVFM_SDK_H
#define KSM_NVFM_SDK_H

typedef enum {
    FM_ST_SUCCESS = 0,
    FM_ST_BADPARAM = -1,              /* an argument, or a partition id FM does not support */
    FM_ST_GENERIC_ERROR = -2,
    FM_ST_NOT_SUPPORTED = -3,         /* FM not started in a shared-fabric mode (FABRIC_MODE) */
    FM_ST_UNINITIALIZED = -4,         /* library not initialised; or, from deactivate, partition not active */
    FM_ST_TIMEOUT = -5,
    FM_ST_VERSION_MISMATCH = -6,
    FM_ST_IN_USE = -7,                /* partition already active, or one of its GPUs is in an active one */
    FM_ST_NOT_CONFIGURED = -8,        /* FM still initialising (or restarting) */
    FM_ST_CONNECTION_NOT_VALID = -9,  /* FM cannot be reached */
    FM_ST_NVLINK_ERROR = -10,
} fmReturn_t;

typedef void *fmHandle_t;
typedef unsigned int fmFabricPartitionId_t;

#define FM_MAX_STR_LENGTH 256
#define FM_UUID_BUFFER_SIZE 80
#define FM_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define FM_MAX_NUM_GPUS 16
#define FM_MAX_FABRIC_PARTITIONS 64

#define MAKE_FM_PARAM_VERSION(type, ver) (unsigned int)(sizeof(type) | ((ver) << 24))

/* fmConnect's options; version 1 is the guide's layout, version 2 (newer SDKs) adds
 * addressType after it. addressInfo: "host[:port]" (port 6666 by default) or a unix
 * socket's path with addressIsUnixSocket set. */
typedef struct {
    unsigned int version;
    char addressInfo[FM_MAX_STR_LENGTH];
    unsigned int timeoutMs;
    unsigned int addressIsUnixSocket;
} fmConnectParams_v1;

typedef struct {
    unsigned int version;
    char addressInfo[FM_MAX_STR_LENGTH];
    unsigned int timeoutMs;
    unsigned int addressIsUnixSocket;
    int addressType;                  /* 1 inet, 2 unix, 3 vsock */
} fmConnectParams_v2;

/* One GPU of a partition. physicalId is the GPU's module ID on HGX H100 and later (there
 * FM leaves uuid and pciBusId empty); on HGX A100 FM fills pciBusId. */
typedef struct {
    unsigned int physicalId;
    char uuid[FM_UUID_BUFFER_SIZE];
    char pciBusId[FM_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned int numNvLinksAvailable;
    unsigned int maxNumNvLinks;
    unsigned int nvlinkLineRateMBps;
} fmFabricPartitionGpuInfo_t;

typedef struct {
    fmFabricPartitionId_t partitionId;
    unsigned int isActive;
    unsigned int numGpus;
    fmFabricPartitionGpuInfo_t gpuInfo[FM_MAX_NUM_GPUS];
} fmFabricPartitionInfo_t;

/* version 1 of this layout */
typedef struct {
    unsigned int version;
    unsigned int numPartitions;
    unsigned int maxNumPartitions;
    fmFabricPartitionInfo_t partitionInfo[FM_MAX_FABRIC_PARTITIONS];
} fmFabricPartitionList_t;

/* version 1 of this layout */
typedef struct {
    unsigned int version;
    unsigned int numPartitions;
    fmFabricPartitionId_t partitionIds[FM_MAX_FABRIC_PARTITIONS];
} fmActivatedFabricPartitionList_t;

fmReturn_t fmLibInit(void);
fmReturn_t fmLibShutdown(void);
fmReturn_t fmConnect(void *connectParams, fmHandle_t *handle);   /* v1 or v2 params */
fmReturn_t fmDisconnect(fmHandle_t handle);
fmReturn_t fmGetSupportedFabricPartitions(fmHandle_t handle, fmFabricPartitionList_t *list);
fmReturn_t fmActivateFabricPartition(fmHandle_t handle, fmFabricPartitionId_t partitionId);
fmReturn_t fmDeactivateFabricPartition(fmHandle_t handle, fmFabricPartitionId_t partitionId);
/* After FM restarts (--restart), the partitions still active, within FM's wait; zero of
 * them is a valid list (guide 5.10, "Resiliency"). */
fmReturn_t fmSetActivatedFabricPartitions(fmHandle_t handle, fmActivatedFabricPartitionList_t *list);

#endif
