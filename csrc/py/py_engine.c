/* Placeholder: replaced by the real bindings for engine. */
#include "py/py_common.h"

int mc_py_engine_add(PyObject *module, mc_py_state_t *st) {
  (void)module;
  (void)st;
  return 0;
}
