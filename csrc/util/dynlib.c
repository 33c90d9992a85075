#include "util/dynlib.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static const char *const ibverbs_names[] = {"libibverbs.so.1", "libibverbs.so", NULL};
static const char *const cuda_names[] = {"libcuda.so.1", "libcuda.so", NULL};

const mc_dynlib_spec_t mc_dynlib_ibverbs = {"RDMA (protocol \"rdma\")", ibverbs_names,
                                            "libibverbs1 (rdma-core) plus a provider such as "
                                            "ibverbs-providers"};
const mc_dynlib_spec_t mc_dynlib_cuda = {"GPU memory (location \"cuda:N\")", cuda_names,
                                         "the NVIDIA driver (libcuda1 / nvidia-driver)"};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;


void *mc_dynlib_open(const mc_dynlib_spec_t *spec, mc_err_t *err) {
  pthread_mutex_lock(&mu); /* dlerror() is not thread-safe */
  char why[256] = "";
  void *h = NULL;
  for (const char *const *n = spec->names; *n && !h; n++) {
    h = dlopen(*n, RTLD_NOW | RTLD_LOCAL);
    if (!h && !why[0]) {
      const char *e = dlerror();
      snprintf(why, sizeof why, "%s", e ? e : "not found");
    }
  }
  pthread_mutex_unlock(&mu);
  if (!h)
    mc_err_set(err, MC_EUNAVAIL, "%s needs %s, which cannot be loaded (%s); install %s",
               spec->what, spec->names[0], why, spec->debian_pkg);
  return h;
}

void *mc_dynlib_sym(void *handle, const mc_dynlib_spec_t *spec, const char *sym,
                    mc_err_t *err) {
  pthread_mutex_lock(&mu);
  dlerror();
  void *p = dlsym(handle, sym);
  pthread_mutex_unlock(&mu);
  if (!p)
    mc_err_set(err, MC_EUNAVAIL, "%s: symbol %s not found in %s; the installed library is "
               "too old — upgrade %s",
               spec->what, sym, spec->names[0], spec->debian_pkg);
  return p;
}
