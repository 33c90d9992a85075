/* mooncake_connector.MetadataClient: a thin Python wrapper over mc_meta_t.
 *
 * Every network call runs with the GIL released.  `busy` (touched only with
 * the GIL held) counts calls in flight so that close() from another thread
 * never frees the client under a running call: the last call closes it. */
#include "py/py_common.h"

#include "meta/meta.h"

typedef struct {
  PyObject_HEAD
  mc_meta_t *meta; /* NULL once closed */
  int busy;        /* calls in flight with the GIL released */
  int closing;     /* close() asked while busy > 0 */
} meta_obj_t;

static mc_py_state_t *state_of(PyObject *self) {
  mc_py_state_t *st = mc_py_state_from_type(Py_TYPE(self));
  if (!st && !PyErr_Occurred())
    PyErr_SetString(PyExc_RuntimeError, "mooncake_connector module state lost");
  return st;
}

/* Marks a call in flight; NULL with an exception set if closed. */
static mc_meta_t *enter(meta_obj_t *self, mc_py_state_t *st) {
  if (!self->meta || self->closing) {
    mc_err_t err;
    mc_err_set(&err, MC_ECLOSED, "MetadataClient is closed");
    mc_py_raise(st, &err);
    return NULL;
  }
  self->busy++;
  return self->meta;
}

static void really_close(meta_obj_t *self) {
  mc_meta_t *m = self->meta;
  self->meta = NULL;
  if (m) {
    Py_BEGIN_ALLOW_THREADS
    mc_meta_close(m);
    Py_END_ALLOW_THREADS
  }
}

static void leave(meta_obj_t *self) {
  if (--self->busy == 0 && self->closing)
    really_close(self);
}

/* The preamble of a call on one key (get, delete): the key parsed with fmt
 * ("s:<method>"), *st found and the call marked in flight.  The client, or
 * NULL with an exception set. */
static mc_meta_t *key_call(PyObject *op, PyObject *args, PyObject *kw, const char *fmt,
                           const char **key, mc_py_state_t **st) {
  static char *kwlist[] = {"key", NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kw, fmt, kwlist, key))
    return NULL;
  *st = state_of(op);
  return *st ? enter((meta_obj_t *)op, *st) : NULL;
}

static PyObject *meta_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"url", NULL};
  const char *url;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "s:MetadataClient", kwlist, &url))
    return NULL;
  mc_py_state_t *st = mc_py_state_from_type(type);
  if (!st)
    return NULL;
  meta_obj_t *self = (meta_obj_t *)type->tp_alloc(type, 0);
  if (!self)
    return NULL;
  mc_err_t err = {0};
  /* Opening only parses the URL; no network, so the GIL can stay held. */
  if (mc_meta_open(url, &self->meta, &err) < 0) {
    Py_DECREF(self);
    return mc_py_raise(st, &err);
  }
  return (PyObject *)self;
}

static void meta_dealloc(PyObject *op) {
  meta_obj_t *self = (meta_obj_t *)op;
  PyTypeObject *tp = Py_TYPE(op);
  if (self->meta)
    mc_meta_close(self->meta); /* busy is 0: a running call holds a ref */
  tp->tp_free(op);
  Py_DECREF(tp);
}

static PyObject *meta_put(PyObject *op, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"key", "value", "ttl", NULL};
  meta_obj_t *self = (meta_obj_t *)op;
  const char *key;
  Py_buffer val;
  int ttl = 0;
  /* s* takes str (as UTF-8) and any bytes-like object. */
  if (!PyArg_ParseTupleAndKeywords(args, kw, "ss*|i:put", kwlist, &key, &val, &ttl))
    return NULL;
  if (ttl < 0) {
    PyBuffer_Release(&val);
    return PyErr_Format(PyExc_ValueError, "ttl must be >= 0 seconds (0: no expiry)");
  }
  mc_py_state_t *st = state_of(op);
  mc_meta_t *m = st ? enter(self, st) : NULL;
  if (!m) {
    PyBuffer_Release(&val);
    return NULL;
  }
  mc_err_t err = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = ttl ? mc_meta_put_ttl(m, key, val.buf, (size_t)val.len, ttl, &err)
           : mc_meta_put(m, key, val.buf, (size_t)val.len, &err);
  Py_END_ALLOW_THREADS
  leave(self);
  PyBuffer_Release(&val);
  if (rc < 0)
    return mc_py_raise(st, &err);
  Py_RETURN_NONE;
}

static PyObject *meta_get(PyObject *op, PyObject *args, PyObject *kw) {
  meta_obj_t *self = (meta_obj_t *)op;
  const char *key;
  mc_py_state_t *st;
  mc_meta_t *m = key_call(op, args, kw, "s:get", &key, &st);
  if (!m)
    return NULL;
  mc_err_t err = {0};
  char *val = NULL;
  size_t len = 0;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_meta_get(m, key, &val, &len, &err);
  Py_END_ALLOW_THREADS
  leave(self);
  if (rc == MC_ENOTFOUND)
    Py_RETURN_NONE;
  if (rc < 0)
    return mc_py_raise(st, &err);
  PyObject *out = PyBytes_FromStringAndSize(val, (Py_ssize_t)len);
  free(val);
  return out;
}

static PyObject *meta_delete(PyObject *op, PyObject *args, PyObject *kw) {
  meta_obj_t *self = (meta_obj_t *)op;
  const char *key;
  mc_py_state_t *st;
  mc_meta_t *m = key_call(op, args, kw, "s:delete", &key, &st);
  if (!m)
    return NULL;
  mc_err_t err = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_meta_del(m, key, &err);
  Py_END_ALLOW_THREADS
  leave(self);
  if (rc < 0)
    return mc_py_raise(st, &err);
  Py_RETURN_NONE;
}

static PyObject *meta_close(PyObject *op, PyObject *unused) {
  (void)unused;
  meta_obj_t *self = (meta_obj_t *)op;
  if (self->busy > 0)
    self->closing = 1; /* the last call in flight closes it */
  else
    really_close(self);
  Py_RETURN_NONE;
}

static PyObject *meta_enter(PyObject *op, PyObject *unused) {
  (void)unused;
  return Py_NewRef(op);
}

static PyObject *meta_exit(PyObject *op, PyObject *args) {
  (void)args;
  PyObject *r = meta_close(op, NULL);
  if (!r)
    return NULL;
  Py_DECREF(r);
  Py_RETURN_FALSE;
}

static PyObject *meta_get_url(PyObject *op, void *closure) {
  (void)closure;
  meta_obj_t *self = (meta_obj_t *)op;
  if (!self->meta)
    Py_RETURN_NONE;
  return PyUnicode_FromString(self->meta->url);
}

static PyObject *meta_get_closed(PyObject *op, void *closure) {
  (void)closure;
  meta_obj_t *self = (meta_obj_t *)op;
  return PyBool_FromLong(!self->meta || self->closing);
}

static PyObject *meta_repr(PyObject *op) {
  meta_obj_t *self = (meta_obj_t *)op;
  if (!self->meta || self->closing)
    return PyUnicode_FromString("<MetadataClient closed>");
  return PyUnicode_FromFormat("<MetadataClient %s (%s)>", self->meta->url,
                              self->meta->ops->name);
}

static PyMethodDef meta_methods[] = {
    {"put", (PyCFunction)(void (*)(void))meta_put,
     METH_VARARGS | METH_KEYWORDS,
     "put(key: str, value: bytes | str, ttl: int = 0) -> None\n\n"
     "ttl > 0: the entry expires after ttl seconds unless written again.\n"
     "Stores value under key (HTTP PUT). Raises MetadataError naming the "
     "server, key and HTTP status / network error."},
    {"get", (PyCFunction)(void (*)(void))meta_get,
     METH_VARARGS | METH_KEYWORDS,
     "get(key: str) -> bytes | None\n\n"
     "Returns the value, or None when the key does not exist."},
    {"delete", (PyCFunction)(void (*)(void))meta_delete,
     METH_VARARGS | METH_KEYWORDS,
     "delete(key: str) -> None\n\nRemoves key; a missing key is not an error."},
    {"close", meta_close, METH_NOARGS,
     "close() -> None\n\nReleases connections; idempotent."},
    {"__enter__", meta_enter, METH_NOARGS, NULL},
    {"__exit__", meta_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef meta_getset[] = {
    {"url", meta_get_url, NULL, "Server URL as given (None once closed).",
     NULL},
    {"closed", meta_get_closed, NULL, "True after close().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot meta_slots[] = {
    {Py_tp_new, meta_new},
    {Py_tp_dealloc, meta_dealloc},
    {Py_tp_repr, meta_repr},
    {Py_tp_methods, meta_methods},
    {Py_tp_getset, meta_getset},
    {Py_tp_doc,
     "MetadataClient(url)\n\n"
     "Client for a metadata server speaking Mooncake's HTTP metadata "
     "protocol (url like \"http://host:8080/metadata\"). Calls block "
     "without holding the GIL and are bounded by timeouts (connect 1.5 s, "
     "total 3 s; MC_METADATA_TIMEOUT_MS overrides the total). etcd:// and "
     "redis:// raise UnavailableError in this build."},
    {0, NULL},
};

static PyType_Spec meta_spec = {
    .name = "mooncake_connector.MetadataClient",
    .basicsize = sizeof(meta_obj_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = meta_slots,
};

int mc_py_meta_add(PyObject *module, mc_py_state_t *st) {
  (void)st;
  PyObject *type = PyType_FromModuleAndSpec(module, &meta_spec, NULL);
  if (!type)
    return -1;
  int rc = PyModule_AddObjectRef(module, "MetadataClient", type);
  Py_DECREF(type);
  return rc;
}
