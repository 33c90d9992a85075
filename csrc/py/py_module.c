/* mooncake_connector._core: module definition, state and error mapping. */
#include <stdio.h>

#include "py/py_common.h"

static PyObject *new_exc(PyObject *module, const char *name, PyObject *bases,
                         const char *doc) {
  PyObject *exc = PyErr_NewExceptionWithDoc(name, doc, bases, NULL);
  if (!exc)
    return NULL;
  const char *dot = strrchr(name, '.');
  if (PyModule_AddObjectRef(module, dot ? dot + 1 : name, exc) < 0) {
    Py_DECREF(exc);
    return NULL;
  }
  return exc;
}

static int module_exec(PyObject *module) {
  mc_py_state_t *st = PyModule_GetState(module);
  PyObject *bases = NULL;

  st->Error = new_exc(module, "mooncake_connector.MooncakeError",
                      PyExc_RuntimeError,
                      "Base class of every error raised by mooncake_connector.");
  if (!st->Error)
    return -1;
#define SUBCLASS(field, name, extra, doc)                                      \
  do {                                                                         \
    bases = (extra) ? PyTuple_Pack(2, st->Error, (extra))                      \
                    : PyTuple_Pack(1, st->Error);                              \
    if (!bases)                                                                \
      return -1;                                                               \
    st->field = new_exc(module, "mooncake_connector." name, bases, doc);       \
    Py_CLEAR(bases);                                                           \
    if (!st->field)                                                            \
      return -1;                                                               \
  } while (0)
  SUBCLASS(ConfigError, "ConfigError", PyExc_ValueError,
           "Invalid configuration (mooncake.json or arguments).");
  SUBCLASS(TransferError, "TransferError", NULL,
           "A transfer failed; the message says which peer and why.");
  SUBCLASS(MetadataError, "MetadataError", NULL,
           "The metadata server could not be reached or answered badly.");
  SUBCLASS(TimeoutError, "TransferTimeout", PyExc_TimeoutError,
           "An operation did not finish within its timeout.");
  SUBCLASS(UnavailableError, "UnavailableError", NULL,
           "A required library or feature is not available on this host.");
#undef SUBCLASS

  if (mc_py_config_add(module, st) < 0)
    return -1;
  if (mc_py_meta_add(module, st) < 0)
    return -1;
  if (mc_py_engine_add(module, st) < 0)
    return -1;
  if (mc_py_kv_add(module, st) < 0)
    return -1;
  if (mc_py_lookup_add(module, st) < 0) return -1;
  if (mc_py_gate_arrays_add(module, st) < 0)
    return -1;
  return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
  mc_py_state_t *st = PyModule_GetState(module);
  if (!st)
    return 0;
  Py_VISIT(st->Error);
  Py_VISIT(st->ConfigError);
  Py_VISIT(st->TransferError);
  Py_VISIT(st->MetadataError);
  Py_VISIT(st->TimeoutError);
  Py_VISIT(st->UnavailableError);
  Py_VISIT(st->EngineType);
  Py_VISIT(st->LookupType);
  return 0;
}

static int module_clear(PyObject *module) {
  mc_py_state_t *st = PyModule_GetState(module);
  if (!st)
    return 0;
  Py_CLEAR(st->Error);
  Py_CLEAR(st->ConfigError);
  Py_CLEAR(st->TransferError);
  Py_CLEAR(st->MetadataError);
  Py_CLEAR(st->TimeoutError);
  Py_CLEAR(st->UnavailableError);
  Py_CLEAR(st->EngineType);
  Py_CLEAR(st->LookupType);
  return 0;
}

static void module_free(void *module) { module_clear((PyObject *)module); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyModuleDef mc_py_moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mooncake_connector._core",
    .m_doc = "C core of mooncake-connector: transfer engine, config, metadata.",
    .m_size = sizeof(mc_py_state_t),
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&mc_py_moduledef); }

int mc_py_check_timeout(double t, double lo, int lo_open, double hi, const char *name) {
  if (t != t || t > hi || t < lo || (lo_open && t == lo)) {
    /* PyErr_Format knows no %g (Python 3.12 raises SystemError on it) */
    char range[96];
    snprintf(range, sizeof range, "%c%g, %g]", lo_open ? '(' : '[', lo, hi);
    PyObject *v = PyFloat_FromDouble(t);
    if (v)
      PyErr_Format(PyExc_ValueError, "%s must be a number of seconds in %s, not %R", name, range,
                   v);
    Py_XDECREF(v);
    return -1;
  }
  return 0;
}

mc_py_state_t *mc_py_state_from_module(PyObject *module) {
  return PyModule_GetState(module);
}

mc_py_state_t *mc_py_state_from_type(PyTypeObject *type) {
  PyObject *m = PyType_GetModuleByDef(type, &mc_py_moduledef);
  return m ? PyModule_GetState(m) : NULL;
}

int mc_py_check_type(PyObject *o, size_t field, const char *name) {
  /* A type of another module has no state of ours: TypeError, cleared. */
  mc_py_state_t *st = mc_py_state_from_type(Py_TYPE(o));
  PyTypeObject *want = st ? *(PyTypeObject **)((char *)st + field) : NULL;
  if (want && PyObject_TypeCheck(o, want))
    return 0;
  PyErr_Clear();
  PyErr_Format(PyExc_TypeError, "expected a mooncake_connector.%s, not %.80s", name,
               Py_TYPE(o)->tp_name);
  return -1;
}

PyObject *mc_py_peer_str(const char *s) {
  if (!s)
    s = "";
  return PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "backslashreplace");
}

PyObject *mc_py_raise(mc_py_state_t *st, const mc_err_t *err) {
  PyObject *type;
  switch (err->code) {
  case MC_ECONFIG:
  case MC_EINVAL:
  case MC_EOVERLAP:
    type = st->ConfigError;
    break;
  case MC_ETIMEDOUT:
    type = st->TimeoutError;
    break;
  case MC_EMETADATA:
    type = st->MetadataError;
    break;
  case MC_EUNAVAIL:
    type = st->UnavailableError;
    break;
  case MC_ENOMEM:
    return PyErr_NoMemory();
  case MC_ECONNECT:
  case MC_EPEERCLOSED:
  case MC_EPROTO:
  case MC_ERANGE:
  case MC_ENOTFOUND:
  case MC_ECANCELED:
  case MC_EAUTH:
    type = st->TransferError;
    break;
  default:
    type = st->Error;
    break;
  }
  const char *msg = err->msg[0] ? err->msg : mc_strerror(err->code);
  PyObject *text = mc_py_peer_str(msg);
  if (!text)
    return NULL;
  PyObject *exc = PyObject_CallOneArg(type, text);
  Py_DECREF(text);
  if (!exc)
    return NULL;
  PyObject *code = PyLong_FromLong(err->code);
  PyObject *name = PyUnicode_FromString(mc_err_name(err->code));
  if (code && name) {
    PyObject_SetAttrString(exc, "code", code);
    PyObject_SetAttrString(exc, "code_name", name);
  }
  Py_XDECREF(code);
  Py_XDECREF(name);
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
  return NULL;
}
