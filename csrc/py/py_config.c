/* Placeholder: replaced by the real bindings for config. */
#include "py/py_common.h"

int mc_py_config_add(PyObject *module, mc_py_state_t *st) {
  (void)module;
  (void)st;
  return 0;
}
