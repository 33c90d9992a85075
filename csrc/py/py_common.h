/* Shared pieces of the CPython bindings: module state (exception types),
 * error translation, and the per-file registration hooks. Only csrc/py/
 * files include Python.h. */
#ifndef MC_PY_COMMON_H
#define MC_PY_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>

#include "lookup/lookup_buffer.h"
#include "util/errors.h"

typedef struct mc_py_state {
  PyObject *Error;          /* mooncake_connector.MooncakeError(RuntimeError) */
  PyObject *ConfigError;    /* (MooncakeError, ValueError) */
  PyObject *TransferError;  /* (MooncakeError) */
  PyObject *MetadataError;  /* (MooncakeError) */
  PyObject *TimeoutError;   /* (MooncakeError, TimeoutError) */
  PyObject *UnavailableError; /* (MooncakeError) missing library/feature */
  PyTypeObject *EngineType;
  PyTypeObject *LookupType;
} mc_py_state_t;

extern PyModuleDef mc_py_moduledef;

/* Token ids borrowed or converted from a Python object (py_tokens.c). */
typedef struct mc_py_tokens {
  Py_buffer view; /* held when has_view */
  int has_view;
  int64_t *owned; /* converted from a sequence */
  PyObject *hold;  /* a tensor whose memory ptr points into */
  const void *ptr;
  size_t n;
  int width; /* 4 or 8 */
} mc_py_tokens_t;
int mc_py_tokens_get(PyObject *o, mc_py_tokens_t *t);
void mc_py_tokens_put(mc_py_tokens_t *t);
/* (addr, length[, tag]) -> extent; TypeError naming what[i] otherwise. */
int mc_py_get_extent(PyObject *o, mc_lookup_extent_t *x, const char *what, Py_ssize_t i);

/* Checks a timeout argument in seconds: finite (NaN and inf raise) and in
 * [lo, hi] (lo excluded when lo_open).  0, or -1 with ValueError set. */
int mc_py_check_timeout(double t, double lo, int lo_open, double hi, const char *name);

mc_py_state_t *mc_py_state_from_module(PyObject *module);
mc_py_state_t *mc_py_state_from_type(PyTypeObject *type);
/* 0 when o is an instance of the type at `field` of the module state
 * (MC_PY_TYPE(EngineType)), found from o's own type; else -1 with a TypeError
 * naming the expected mooncake_connector.<name> and the type given. */
#define MC_PY_TYPE(field) offsetof(mc_py_state_t, field)
int mc_py_check_type(PyObject *o, size_t field, const char *name);

/* Raises the exception matching err->code with err->msg; returns NULL.
 * The exception gets attributes .code (int) and .code_name (str). */
PyObject *mc_py_raise(mc_py_state_t *st, const mc_err_t *err);

/* A C string that may carry a peer's bytes (a segment name from a HELLO, an
 * error text from a peer's ACK, a descriptor field) as str: UTF-8 with
 * every undecodable byte escaped (\xNN), so no peer can make a call raise
 * UnicodeDecodeError.  NULL gives "".  New reference, NULL only on OOM. */
PyObject *mc_py_peer_str(const char *s);

/* The engine behind a TransferEngine object, for other bindings: checks the
 * type and that it is initialized, and blocks close() until unborrowed. */
struct mc_engine;
struct mc_engine *mc_py_engine_borrow(PyObject *o);
void mc_py_engine_unborrow(PyObject *o);
/* The lookup buffer behind a LookupBuffer object (TypeError otherwise). */
mc_lookup_t *mc_py_lookup_ptr(PyObject *o);

/* Takes a binding object's life lock for reading: at once when it can,
 * else with the GIL released while waiting (its closer may need the GIL
 * to finish).  0 or pthread_rwlock_rdlock's error; the caller raises. */
static inline int mc_py_life_rdlock(pthread_rwlock_t *life) {
  if (pthread_rwlock_tryrdlock(life) == 0)
    return 0;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = pthread_rwlock_rdlock(life);
  Py_END_ALLOW_THREADS
  return rc;
}

/* Registration hooks, one per binding file; each returns 0 or -1 with an
 * exception set. Called from the module's exec slot. */
int mc_py_engine_add(PyObject *module, mc_py_state_t *st);
int mc_py_config_add(PyObject *module, mc_py_state_t *st);
int mc_py_meta_add(PyObject *module, mc_py_state_t *st);
int mc_py_kv_add(PyObject *module, mc_py_state_t *st);
int mc_py_lookup_add(PyObject *module, mc_py_state_t *st);
int mc_py_gate_arrays_add(PyObject *module, mc_py_state_t *st);

#endif
