/* Error codes and the error record every fallible call fills in.
 *
 * Convention: functions return 0 (or a non-negative count) on success and a
 * negative MC_E* code on failure.  When a caller passes a non-NULL mc_err_t,
 * the failing function also writes a one-line, human-readable reason that
 * names what was wrong and, where possible, how to fix it.
 */
#ifndef MC_UTIL_ERRORS_H
#define MC_UTIL_ERRORS_H

#include <stddef.h>

/* X-macro: one line per code, the single source of names and texts. */
#define MC_ERRNO_MAP(X)                                                        \
  X(EINVAL, -1, "invalid argument")                                           \
  X(ENOMEM, -2, "out of memory")                                              \
  X(ECONFIG, -3, "invalid configuration")                                     \
  X(ETIMEDOUT, -4, "timed out")                                               \
  X(ECONNECT, -5, "could not connect to peer")                                \
  X(EPEERCLOSED, -6, "peer closed the connection")                            \
  X(EPROTO, -7, "protocol error")                                             \
  X(ERANGE, -8, "address range not registered")                               \
  X(EMETADATA, -9, "metadata server error")                                   \
  X(ENOTFOUND, -10, "not found")                                              \
  X(ESYS, -11, "system call failed")                                          \
  X(EUNAVAIL, -12, "required library or feature unavailable")                 \
  X(ECANCELED, -13, "canceled")                                               \
  X(EBUSY, -14, "busy")                                                       \
  X(EOVERLAP, -15, "address range overlaps a registered region")              \
  X(ECLOSED, -16, "engine is shut down")                                      \
  X(ETOOBIG, -17, "too large")                                                \
  X(EAUTH, -18, "peer authentication failed")

enum {
  MC_OK = 0,
#define MC_ERR_ENUM_(name, value, text) MC_##name = (value),
  MC_ERRNO_MAP(MC_ERR_ENUM_)
#undef MC_ERR_ENUM_
};

#define MC_ERR_MSG_MAX 512

typedef struct mc_err {
  int code;                 /* 0 or a negative MC_E* code */
  int sys_errno;            /* errno behind an MC_ESYS/MC_ECONNECT, else 0 */
  char msg[MC_ERR_MSG_MAX]; /* one line, NUL-terminated */
} mc_err_t;

/* Short text for a code ("timed out"); never NULL. */
const char *mc_strerror(int code);
/* Symbolic name for a code ("MC_ETIMEDOUT"); never NULL. */
const char *mc_err_name(int code);

/* Fills *err (if non-NULL) with code and a printf-formatted message and
 * returns code, so callers can write `return mc_err_set(err, MC_EINVAL, ...)`.
 */
int mc_err_set(mc_err_t *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Like mc_err_set, also records errno value `sys` and appends strerror(sys). */
int mc_err_sys(mc_err_t *err, int code, int sys, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Prefixes the existing message with more context: "ctx: old message". */
int mc_err_prefix(mc_err_t *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void mc_err_clear(mc_err_t *err);

#endif
