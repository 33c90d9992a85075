#include "gpu/gpu_ipc.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu/cuda_driver.h"
#include "gpu/gpu_vmm.h"
#include "util/array.h"
#include "util/log.h"

static const char b64chars[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static void b64_encode(const unsigned char *in, size_t n, char *out) {
  size_t o = 0;
  for (size_t i = 0; i < n; i += 3) {
    unsigned v = (unsigned)in[i] << 16;
    if (i + 1 < n)
      v |= (unsigned)in[i + 1] << 8;
    if (i + 2 < n)
      v |= in[i + 2];
    out[o++] = b64chars[(v >> 18) & 63];
    out[o++] = b64chars[(v >> 12) & 63];
    out[o++] = i + 1 < n ? b64chars[(v >> 6) & 63] : '=';
    out[o++] = i + 2 < n ? b64chars[v & 63] : '=';
  }
  out[o] = '\0';
}

static int b64_val(char c) {
  const char *p = c ? strchr(b64chars, c) : NULL;
  return p ? (int)(p - b64chars) : -1;
}

/* Returns bytes decoded, or -1. */
static long b64_decode(const char *in, unsigned char *out, size_t cap) {
  size_t n = strlen(in), o = 0;
  if (n % 4)
    return -1;
  for (size_t i = 0; i < n; i += 4) {
    int a = b64_val(in[i]), b = b64_val(in[i + 1]);
    int c = in[i + 2] == '=' ? 0 : b64_val(in[i + 2]);
    int d = in[i + 3] == '=' ? 0 : b64_val(in[i + 3]);
    if (a < 0 || b < 0 || c < 0 || d < 0)
      return -1;
    unsigned v = (unsigned)a << 18 | (unsigned)b << 12 | (unsigned)c << 6 | (unsigned)d;
    unsigned char bytes[3] = {(unsigned char)(v >> 16), (unsigned char)(v >> 8),
                              (unsigned char)v};
    int k = in[i + 2] == '=' ? 1 : in[i + 3] == '=' ? 2 : 3;
    for (int j = 0; j < k; j++) {
      if (o >= cap)
        return -1;
      out[o++] = bytes[j];
    }
  }
  return (long)o;
}

int mc_gpu_ipc_export(uint64_t addr, char out_b64[MC_GPU_IPC_B64_MAX], uint64_t *alloc_base,
                      mc_err_t *err) {
  const mc_cuda_api_t *api = mc_cuda_api(err);
  if (!api)
    return err ? err->code : MC_EUNAVAIL;
  if (!api->cuIpcGetMemHandle)
    return mc_err_set(err, MC_EUNAVAIL, "this CUDA driver has no cuIpcGetMemHandle");
  mc_cu_ptr base = 0;
  if (api->cuPointerGetAttribute(&base, MC_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, addr) != 0)
    base = addr;
  mc_cu_ipc_handle_t h;
  mc_cu_result r = api->cuIpcGetMemHandle(&h, base);
  if (r != 0) {
    char m[160];
    return mc_err_set(err, MC_EUNAVAIL,
                      "GPU memory at 0x%llx cannot be exported with cuIpcGetMemHandle (%s): "
                      "same-host peers reach it over TCP instead",
                      (unsigned long long)addr, mc_cuda_strerror(api, r, m, sizeof m));
  }
  b64_encode(h.data, sizeof h.data, out_b64);
  *alloc_base = base;
  return 0;
}

int mc_gpu_ipc_export_range(uint64_t addr, uint64_t len, int device,
                            char out[MC_GPU_IPC_B64_MAX], uint64_t *alloc_base, mc_err_t *err) {
  /* Driver-mapped memory: cuIpcGetMemHandle cannot export it; its chunks
   * go as POSIX file descriptors (gpu_vmm.h). */
  if (mc_gpu_vmm_is_mapped(addr))
    return mc_gpu_vmm_export(addr, len, device, out, MC_GPU_IPC_B64_MAX, alloc_base, err);
  return mc_gpu_ipc_export(addr, out, alloc_base, err);
}

/* A peer's allocation (or driver-mapped export) mapped here: once per
 * (export, device) and process, shared by its users (mc_gpu_ipc_open and
 * mc_gpu_ipc_retain each take a reference), unmapped when the last one
 * lets go (mc_gpu_ipc_release). */
typedef struct opened {
  char b64[MC_GPU_IPC_B64_MAX];
  uint64_t hash; /* of b64: handles of one exporter share long prefixes */
  int device;
  int vmm; /* a "vmm1:" import (mc_gpu_vmm_unimport), else cuIpcOpenMemHandle's */
  long refs;
  uint64_t mapped;
} opened_t;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static opened_t *g_open;
static size_t g_nopen, g_capopen;

static uint64_t fnv1a(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++)
    h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

/* Caller holds g_mu.  The mapping of (b64, device) open now, or NULL. */
static opened_t *find_opened(const char *b64, uint64_t hash, int device) {
  for (size_t i = 0; i < g_nopen; i++)
    if (g_open[i].hash == hash && g_open[i].device == device && !strcmp(g_open[i].b64, b64))
      return &g_open[i];
  return NULL;
}

/* Caller holds g_mu.  Room for one more entry (made before mapping, so a
 * mapping made is always remembered and so can be released); -1 when out
 * of memory. */
static int reserve_slot(void) {
  opened_t *v = mc_array_room(g_open, g_nopen, &g_capopen, sizeof *v, 16);
  if (!v)
    return -1;
  g_open = v;
  return 0;
}

/* Caller holds g_mu and reserve_slot() succeeded: remembers a mapping made
 * with its first reference. */
static void remember(const char *b64, uint64_t hash, int device, int vmm, uint64_t p) {
  opened_t *o = &g_open[g_nopen++];
  snprintf(o->b64, sizeof o->b64, "%s", b64);
  o->hash = hash;
  o->device = device;
  o->vmm = vmm;
  o->refs = 1;
  o->mapped = p;
}

/* Caller holds g_mu (an open of the same export waits: a legacy handle
 * opens once per process).  Unmaps o; nothing uses it any more. */
static void unmap_opened(const opened_t *o) {
  mc_err_t err = {0};
  mc_cu_context saved = NULL;
  int changed = mc_cuda_enter_device(o->device, &saved, &err), rc = changed;
  if (changed >= 0) {
    if (o->vmm) {
      rc = mc_gpu_vmm_unimport(o->mapped, &err);
    } else {
      const mc_cuda_api_t *api = mc_cuda_api(&err);
      mc_cu_result r = api && api->cuIpcCloseMemHandle ? api->cuIpcCloseMemHandle(o->mapped) : 1;
      char m[160] = "no cuIpcCloseMemHandle";
      rc = r == 0 ? 0 : mc_err_set(&err, MC_EUNAVAIL, "cuIpcCloseMemHandle: %s",
                                    api && api->cuIpcCloseMemHandle
                                        ? mc_cuda_strerror(api, r, m, sizeof m) : m);
    }
    mc_cuda_leave_device(saved, changed);
  }
  if (rc < 0)
    mc_log_warn("cannot unmap a peer's GPU memory mapped at 0x%llx on cuda:%d (%s): the "
                "mapping stays until this process exits", (unsigned long long)o->mapped,
                o->device, err.msg);
  else
    mc_log_info_rated("unmapped a peer's GPU memory (%s) from cuda:%d: no current descriptor of the "
                "peer lists it and no copy uses it", o->vmm ? "cuMem export" : "CUDA IPC",
                o->device);
}

/* A driver-mapped export: imported once per (export, device), under the
 * lock so two threads never import it twice. */
static int open_vmm(const char *name, uint64_t hash, int device, uint64_t *mapped,
                    mc_err_t *err) {
  if (strlen(name) >= MC_GPU_IPC_B64_MAX)
    return mc_err_set(err, MC_EINVAL, "malformed GPU memory export \"%.40s...\" in a peer's "
                      "segment descriptor", name);
  pthread_mutex_lock(&g_mu);
  opened_t *o = find_opened(name, hash, device);
  int rc = 0;
  if (o) {
    o->refs++;
    *mapped = o->mapped;
  } else if (reserve_slot() < 0) {
    rc = mc_err_set(err, MC_ENOMEM, "out of memory mapping a peer's GPU memory");
  } else if ((rc = mc_gpu_vmm_import(name, device, mapped, err)) == 0) {
    remember(name, hash, device, 1, *mapped);
  }
  pthread_mutex_unlock(&g_mu);
  return rc;
}

/* The mapping of (b64, device) if open: its address, a reference taken. */
static int open_again(const char *b64, uint64_t hash, int device, uint64_t *mapped) {
  pthread_mutex_lock(&g_mu);
  opened_t *o = find_opened(b64, hash, device);
  if (o) {
    o->refs++;
    *mapped = o->mapped;
  }
  pthread_mutex_unlock(&g_mu);
  return o ? 0 : -1;
}

int mc_gpu_ipc_open(const char *b64, int device, uint64_t *mapped, mc_err_t *err) {
  uint64_t hash = fnv1a(b64);
  if (open_again(b64, hash, device, mapped) == 0)
    return 0;
  if (!strncmp(b64, MC_GPU_VMM_PREFIX, strlen(MC_GPU_VMM_PREFIX)))
    return open_vmm(b64, hash, device, mapped, err);
  const mc_cuda_api_t *api = mc_cuda_api(err);
  if (!api)
    return err ? err->code : MC_EUNAVAIL;
  if (!api->cuIpcOpenMemHandle)
    return mc_err_set(err, MC_EUNAVAIL, "this CUDA driver has no cuIpcOpenMemHandle");
  mc_cu_ipc_handle_t h;
  if (strlen(b64) >= MC_GPU_IPC_B64_MAX ||
      b64_decode(b64, h.data, sizeof h.data) != (long)sizeof h.data)
    return mc_err_set(err, MC_EINVAL, "malformed CUDA IPC handle \"%.20s...\" in a peer's "
                      "segment descriptor", b64);
  int rc = mc_cuda_use_device(device, err);
  if (rc < 0)
    return rc;
  mc_cu_ptr p = 0;
  pthread_mutex_lock(&g_mu);
  /* Re-check under the lock: opening one handle twice in a process fails. */
  opened_t *o = find_opened(b64, hash, device);
  if (o) {
    o->refs++;
    *mapped = o->mapped;
    pthread_mutex_unlock(&g_mu);
    return 0;
  }
  if (reserve_slot() < 0) {
    pthread_mutex_unlock(&g_mu);
    return mc_err_set(err, MC_ENOMEM, "out of memory mapping a peer's GPU memory");
  }
  mc_cu_result r = api->cuIpcOpenMemHandle(&p, h, MC_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r != 0) {
    pthread_mutex_unlock(&g_mu);
    char m[160];
    return mc_err_set(err, MC_EUNAVAIL,
                      "cannot open a peer's CUDA IPC handle on cuda:%d (%s); the peer must be "
                      "on this host with its GPU visible to this process",
                      device, mc_cuda_strerror(api, r, m, sizeof m));
  }
  remember(b64, hash, device, 0, p);
  pthread_mutex_unlock(&g_mu);
  const char *dg = getenv("MC_GPU_DIAG");
  if (dg && (dg[0] == '1' || dg[0] == '2')) /* issue 30: where the import landed (GPU pages are up to 2 MiB) */
    mc_log_info("GPU diag: a peer's CUDA IPC handle opened on cuda:%d at 0x%llx (%llu KiB into "
                "a 2 MiB page)", device, (unsigned long long)p,
                (unsigned long long)(p % (2u << 20)) >> 10);
  *mapped = p;
  return 0;
}

/* Caller holds g_mu.  The open mapping at `mapped` on `device`, or NULL. */
static opened_t *find_mapped(uint64_t mapped, int device) {
  for (size_t i = 0; i < g_nopen; i++)
    if (g_open[i].mapped == mapped && g_open[i].device == device)
      return &g_open[i];
  return NULL;
}

int mc_gpu_ipc_retain(uint64_t mapped, int device) {
  pthread_mutex_lock(&g_mu);
  opened_t *o = find_mapped(mapped, device);
  if (o)
    o->refs++;
  pthread_mutex_unlock(&g_mu);
  return o ? 0 : -1;
}

void mc_gpu_ipc_release(uint64_t mapped, int device) {
  pthread_mutex_lock(&g_mu);
  opened_t *o = find_mapped(mapped, device);
  if (o && --o->refs == 0) {
    opened_t gone = *o;
    *o = g_open[--g_nopen];
    unmap_opened(&gone);
  }
  pthread_mutex_unlock(&g_mu);
}

size_t mc_gpu_ipc_open_count(void) {
  pthread_mutex_lock(&g_mu);
  size_t n = g_nopen;
  pthread_mutex_unlock(&g_mu);
  return n;
}

static pthread_once_t g_id_once = PTHREAD_ONCE_INIT;
static char g_id[320];

static void make_id(void) {
  char boot[64] = "", host[256] = "";
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    if (fgets(boot, sizeof boot, f))
      boot[strcspn(boot, "\n")] = '\0';
    fclose(f);
  }
  gethostname(host, sizeof host - 1);
  snprintf(g_id, sizeof g_id, "%s/%s", boot, host);
}

const char *mc_host_identity(void) {
  pthread_once(&g_id_once, make_id);
  return g_id;
}
