/* Shared pieces of the CPython bindings: module state (exception types),
 * error translation, and the per-file registration hooks. Only csrc/py/
 * files include Python.h. */
#ifndef MC_PY_COMMON_H
#define MC_PY_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "util/errors.h"

typedef struct mc_py_state {
  PyObject *Error;          /* mooncake_connector.MooncakeError(RuntimeError) */
  PyObject *ConfigError;    /* (MooncakeError, ValueError) */
  PyObject *TransferError;  /* (MooncakeError) */
  PyObject *MetadataError;  /* (MooncakeError) */
  PyObject *TimeoutError;   /* (MooncakeError, TimeoutError) */
  PyObject *UnavailableError; /* (MooncakeError) missing library/feature */
  PyTypeObject *EngineType;
} mc_py_state_t;

extern PyModuleDef mc_py_moduledef;

mc_py_state_t *mc_py_state_from_module(PyObject *module);
mc_py_state_t *mc_py_state_from_type(PyTypeObject *type);

/* Raises the exception matching err->code with err->msg; returns NULL.
 * The exception gets attributes .code (int) and .code_name (str). */
PyObject *mc_py_raise(mc_py_state_t *st, const mc_err_t *err);

/* Registration hooks, one per binding file; each returns 0 or -1 with an
 * exception set. Called from the module's exec slot. */
int mc_py_engine_add(PyObject *module, mc_py_state_t *st);
int mc_py_config_add(PyObject *module, mc_py_state_t *st);
int mc_py_meta_add(PyObject *module, mc_py_state_t *st);
int mc_py_lookup_add(PyObject *module, mc_py_state_t *st);

#endif
