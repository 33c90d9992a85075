/* Run-time loading of optional system libraries (CUDA driver, ibverbs;
 * the RDMA transport exchanges connection data over its own control
 * channel, so it needs no librdmacm).  The extension links none of them,
 * so one build imports on hosts with or without GPUs and RDMA; they are
 * opened on first use. */
#ifndef MC_UTIL_DYNLIB_H
#define MC_UTIL_DYNLIB_H

#include "util/errors.h"

typedef struct mc_dynlib_spec {
  const char *what;          /* "RDMA (protocol \"rdma\")", for messages */
  const char *const *names;  /* sonames to try, NULL-terminated */
  const char *debian_pkg;    /* package that provides it */
} mc_dynlib_spec_t;

extern const mc_dynlib_spec_t mc_dynlib_ibverbs;
extern const mc_dynlib_spec_t mc_dynlib_cuda;

/* dlopen()s the first loadable soname.  Returns a handle, or NULL with
 * MC_EUNAVAIL: "<what> needs libX (not found: dlerror); install the Debian
 * package P". Handles are cached for the life of the process. */
void *mc_dynlib_open(const mc_dynlib_spec_t *spec, mc_err_t *err);

/* Looks up a symbol; NULL with MC_EUNAVAIL naming the symbol and library. */
void *mc_dynlib_sym(void *handle, const mc_dynlib_spec_t *spec, const char *sym,
                    mc_err_t *err);

#endif
