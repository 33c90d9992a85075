#include "util/errors.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

const char *mc_strerror(int code) {
  switch (code) {
  case MC_OK:
    return "success";
#define MC_ERR_TEXT_(name, value, text)                                        \
  case MC_##name:                                                              \
    return text;
    MC_ERRNO_MAP(MC_ERR_TEXT_)
#undef MC_ERR_TEXT_
  default:
    return "unknown error";
  }
}

const char *mc_err_name(int code) {
  switch (code) {
  case MC_OK:
    return "MC_OK";
#define MC_ERR_NAME_(name, value, text)                                        \
  case MC_##name:                                                              \
    return "MC_" #name;
    MC_ERRNO_MAP(MC_ERR_NAME_)
#undef MC_ERR_NAME_
  default:
    return "MC_EUNKNOWN";
  }
}

static void vset(mc_err_t *err, int code, const char *fmt, va_list ap) {
  err->code = code;
  vsnprintf(err->msg, sizeof err->msg, fmt, ap);
}

int mc_err_set(mc_err_t *err, int code, const char *fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    vset(err, code, fmt, ap);
    va_end(ap);
    err->sys_errno = 0;
  }
  return code;
}

int mc_err_sys(mc_err_t *err, int code, int sys, const char *fmt, ...) {
  if (err) {
    char ebuf[128];
    va_list ap;
    va_start(ap, fmt);
    vset(err, code, fmt, ap);
    va_end(ap);
    err->sys_errno = sys;
    size_t n = strlen(err->msg);
    /* GNU strerror_r may return a static string instead of filling ebuf. */
    const char *s = strerror_r(sys, ebuf, sizeof ebuf);
    snprintf(err->msg + n, sizeof err->msg - n, ": %s (errno %d)", s, sys);
  }
  return code;
}

int mc_err_prefix(mc_err_t *err, const char *fmt, ...) {
  if (!err)
    return MC_EINVAL;
  char head[MC_ERR_MSG_MAX];
  char old[MC_ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(head, sizeof head, fmt, ap);
  va_end(ap);
  memcpy(old, err->msg, sizeof old);
  size_t hl = strnlen(head, sizeof head - 3);
  memcpy(err->msg, head, hl);
  memcpy(err->msg + hl, ": ", 2);
  size_t room = sizeof err->msg - hl - 3;
  size_t ol = strnlen(old, room);
  memcpy(err->msg + hl + 2, old, ol);
  err->msg[hl + 2 + ol] = '\0';
  return err->code;
}

void mc_err_clear(mc_err_t *err) {
  if (err) {
    err->code = 0;
    err->sys_errno = 0;
    err->msg[0] = '\0';
  }
}
