/* mooncake_connector.load_config / parse_config: mooncake.json as a dict.
 *
 * File reading and parsing run with the GIL released (a config on a slow
 * network filesystem must not stall other Python threads); inputs are copied
 * into C buffers first, because Python objects must not be touched then. */
#include "py/py_common.h"

#include <stdlib.h>
#include <string.h>

#include "config/config.h"

#define ENV_CONFIG_PATH "MOONCAKE_CONFIG_PATH"
/* mc_config_parse refuses larger texts before reading them, so there is no
 * point copying them or releasing the GIL for them. */
#define TEXT_COPY_MAX ((Py_ssize_t)1 << 20)

static mc_py_state_t *module_state(PyObject *module) {
  mc_py_state_t *st = PyModule_GetState(module);
  if (!st && !PyErr_Occurred())
    PyErr_SetString(PyExc_RuntimeError, "mooncake_connector module state lost");
  return st;
}

static PyObject *raise_config(mc_py_state_t *st, int code, const char *msg) {
  mc_err_t err;
  mc_err_set(&err, code, "%s", msg);
  return mc_py_raise(st, &err);
}

/* Strings from the file are not guaranteed UTF-8 (cJSON does not check);
 * replace bad bytes rather than fail the whole call. */
static int set_text(PyObject *d, const char *key, const char *val) {
  PyObject *o = PyUnicode_DecodeUTF8(val, (Py_ssize_t)strlen(val), "replace");
  if (!o)
    return -1;
  int rc = PyDict_SetItemString(d, key, o);
  Py_DECREF(o);
  return rc;
}

/* Steals `o` (which may be NULL after a failed constructor). */
static int set_new(PyObject *d, const char *key, PyObject *o) {
  if (!o)
    return -1;
  int rc = PyDict_SetItemString(d, key, o);
  Py_DECREF(o);
  return rc;
}

static PyObject *config_to_dict(const mc_config_t *cfg) {
  char prefill[MC_HOST_MAX + 16], decode[MC_HOST_MAX + 16];
  mc_hostport_format(&cfg->prefill, prefill, sizeof prefill);
  mc_hostport_format(&cfg->decode, decode, sizeof decode);

  PyObject *d = PyDict_New();
  if (!d)
    return NULL;
  /* The origin is a path: decode it the way os.fsdecode would. */
  if (set_new(d, "origin", PyUnicode_DecodeFSDefault(cfg->origin)) < 0 ||
      set_text(d, "prefill_url", prefill) < 0 || set_text(d, "decode_url", decode) < 0 ||
      set_text(d, "prefill_host", cfg->prefill.host) < 0 ||
      set_new(d, "prefill_port", PyLong_FromLong(cfg->prefill.port)) < 0 ||
      set_text(d, "decode_host", cfg->decode.host) < 0 ||
      set_new(d, "decode_port", PyLong_FromLong(cfg->decode.port)) < 0 ||
      set_text(d, "metadata_server", cfg->metadata_server) < 0 ||
      set_text(d, "metadata_server_raw", cfg->metadata_server_raw) < 0 ||
      set_text(d, "metadata_backend", mc_meta_kind_name(cfg->metadata_kind)) < 0 ||
      set_new(d, "metadata_backend_given", PyBool_FromLong(cfg->metadata_backend_given)) < 0 ||
      set_text(d, "protocol", mc_protocol_name(cfg->protocol)) < 0 ||
      set_text(d, "device_name", cfg->device_name) < 0 ||
      set_new(d, "decode_port_adjusted", PyBool_FromLong(cfg->decode_port_adjusted)) < 0 ||
      set_text(d, "notes", cfg->notes) < 0 || set_text(d, "auth_secret", cfg->auth_secret) < 0 ||
      set_new(d, "same_host_cpu", PyBool_FromLong(cfg->same_host_cpu)) < 0) {
    Py_DECREF(d);
    return NULL;
  }
  return d;
}

static PyObject *py_load_config(PyObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"path", NULL};
  PyObject *path_obj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:load_config", kwlist, &path_obj))
    return NULL;
  mc_py_state_t *st = module_state(self);
  if (!st)
    return NULL;

  char *path;
  if (path_obj == Py_None) {
    const char *env = getenv(ENV_CONFIG_PATH);
    if (!env)
      return raise_config(st, MC_ECONFIG,
                          "no config path given and " ENV_CONFIG_PATH " is "
                          "not set; set " ENV_CONFIG_PATH " to the path of your "
                          "mooncake.json, or pass load_config(path)");
    if (!*env)
      return raise_config(st, MC_ECONFIG,
                          "no config path given and " ENV_CONFIG_PATH " is set "
                          "but empty; set " ENV_CONFIG_PATH " to the path of your "
                          "mooncake.json, or pass load_config(path)");
    path = strdup(env);
  } else {
    /* str, bytes or os.PathLike, encoded like os.fsencode. */
    PyObject *bytes = NULL;
    if (!PyUnicode_FSConverter(path_obj, &bytes))
      return NULL;
    path = strdup(PyBytes_AS_STRING(bytes));
    Py_DECREF(bytes);
  }
  if (!path)
    return PyErr_NoMemory();

  mc_config_t *cfg = PyMem_RawCalloc(1, sizeof *cfg);
  if (!cfg) {
    free(path);
    return PyErr_NoMemory();
  }
  mc_err_t err = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = mc_config_load_file(path, cfg, &err);
  Py_END_ALLOW_THREADS free(path);
  PyObject *res = rc < 0 ? mc_py_raise(st, &err) : config_to_dict(cfg);
  PyMem_RawFree(cfg);
  return res;
}

static PyObject *py_parse_config(PyObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"text", "origin", NULL};
  const char *text, *origin = "<string>";
  Py_ssize_t len;
  /* s# takes str (as UTF-8) and read-only bytes-like objects. */
  if (!PyArg_ParseTupleAndKeywords(args, kw, "s#|s:parse_config", kwlist, &text, &len, &origin))
    return NULL;
  mc_py_state_t *st = module_state(self);
  if (!st)
    return NULL;

  mc_config_t *cfg = PyMem_RawCalloc(1, sizeof *cfg);
  if (!cfg)
    return PyErr_NoMemory();
  mc_err_t err = {0};
  int rc;
  if (len > TEXT_COPY_MAX) {
    rc = mc_config_parse(text, (size_t)len, origin, cfg, &err);
  } else {
    char *text_copy = malloc((size_t)len + 1);
    char *origin_copy = strdup(origin);
    if (!text_copy || !origin_copy) {
      free(text_copy);
      free(origin_copy);
      PyMem_RawFree(cfg);
      return PyErr_NoMemory();
    }
    memcpy(text_copy, text, (size_t)len);
    text_copy[len] = '\0';
    Py_BEGIN_ALLOW_THREADS rc = mc_config_parse(text_copy, (size_t)len, origin_copy, cfg, &err);
    Py_END_ALLOW_THREADS free(text_copy);
    free(origin_copy);
  }
  PyObject *res = rc < 0 ? mc_py_raise(st, &err) : config_to_dict(cfg);
  PyMem_RawFree(cfg);
  return res;
}

PyDoc_STRVAR(load_config_doc,
             "load_config(path=None) -> dict\n\n"
             "Reads and validates mooncake.json.  Without `path`, uses the file\n"
             "named by $MOONCAKE_CONFIG_PATH.  Returns a dict with origin,\n"
             "prefill_url, decode_url, prefill_host, prefill_port, decode_host,\n"
             "decode_port, metadata_server (normalised), metadata_server_raw,\n"
             "metadata_backend (p2p|etcd|redis|http), metadata_backend_given,\n"
             "protocol, device_name, decode_port_adjusted, notes, auth_secret and same_host_cpu.\n"
             "Raises ConfigError naming the file, field, value and accepted forms.");

PyDoc_STRVAR(parse_config_doc,
             "parse_config(text, origin='<string>') -> dict\n\n"
             "Like load_config, for JSON text (str or bytes); `origin` names the\n"
             "source in error messages.");

static PyMethodDef config_functions[] = {
    {"load_config", (PyCFunction)(void (*)(void))py_load_config, METH_VARARGS | METH_KEYWORDS,
     load_config_doc},
    {"parse_config", (PyCFunction)(void (*)(void))py_parse_config, METH_VARARGS | METH_KEYWORDS,
     parse_config_doc},
    {NULL, NULL, 0, NULL},
};

int mc_py_config_add(PyObject *module, mc_py_state_t *st) {
  (void)st; /* the functions find the state through their module */
  return PyModule_AddFunctions(module, config_functions);
}
