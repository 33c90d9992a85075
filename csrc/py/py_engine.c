/* mooncake_connector.TransferEngine: Mooncake's Python engine API over the
 * C engine.  Same method names, argument order and meaning; failures raise
 * exceptions carrying the reason instead of returning -1.  Every call that
 * can block releases the GIL. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/engine.h"
#include "util/clock.h"
#include "gpu/cuda_driver.h"
#include "py/py_common.h"

/* The life lock: every call that uses the engine (or a batch) holds it for
 * reading from its check that the engine is open to its last use (enter /
 * leave), GIL or not; close sets `closing` (new calls fail), takes it for
 * writing (so waits for the calls in flight), then frees the batches and
 * the engine.  Nobody waits for it while holding the GIL. */
typedef struct {
  PyObject_HEAD
  mc_engine_t *eng;
  pthread_rwlock_t life; /* read: a call using eng; write: close */
  int closing;           /* close() under way (GIL-protected): new calls fail */
  PyObject *batches;     /* dict: batch id -> capsule(py_batch_t*) */
  PyObject *managed;     /* dict: addr -> length, buffers from allocate_managed_buffer */
  long long next_batch;
  int users; /* KVTransfer objects bound to this engine (GIL-protected) */
} EngineObject;

#define ST(self) mc_py_state_from_type(Py_TYPE(self))

/* ---- helpers ---- */

/* Raises exc for an argument that is not what it must be, naming it (what,
 * "what[idx]" for a list's item when idx >= 0), what it must be and the
 * value given (its type and repr, cut at 80 characters): "length must be
 * an int (...), not bool True".  Returns -1. */
static int bad_arg(PyObject *exc, const char *what, Py_ssize_t idx, PyObject *o,
                   const char *must) {
  char name[96];
  if (idx >= 0)
    snprintf(name, sizeof name, "%s[%zd]", what, idx);
  else
    snprintf(name, sizeof name, "%s", what);
  PyObject *r = PyObject_Repr(o);
  if (r && PyUnicode_GET_LENGTH(r) > 80) {
    PyObject *cut = PyUnicode_Substring(r, 0, 77);
    Py_DECREF(r);
    r = cut ? PyUnicode_FromFormat("%U...", cut) : NULL;
    Py_XDECREF(cut);
  }
  if (!r) {
    PyErr_Clear();
    r = PyUnicode_FromString("(no repr)");
    if (!r)
      return -1;
  }
  PyErr_Format(exc, "%s must be %s, not %.80s %U", name, must, Py_TYPE(o)->tp_name, r);
  Py_DECREF(r);
  return -1;
}

#define U64_MUST_INT "an int (an address or a byte count: 0 .. 2**64-1; not a bool)"
#define U64_MUST_RANGE "a non-negative 64-bit integer (0 .. 2**64-1)"

/* An address, length or opcode argument (idx >= 0: item idx of the list
 * named what): an int (or a tensor, standing for its data_ptr()), not a
 * bool (True is not a length of 1). */
static int get_u64_at(PyObject *o, uint64_t *out, const char *what, Py_ssize_t idx) {
  if (PyLong_CheckExact(o)) { /* the common case, without PyNumber_Index */
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (!(v == (unsigned long long)-1 && PyErr_Occurred())) {
      *out = v;
      return 0;
    }
    PyErr_Clear();
  }
  if (PyBool_Check(o))
    return bad_arg(PyExc_TypeError, what, idx, o, U64_MUST_INT);
  /* A tensor (CPU or CUDA) stands for its address: data_ptr(). */
  PyObject *idxo = !PyLong_Check(o) && PyObject_HasAttrString(o, "data_ptr")
                       ? PyObject_CallMethod(o, "data_ptr", NULL)
                       : PyNumber_Index(o);
  if (!idxo) {
    PyErr_Clear();
    return bad_arg(PyExc_TypeError, what, idx, o, U64_MUST_INT);
  }
  unsigned long long v = PyLong_AsUnsignedLongLong(idxo);
  Py_DECREF(idxo);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    return bad_arg(PyExc_ValueError, what, idx, o, U64_MUST_RANGE);
  }
  *out = v;
  return 0;
}

static int get_u64(PyObject *o, uint64_t *out, const char *what) {
  return get_u64_at(o, out, what, -1);
}

/* seq as a list of items (a str or bytes is not one: each character would
 * be an item), or NULL raised naming what and the value. */
static PyObject *list_arg(PyObject *seq, const char *what, const char *must) {
  if (PyUnicode_Check(seq) || PyBytes_Check(seq) || PyByteArray_Check(seq) ||
      !PySequence_Check(seq)) {
    bad_arg(PyExc_TypeError, what, -1, seq, must);
    return NULL;
  }
  return PySequence_Fast(seq, "not a sequence");
}

/* A view of seq when it is a C-contiguous buffer of 8-byte integers (numpy
 * uint64/int64 array, array.array('Q')): 1 with *v held, else 0 (nothing
 * held, no exception set: the caller takes the sequence path). */
static int u64_buffer_view(PyObject *seq, Py_buffer *v) {
  if (!PyObject_CheckBuffer(seq) || PyBytes_Check(seq) || PyByteArray_Check(seq))
    return 0;
  if (PyObject_GetBuffer(seq, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
      f++;
    if (v->itemsize == 8 && f[0] && !f[1] && strchr("QqLlNn", f[0]))
      return 1;
    PyBuffer_Release(v);
  }
  PyErr_Clear();
  return 0;
}

/* Parses a sequence of ints (the list named what) into a malloc'ed array. */
static int get_u64_list(PyObject *seq, uint64_t **out, Py_ssize_t *n, const char *what) {
  /* Fast path: a buffer of 8-byte integers, copied as is, no per-item
   * Python work. */
  Py_buffer view;
  if (u64_buffer_view(seq, &view)) {
    Py_ssize_t k = view.len / 8;
    uint64_t *a = PyMem_RawMalloc((size_t)(k ? k : 1) * sizeof *a);
    if (!a) {
      PyBuffer_Release(&view);
      PyErr_NoMemory();
      return -1;
    }
    memcpy(a, view.buf, (size_t)k * 8);
    PyBuffer_Release(&view);
    *out = a;
    *n = k;
    return 0;
  }
  PyObject *fast = list_arg(seq, what, "a list of ints (addresses or byte counts)");
  if (!fast)
    return -1;
  Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
  uint64_t *v = PyMem_RawMalloc((size_t)(k ? k : 1) * sizeof *v);
  if (!v) {
    Py_DECREF(fast);
    PyErr_NoMemory();
    return -1;
  }
  PyObject **items = PySequence_Fast_ITEMS(fast);
  for (Py_ssize_t i = 0; i < k; i++) {
    if (get_u64_at(items[i], &v[i], what, i) < 0) {
      PyMem_RawFree(v);
      Py_DECREF(fast);
      return -1;
    }
  }
  Py_DECREF(fast);
  *out = v;
  *n = k;
  return 0;
}

static int ready(EngineObject *self) {
  if (!self->eng || self->closing) {
    mc_err_t err;
    mc_err_set(&err, MC_ECLOSED,
               "TransferEngine is not initialized (call initialize()) or was closed");
    mc_py_raise(ST(self), &err);
    return 0;
  }
  return 1;
}

/* Takes the life lock (reading) for a call that uses the engine; fails
 * with the closed error if close() began.  Only close holds it for writing:
 * the fast path takes it without dropping the GIL; otherwise the GIL is
 * released while waiting (close may need the GIL to finish). */
static int enter(EngineObject *self) {
  if (!ready(self))
    return -1;
  int rc = mc_py_life_rdlock(&self->life);
  if (rc != 0) {
    mc_err_t err;
    mc_err_set(&err, MC_EBUSY, "TransferEngine: cannot take its life lock (%s)", strerror(rc));
    mc_py_raise(ST(self), &err);
    return -1;
  }
  if (!ready(self)) {
    pthread_rwlock_unlock(&self->life);
    return -1;
  }
  return 0;
}
static void leave(EngineObject *self) { pthread_rwlock_unlock(&self->life); }

/* Leaves the engine after a call whose Python result is 0: that, or its
 * error (rc < 0) raised. */
static PyObject *leave_with(EngineObject *self, int rc, const mc_err_t *err) {
  leave(self);
  if (rc < 0)
    return mc_py_raise(ST(self), err);
  return PyLong_FromLong(0);
}

/* A batch handed to Python: the id table holds one reference and each call
 * using the batch without the GIL holds one (GIL-protected count), so a
 * batch finished or waited for by one thread is not freed under another
 * thread's poll.  Whoever drops the last one frees it, under the life lock. */
typedef struct {
  mc_batch_t *b;
  int refs;
} py_batch_t;

/* Drops a reference; returns the batch to free (batch_free) if it was the last. */
static mc_batch_t *batch_unref(py_batch_t *pb) {
  if (--pb->refs > 0)
    return NULL;
  mc_batch_t *b = pb->b;
  PyMem_RawFree(pb);
  return b;
}

/* Frees a batch (cancels what is left; may wait for transports) without the GIL. */
static void batch_free(EngineObject *self, mc_batch_t *b) {
  if (!b)
    return;
  mc_engine_t *eng = self->eng;
  Py_BEGIN_ALLOW_THREADS
  mc_batch_free(eng, b);
  Py_END_ALLOW_THREADS
}

/* ---- lifecycle ---- */

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  (void)args;
  (void)kw;
  EngineObject *self = (EngineObject *)type->tp_alloc(type, 0);
  if (!self)
    return NULL;
  pthread_rwlock_init(&self->life, NULL);
  self->batches = PyDict_New();
  self->managed = PyDict_New();
  if (!self->batches || !self->managed) {
    Py_DECREF(self);
    return NULL;
  }
  return (PyObject *)self;
}

static void free_batch_capsule(PyObject *cap) { (void)cap; }

/* Closes the engine: new calls fail at once (closing), calls in flight
 * finish first (the life lock, taken for writing without the GIL), then the
 * batches still in the id table are freed (cancelled) and the engine
 * destroyed.  A close racing another returns at once. */
static void close_engine(EngineObject *self) {
  if (!self->eng || self->closing)
    return;
  self->closing = 1;
  mc_engine_t *eng = self->eng;
  Py_BEGIN_ALLOW_THREADS
  mc_engine_wake_notify_waiters(eng); /* a wait_notifies in flight returns now */
  pthread_rwlock_wrlock(&self->life);
  Py_END_ALLOW_THREADS
  /* No call holds the lock now, so none holds a batch reference or touches
   * the table: each batch's only reference is the table's. */
  PyObject *key, *val;
  Py_ssize_t pos = 0;
  while (self->batches && PyDict_Next(self->batches, &pos, &key, &val)) {
    py_batch_t *pb = PyCapsule_GetPointer(val, "mc_batch");
    if (pb)
      batch_free(self, batch_unref(pb));
  }
  if (self->batches)
    PyDict_Clear(self->batches);
  Py_BEGIN_ALLOW_THREADS
  mc_engine_destroy(eng);
  pthread_rwlock_unlock(&self->life);
  Py_END_ALLOW_THREADS
  /* Managed buffers outlive nothing: the engine that exposed them is gone. */
  pos = 0;
  while (self->managed && PyDict_Next(self->managed, &pos, &key, &val))
    free((void *)(uintptr_t)PyLong_AsUnsignedLongLong(key));
  if (self->managed)
    PyDict_Clear(self->managed);
  self->eng = NULL;
  self->closing = 0;
}

static void Engine_dealloc(EngineObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  close_engine(self);
  Py_CLEAR(self->batches);
  Py_CLEAR(self->managed);
  pthread_rwlock_destroy(&self->life);
  tp->tp_free((PyObject *)self);
  Py_DECREF(tp);
}

static int Engine_traverse(EngineObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(self->batches);
  Py_VISIT(self->managed);
  return 0;
}

/* The two tables hold only ints and capsules (no cycle through them): kept
 * for dealloc, which frees the batches and buffers they list. */
static int Engine_clear(EngineObject *self) {
  (void)self;
  return 0;
}

PyDoc_STRVAR(initialize_doc,
"initialize(local_hostname, metadata_server, protocol='tcp', device_name='',\n"
"           io_threads=0, conns_per_peer=0, auth_secret=None, same_host_cpu=True) -> 0\n\n"
"Starts the engine. local_hostname is 'host' or 'host:port'; metadata_server is\n"
"'P2PHANDSHAKE' or 'http://host:port/metadata'. auth_secret: the shared secret\n"
"every peer must prove it knows (docs/security.md); None reads MC_AUTH_SECRET,\n"
"'' turns authentication off. same_host_cpu=False keeps peers on this host off the\n"
"same-host CPU path (as MC_SAME_HOST_CPU=0 does). Raises on failure.");

static PyObject *Engine_initialize(EngineObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"local_hostname", "metadata_server", "protocol", "device_name",
                           "io_threads", "conns_per_peer", "auth_secret", "same_host_cpu",
                           NULL};
  const char *host, *meta, *proto = "tcp", *dev = "", *secret = NULL;
  int io_threads = 0, conns = 0, shc = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "ss|zziizp:initialize", kwlist, &host, &meta,
                                   &proto, &dev, &io_threads, &conns, &secret, &shc))
    return NULL;
  if (self->eng) {
    mc_err_t err;
    if (self->closing)
      mc_err_set(&err, MC_EBUSY, "TransferEngine: close() is under way in another thread; "
                 "initialize after it returns");
    else
      mc_err_set(&err, MC_EBUSY, "TransferEngine is already initialized as segment %s",
                 mc_engine_segment_name(self->eng));
    return mc_py_raise(ST(self), &err);
  }
  mc_engine_opts_t o = {.local_hostname = host, .metadata_server = meta,
                        .protocol = proto ? proto : "tcp", .device_name = dev ? dev : "",
                        .io_threads = io_threads, .conns_per_peer = conns,
                        .auth_secret = secret, .same_host_cpu_off = !shc};
  mc_err_t err = {0};
  mc_engine_t *eng = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_engine_create(&o, &eng, &err);
  Py_END_ALLOW_THREADS
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  if (self->eng) { /* another thread's initialize won meanwhile */
    Py_BEGIN_ALLOW_THREADS
    mc_engine_destroy(eng);
    Py_END_ALLOW_THREADS
    mc_err_set(&err, MC_EBUSY, "TransferEngine was initialized by another thread meanwhile");
    return mc_py_raise(ST(self), &err);
  }
  self->eng = eng;
  return PyLong_FromLong(0);
}

static int refuse_if_used(EngineObject *self) {
  if (self->users > 0) {
    mc_err_t err;
    mc_err_set(&err, MC_EBUSY,
               "TransferEngine is used by %d KVTransfer object(s); close them first", self->users);
    mc_py_raise(ST(self), &err);
    return -1;
  }
  return 0;
}

static PyObject *Engine_close(EngineObject *self, PyObject *unused) {
  (void)unused;
  if (refuse_if_used(self) < 0)
    return NULL;
  close_engine(self);
  Py_RETURN_NONE;
}

mc_engine_t *mc_py_engine_borrow(PyObject *o) {
  if (mc_py_check_type(o, MC_PY_TYPE(EngineType), "TransferEngine") < 0)
    return NULL;
  EngineObject *self = (EngineObject *)o;
  if (!ready(self))
    return NULL;
  self->users++;
  return self->eng;
}

void mc_py_engine_unborrow(PyObject *o) { ((EngineObject *)o)->users--; }

static PyObject *Engine_enter(EngineObject *self, PyObject *unused) {
  (void)unused;
  return Py_NewRef(self);
}

static PyObject *Engine_exit(EngineObject *self, PyObject *args) {
  (void)args;
  if (refuse_if_used(self) < 0)
    return NULL;
  close_engine(self);
  Py_RETURN_FALSE;
}

static PyObject *Engine_get_rpc_port(EngineObject *self, PyObject *unused) {
  (void)unused;
  if (enter(self) < 0)
    return NULL;
  long port = mc_engine_rpc_port(self->eng);
  leave(self);
  return PyLong_FromLong(port);
}

static PyObject *Engine_get_segment_name(EngineObject *self, PyObject *unused) {
  (void)unused;
  if (enter(self) < 0)
    return NULL;
  /* The name lives in the engine: copied while it is held. */
  PyObject *r = PyUnicode_FromString(mc_engine_segment_name(self->eng));
  leave(self);
  return r;
}

static PyObject *Engine_get_metadata(EngineObject *self, PyObject *unused) {
  (void)unused;
  if (enter(self) < 0)
    return NULL;
  char *d = mc_engine_describe(self->eng);
  leave(self);
  if (!d)
    return PyErr_NoMemory();
  PyObject *r = PyUnicode_FromString(d);
  free(d);
  return r;
}

/* ---- memory registration ---- */

static PyObject *Engine_register_memory(EngineObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"addr", "length", "location", NULL};
  PyObject *a, *l;
  const char *loc = "cpu";
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|s:register_memory", kwlist, &a, &l, &loc))
    return NULL;
  uint64_t addr, len;
  if (get_u64(a, &addr, "addr") < 0 || get_u64(l, &len, "length") < 0)
    return NULL;
  char locbuf[64];
  snprintf(locbuf, sizeof locbuf, "%s", loc);
  if (enter(self) < 0)
    return NULL;
  mc_err_t err = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_engine_register(self->eng, (void *)(uintptr_t)addr, len, locbuf, &err);
  Py_END_ALLOW_THREADS
  return leave_with(self, rc, &err);
}

static PyObject *Engine_batch_register_memory(EngineObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"addrs", "lengths", "location", NULL};
  PyObject *a, *l;
  const char *loc = "cpu";
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|s:batch_register_memory", kwlist, &a, &l, &loc))
    return NULL;
  uint64_t *addrs = NULL, *lens = NULL;
  Py_ssize_t na, nl;
  if (get_u64_list(a, &addrs, &na, "addrs") < 0)
    return NULL;
  if (get_u64_list(l, &lens, &nl, "lengths") < 0) {
    PyMem_RawFree(addrs);
    return NULL;
  }
  if (na != nl) {
    PyMem_RawFree(addrs);
    PyMem_RawFree(lens);
    return PyErr_Format(PyExc_ValueError, "addrs has %zd items but lengths has %zd", na, nl);
  }
  char locbuf[64];
  snprintf(locbuf, sizeof locbuf, "%s", loc);
  mc_err_t err = {0};
  PyObject *r = NULL;
  if (enter(self) == 0) {
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mc_engine_register_batch(self->eng, (void *const *)addrs, lens, (size_t)na, locbuf,
                                  &err);
    Py_END_ALLOW_THREADS
    r = leave_with(self, rc, &err);
  }
  PyMem_RawFree(addrs);
  PyMem_RawFree(lens);
  return r;
}

static PyObject *Engine_unregister_memory(EngineObject *self, PyObject *arg) {
  uint64_t addr;
  if (get_u64(arg, &addr, "addr") < 0)
    return NULL;
  if (enter(self) < 0)
    return NULL;
  mc_err_t err = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_engine_unregister(self->eng, (void *)(uintptr_t)addr, &err);
  Py_END_ALLOW_THREADS
  return leave_with(self, rc, &err);
}

static PyObject *Engine_batch_unregister_memory(EngineObject *self, PyObject *arg) {
  uint64_t *addrs;
  Py_ssize_t n;
  if (get_u64_list(arg, &addrs, &n, "addrs") < 0)
    return NULL;
  if (enter(self) < 0) {
    PyMem_RawFree(addrs);
    return NULL;
  }
  mc_err_t err = {0};
  int rc = 0;
  Py_BEGIN_ALLOW_THREADS
  for (Py_ssize_t i = 0; i < n && rc == 0; i++)
    rc = mc_engine_unregister(self->eng, (void *)(uintptr_t)addrs[i], &err);
  Py_END_ALLOW_THREADS
  PyMem_RawFree(addrs);
  return leave_with(self, rc, &err);
}

/* ---- managed buffers: registered host memory owned by the engine ---- */

static PyObject *Engine_allocate_managed_buffer(EngineObject *self, PyObject *arg) {
  uint64_t len;
  if (get_u64(arg, &len, "length") < 0)
    return NULL;
  if (len == 0 || len > (1ull << 46))
    return PyErr_Format(PyExc_ValueError, "length must be in 1..2**46 bytes");
  if (enter(self) < 0)
    return NULL;
  void *p = NULL;
  mc_err_t err = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = posix_memalign(&p, 4096, (size_t)len) ? MC_ENOMEM : 0;
  if (rc == 0) {
    memset(p, 0, (size_t)len);
    rc = mc_engine_register(self->eng, p, len, "cpu", &err);
    /* A failed registration is undone (engine.c); only if that failed too
     * (a peer still holds the region) is the memory kept, freed at close. */
    if (rc < 0 && !mc_engine_is_registered(self->eng, p)) {
      free(p);
      p = NULL;
    }
  } else {
    mc_err_set(&err, MC_ENOMEM, "cannot allocate a managed buffer of %llu bytes",
               (unsigned long long)len);
  }
  Py_END_ALLOW_THREADS
  /* The table is updated under the life lock: close frees what it lists. */
  if (rc < 0 && p) { /* still registered: freed at close, never under a peer */
    PyObject *k = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)p);
    PyObject *v = PyLong_FromUnsignedLongLong(0); /* length 0: no free_managed_buffer matches */
    if (k && v)
      PyDict_SetItem(self->managed, k, v);
    Py_XDECREF(k);
    Py_XDECREF(v);
    PyErr_Clear();
  }
  if (rc < 0) {
    leave(self);
    return mc_py_raise(ST(self), &err);
  }
  PyObject *k = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)p);
  PyObject *v = PyLong_FromUnsignedLongLong(len);
  if (!k || !v || PyDict_SetItem(self->managed, k, v) < 0) {
    leave(self);
    Py_XDECREF(k);
    Py_XDECREF(v);
    return NULL; /* the buffer stays registered until close; a leak only on OOM */
  }
  leave(self);
  Py_DECREF(v);
  return k;
}

static PyObject *Engine_free_managed_buffer(EngineObject *self, PyObject *args) {
  PyObject *ao, *lo;
  if (!PyArg_ParseTuple(args, "OO:free_managed_buffer", &ao, &lo))
    return NULL;
  uint64_t addr, len;
  if (get_u64(ao, &addr, "buffer") < 0 || get_u64(lo, &len, "length") < 0 || !ready(self))
    return NULL;
  PyObject *k = PyLong_FromUnsignedLongLong(addr);
  if (!k)
    return NULL;
  PyObject *v = PyDict_GetItemWithError(self->managed, k);
  if (!v || PyLong_AsUnsignedLongLong(v) != len) {
    Py_DECREF(k);
    if (PyErr_Occurred())
      return NULL;
    char msg[160];
    snprintf(msg, sizeof msg,
             "0x%llx (length %llu) is not a buffer from allocate_managed_buffer",
             (unsigned long long)addr, (unsigned long long)len);
    PyErr_SetString(PyExc_ValueError, msg);
    return NULL;
  }
  if (enter(self) < 0) {
    Py_DECREF(k);
    return NULL;
  }
  mc_err_t err = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS
  /* A failure keeps the buffer (and its entry): a peer may still hold it,
   * or its removal from the published descriptor is pending; calling
   * again retries (engine.c mc_engine_unregister). */
  rc = mc_engine_unregister(self->eng, (void *)(uintptr_t)addr, &err);
  Py_END_ALLOW_THREADS
  /* Under the lock: a close cannot free it too.  A concurrent call freed
   * it first if the entry is gone. */
  if (rc == 0 && PyDict_DelItem(self->managed, k) == 0)
    free((void *)(uintptr_t)addr);
  else if (rc == 0 && PyErr_ExceptionMatches(PyExc_KeyError))
    PyErr_Clear();
  leave(self);
  Py_DECREF(k);
  if (rc == 0 && PyErr_Occurred())
    return NULL;
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  return PyLong_FromLong(0);
}

/* ---- transfers ---- */

typedef struct {
  const char *target;
  mc_request_t *reqs;
  Py_ssize_t n;
} xfer_args_t;

/* One address/length argument: a borrowed view of an 8-byte integer buffer
 * (numpy uint64/int64, array('Q')), read in place, or a copied list. */
typedef struct {
  const char *p; /* 8-byte items (maybe unaligned: read with memcpy) */
  uint64_t *owned;
  Py_buffer view;
  int has_view;
  Py_ssize_t n;
} u64_arg_t;

static int u64_arg_get(PyObject *seq, u64_arg_t *a, const char *what) {
  memset(a, 0, sizeof *a);
  if (u64_buffer_view(seq, &a->view)) {
    a->has_view = 1;
    a->p = a->view.buf;
    a->n = a->view.len / 8;
    return 0;
  }
  if (get_u64_list(seq, &a->owned, &a->n, what) < 0)
    return -1;
  a->p = (const char *)a->owned;
  return 0;
}

static void u64_arg_release(u64_arg_t *a) {
  if (a->has_view)
    PyBuffer_Release(&a->view);
  PyMem_RawFree(a->owned);
  a->has_view = 0;
  a->owned = NULL;
}

static uint64_t u64_at(const u64_arg_t *a, Py_ssize_t i) {
  uint64_t v;
  memcpy(&v, a->p + 8 * i, 8);
  return v;
}

/* The requests of three address/length arguments of one length (array('Q')
 * and the like read in place); 0, or -1 raised. */
static int reqs_from(PyObject *lo, PyObject *ro, PyObject *no, int opcode, mc_request_t **reqs,
                     Py_ssize_t *count) {
  u64_arg_t l, r, n;
  if (u64_arg_get(lo, &l, "buffers") < 0)
    return -1;
  if (u64_arg_get(ro, &r, "peer_buffer_addresses") < 0) {
    u64_arg_release(&l);
    return -1;
  }
  if (u64_arg_get(no, &n, "lengths") < 0) {
    u64_arg_release(&l);
    u64_arg_release(&r);
    return -1;
  }
  int rc = 0;
  Py_ssize_t nl = l.n;
  if (nl != r.n || nl != n.n) {
    PyErr_Format(PyExc_ValueError,
                 "buffers (%zd), peer_buffer_addresses (%zd) and lengths (%zd) must have the "
                 "same length",
                 nl, r.n, n.n);
    rc = -1;
  } else {
    *reqs = PyMem_RawMalloc((size_t)(nl ? nl : 1) * sizeof **reqs);
    if (!*reqs) {
      PyErr_NoMemory();
      rc = -1;
    } else {
      for (Py_ssize_t i = 0; i < nl; i++)
        (*reqs)[i] = (mc_request_t){.opcode = opcode, .local = (void *)(uintptr_t)u64_at(&l, i),
                                    .remote = u64_at(&r, i), .len = u64_at(&n, i)};
      *count = nl;
    }
  }
  u64_arg_release(&l);
  u64_arg_release(&r);
  u64_arg_release(&n);
  return rc;
}

static int parse_batch(PyObject *args, PyObject *kw, const char *fmt, int opcode,
                       xfer_args_t *x, PyObject **target_obj) {
  static char *kwlist[] = {"target_hostname", "buffers", "peer_buffer_addresses", "lengths",
                           NULL};
  PyObject *t, *lo, *ro, *no;
  if (!PyArg_ParseTupleAndKeywords(args, kw, fmt, kwlist, &t, &lo, &ro, &no))
    return -1;
  if (!PyUnicode_Check(t)) {
    PyErr_SetString(PyExc_TypeError, "target_hostname must be a str (the segment name)");
    return -1;
  }
  Py_ssize_t n = 0;
  if (reqs_from(lo, ro, no, opcode, &x->reqs, &n) < 0)
    return -1;
  x->n = n;
  x->target = PyUnicode_AsUTF8(t);
  *target_obj = t;
  if (!x->target) {
    PyMem_RawFree(x->reqs);
    x->reqs = NULL;
    return -1;
  }
  return 0;
}

/* Runs one batch to completion without the GIL. */
static PyObject *run_sync(EngineObject *self, xfer_args_t *x) {
  char target[512];
  snprintf(target, sizeof target, "%s", x->target);
  if (enter(self) < 0) {
    PyMem_RawFree(x->reqs);
    return NULL;
  }
  mc_err_t err = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS
  mc_batch_t *b = mc_batch_new(self->eng, (size_t)x->n);
  if (!b) {
    rc = mc_err_set(&err, MC_ENOMEM, "out of memory");
  } else {
    rc = mc_batch_submit_sync(self->eng, b, target, x->reqs, (size_t)x->n, &err);
    if (rc == 0)
      rc = mc_batch_wait(self->eng, b, -1, &err);
    mc_batch_free(self->eng, b);
  }
  Py_END_ALLOW_THREADS
  PyMem_RawFree(x->reqs);
  return leave_with(self, rc, &err);
}

static PyObject *sync_batch(EngineObject *self, PyObject *args, PyObject *kw, int opcode,
                            const char *fmt) {
  xfer_args_t x = {0};
  PyObject *t;
  if (parse_batch(args, kw, fmt, opcode, &x, &t) < 0)
    return NULL;
  return run_sync(self, &x);
}

static PyObject *Engine_batch_transfer_sync_write(EngineObject *self, PyObject *a, PyObject *k) {
  return sync_batch(self, a, k, MC_OP_WRITE, "OOOO:batch_transfer_sync_write");
}
static PyObject *Engine_batch_transfer_sync_read(EngineObject *self, PyObject *a, PyObject *k) {
  return sync_batch(self, a, k, MC_OP_READ, "OOOO:batch_transfer_sync_read");
}

static PyObject *sync_one(EngineObject *self, PyObject *args, PyObject *kw, int opcode,
                          const char *fmt) {
  static char *kwlist[] = {"target_hostname", "buffer", "peer_buffer_address", "length", NULL};
  const char *target;
  PyObject *lo, *ro, *no;
  if (!PyArg_ParseTupleAndKeywords(args, kw, fmt, kwlist, &target, &lo, &ro, &no))
    return NULL;
  uint64_t l, r, n;
  if (get_u64(lo, &l, "buffer") < 0 || get_u64(ro, &r, "peer_buffer_address") < 0 ||
      get_u64(no, &n, "length") < 0)
    return NULL;
  xfer_args_t x = {.target = target, .n = 1};
  x.reqs = PyMem_RawMalloc(sizeof *x.reqs);
  if (!x.reqs)
    return PyErr_NoMemory();
  x.reqs[0] = (mc_request_t){.opcode = opcode, .local = (void *)(uintptr_t)l, .remote = r,
                             .len = n};
  return run_sync(self, &x);
}

static PyObject *Engine_transfer_sync_write(EngineObject *self, PyObject *a, PyObject *k) {
  return sync_one(self, a, k, MC_OP_WRITE, "sOOO:transfer_sync_write");
}
static PyObject *Engine_transfer_sync_read(EngineObject *self, PyObject *a, PyObject *k) {
  return sync_one(self, a, k, MC_OP_READ, "sOOO:transfer_sync_read");
}

static PyObject *Engine_transfer_sync(EngineObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"target_hostname", "buffer", "peer_buffer_address", "length",
                           "opcode", NULL};
  const char *target;
  PyObject *lo, *ro, *no, *op;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "sOOOO:transfer_sync", kwlist, &target, &lo, &ro,
                                   &no, &op))
    return NULL;
  uint64_t opc;
  if (get_u64(op, &opc, "opcode") < 0)
    return NULL;
  PyObject *a = Py_BuildValue("(sOOO)", target, lo, ro, no);
  if (!a)
    return NULL;
  if (opc > 1) {
    Py_DECREF(a);
    return PyErr_Format(PyExc_ValueError, "opcode must be 0 (READ) or 1 (WRITE), not %llu",
                        (unsigned long long)opc);
  }
  PyObject *r = sync_one(self, a, NULL, opc == 1 ? MC_OP_WRITE : MC_OP_READ,
                         "sOOO:transfer_sync");
  Py_DECREF(a);
  return r;
}

static PyObject *async_batch(EngineObject *self, PyObject *args, PyObject *kw, int opcode,
                             const char *fmt);

/* Splits a trailing `opcode` argument off a generic call. */
static int split_opcode(PyObject *args, PyObject *kw, Py_ssize_t nfixed, PyObject **rest,
                        int *opcode) {
  PyObject *op = NULL;
  if (PyTuple_GET_SIZE(args) > nfixed) {
    op = PyTuple_GET_ITEM(args, nfixed);
    *rest = PyTuple_GetSlice(args, 0, nfixed);
  } else if (kw && (op = PyDict_GetItemString(kw, "opcode"))) {
    *rest = Py_NewRef(args);
  } else {
    PyErr_SetString(PyExc_TypeError, "missing argument: opcode (0 = READ, 1 = WRITE)");
    return -1;
  }
  if (!*rest)
    return -1;
  long v = PyLong_AsLong(op);
  if ((v == -1 && PyErr_Occurred()) || (v != 0 && v != 1)) {
    Py_DECREF(*rest);
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "opcode must be 0 (READ) or 1 (WRITE)");
    return -1;
  }
  *opcode = (int)v;
  return 0;
}

typedef PyObject *(*batch_fn_t)(EngineObject *self, PyObject *args, PyObject *kw, int opcode,
                                const char *fmt);

/* A batch call with a trailing `opcode` argument: fn on the other four. */
static PyObject *batch_with_opcode(EngineObject *self, PyObject *args, PyObject *kw,
                                   batch_fn_t fn, const char *fmt) {
  PyObject *rest;
  int opc;
  if (split_opcode(args, kw, 4, &rest, &opc) < 0)
    return NULL;
  PyObject *kw2 = kw ? PyDict_Copy(kw) : NULL;
  if (kw2)
    PyDict_DelItemString(kw2, "opcode"), PyErr_Clear();
  PyObject *r = fn(self, rest, kw2, opc, fmt);
  Py_DECREF(rest);
  Py_XDECREF(kw2);
  return r;
}

static PyObject *Engine_batch_transfer_sync(EngineObject *self, PyObject *args, PyObject *kw) {
  return batch_with_opcode(self, args, kw, sync_batch, "OOOO:batch_transfer_sync");
}

static PyObject *Engine_batch_transfer_async(EngineObject *self, PyObject *args, PyObject *kw) {
  return batch_with_opcode(self, args, kw, async_batch, "OOOO:batch_transfer_async");
}

/* transfer_submit_write(target, buffer, peer_buffer_address, length) -> batch id */
static PyObject *Engine_transfer_submit_write(EngineObject *self, PyObject *args,
                                              PyObject *kw) {
  static char *kwlist[] = {"target_hostname", "buffer", "peer_buffer_address", "length", NULL};
  PyObject *t, *lo, *ro, *no;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO:transfer_submit_write", kwlist, &t, &lo, &ro,
                                   &no))
    return NULL;
  PyObject *a = Py_BuildValue("(O[O][O][O])", t, lo, ro, no);
  if (!a)
    return NULL;
  PyObject *r = async_batch(self, a, NULL, MC_OP_WRITE, "OOOO:transfer_submit_write");
  Py_DECREF(a);
  return r;
}

/* A submitted batch into the id table (the caller holds the life lock:
 * close frees what it lists); its new id, or NULL (raised; the batch freed). */
static PyObject *table_batch(EngineObject *self, mc_batch_t *b) {
  py_batch_t *pb = PyMem_RawMalloc(sizeof *pb);
  PyObject *cap = pb ? PyCapsule_New(pb, "mc_batch", free_batch_capsule) : NULL;
  PyObject *id = cap ? PyLong_FromLongLong(++self->next_batch) : NULL;
  if (pb)
    *pb = (py_batch_t){.b = b, .refs = 1};
  if (!id || PyDict_SetItem(self->batches, id, cap) < 0) {
    if (!pb)
      PyErr_NoMemory();
    Py_XDECREF(cap);
    Py_XDECREF(id);
    PyMem_RawFree(pb);
    batch_free(self, b);
    return NULL;
  }
  Py_DECREF(cap);
  return id;
}

/* A new batch of these requests submitted (gated when gate is given): the
 * batch, or NULL with err set (nothing left behind). */
static mc_batch_t *batch_submit_new(EngineObject *self, const char *target,
                                    const mc_request_t *reqs, size_t n,
                                    const mc_gate_opts_t *gate, mc_err_t *err) {
  mc_batch_t *b = mc_batch_new(self->eng, n);
  if (!b) {
    mc_err_set(err, MC_ENOMEM, "out of memory");
    return NULL;
  }
  int rc = gate ? mc_batch_submit_gated(self->eng, b, target, reqs, n, gate, err)
                : mc_batch_submit(self->eng, b, target, reqs, n, err);
  if (rc < 0) {
    mc_batch_free(self->eng, b);
    return NULL;
  }
  return b;
}

static PyObject *async_batch_gated(EngineObject *self, PyObject *args, PyObject *kw,
                                   int opcode, const char *fmt, const mc_gate_opts_t *gate) {
  xfer_args_t x = {0};
  PyObject *t;
  if (parse_batch(args, kw, fmt, opcode, &x, &t) < 0)
    return NULL;
  char target[512];
  snprintf(target, sizeof target, "%s", x.target);
  if (enter(self) < 0) {
    PyMem_RawFree(x.reqs);
    return NULL;
  }
  mc_err_t err = {0};
  /* A batch gated on a CUDA event is only queued for the engine's gate
   * thread (no network, no lookup, no wait: a few allocations and short
   * mutexes no GIL holder waits on), so the GIL is kept: vLLM's forward
   * thread calls this per layer and a release would hand the GIL to any
   * thread waiting for it, to be taken back after it. */
  int keep_gil = gate && gate->cuda_event;
  PyThreadState *ts = keep_gil ? NULL : PyEval_SaveThread();
  mc_batch_t *b = batch_submit_new(self, target, x.reqs, (size_t)x.n, gate, &err);
  if (ts)
    PyEval_RestoreThread(ts);
  PyMem_RawFree(x.reqs);
  if (!b) {
    leave(self);
    return mc_py_raise(ST(self), &err);
  }
  PyObject *id = table_batch(self, b);
  leave(self);
  return id;
}

static PyObject *async_batch(EngineObject *self, PyObject *args, PyObject *kw, int opcode,
                             const char *fmt) {
  return async_batch_gated(self, args, kw, opcode, fmt, NULL);
}

static PyObject *Engine_batch_transfer_async_write(EngineObject *self, PyObject *a, PyObject *k) {
  return async_batch(self, a, k, MC_OP_WRITE, "OOOO:batch_transfer_async_write");
}

PyDoc_STRVAR(gated_doc,
"batch_transfer_async_write_gated(target_hostname, buffers, peer_buffer_addresses,\n"
"    lengths, cuda_event=0, cuda_device=0, notify=None, notify_timeout=0) -> batch_id\n\n"
"batch_transfer_async_write whose writes start only once cuda_event (a CUevent\n"
"handle, e.g. torch.cuda.Event(blocking=True).cuda_event, recorded on the stream\n"
"that writes the sources; 0: none) completed: the engine's gate thread waits for\n"
"it in the driver, no Python thread is woken.  notify (bytes): sent by the engine\n"
"to target_hostname once every write of the batch completed (none for a failed\n"
"or canceled batch), like send_notify's message; notify_timeout: its receipt's\n"
"limit in seconds (0: the engine's).  Keep the event alive until the batch is\n"
"over.  The address lists may be array('Q') / 8-byte buffers (read in place).");

static PyObject *Engine_batch_transfer_async_write_gated(EngineObject *self, PyObject *args,
                                                         PyObject *kw) {
  static char *kwlist[] = {"target_hostname", "buffers", "peer_buffer_addresses", "lengths",
                           "cuda_event", "cuda_device", "notify", "notify_timeout", NULL};
  PyObject *t, *lo, *ro, *no, *ev = NULL, *note = Py_None;
  int dev = 0;
  double ntmo = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|OiOd:batch_transfer_async_write_gated",
                                   kwlist, &t, &lo, &ro, &no, &ev, &dev, &note, &ntmo))
    return NULL;
  mc_gate_opts_t g = {.cuda_device = dev};
  if (ev && ev != Py_None) {
    g.cuda_event = PyLong_AsUnsignedLongLong(ev);
    if (PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_SetString(PyExc_ValueError, "cuda_event must be an int (a CUevent handle, "
                      "torch.cuda.Event(...).cuda_event) or 0 for none");
      return NULL;
    }
  }
  if (dev < 0) {
    PyErr_Format(PyExc_ValueError, "cuda_device must be the event's device ordinal (>= 0), "
                 "not %d", dev);
    return NULL;
  }
  if (mc_py_check_timeout(ntmo, 0, 0, 3600, "notify_timeout") < 0)
    return NULL;
  g.notify_timeout_ms = (int64_t)(ntmo * 1000.0);
  Py_buffer nb = {0};
  int has_nb = 0;
  if (note != Py_None) {
    if (PyUnicode_Check(note) || PyObject_GetBuffer(note, &nb, PyBUF_SIMPLE) < 0) {
      PyErr_Clear();
      PyErr_SetString(PyExc_ValueError, "notify must be bytes (the message) or None");
      return NULL;
    }
    has_nb = 1;
    g.notify = nb.buf;
    g.notify_len = (size_t)nb.len;
  }
  PyObject *a = PyTuple_Pack(4, t, lo, ro, no);
  PyObject *r = a ? async_batch_gated(self, a, NULL, MC_OP_WRITE,
                                      "OOOO:batch_transfer_async_write_gated", &g)
                  : NULL;
  Py_XDECREF(a);
  if (has_nb)
    PyBuffer_Release(&nb);
  return r;
}
/* ---- one CUDA layer's gated writes to several targets (plain data) ---- */

typedef struct {
  long li;
  uint64_t event;
  int dev;
  int handover; /* no event: a same-host CPU copy goes to the gate thread */
  double margin, note_cap, now;
} gate_layer_t;

/* Layer li of one plan target, (name, lease_until, arrays, notes): its
 * arrays[li] (a (src, dst, len) tuple) submitted gated on the layer's
 * event, with notes[li] as the "layer" message when notes is not None.
 * The batch id, Py_None when not submitted (the lease ends within the
 * margin, nothing to write, the engine did not take it: the caller's
 * per-target path looks and names why), or NULL raised. */
static PyObject *gate_target(EngineObject *self, PyObject *t, const gate_layer_t *g) {
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) {
    PyErr_SetString(PyExc_TypeError, "gate_layer: each plan entry must be a (name, "
                                     "lease_until, arrays, notes) tuple");
    return NULL;
  }
  PyObject *name = PyTuple_GET_ITEM(t, 0), *notes = PyTuple_GET_ITEM(t, 3);
  const char *target = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
  if (!target) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "gate_layer: a plan entry's name must be a str");
    return NULL;
  }
  double lease = PyFloat_AsDouble(PyTuple_GET_ITEM(t, 1));
  if (lease == -1.0 && PyErr_Occurred())
    return NULL;
  if (g->now > lease - g->margin) /* the caller's path stops it and says why */
    return Py_NewRef(Py_None);
  PyObject *per = NULL, *note = NULL, *id = NULL;
  mc_request_t *reqs = NULL;
  Py_ssize_t n = 0;
  Py_buffer nb = {0};
  int has_nb = 0;
  if (!(per = PySequence_GetItem(PyTuple_GET_ITEM(t, 2), g->li)))
    goto out;
  if (!PyTuple_Check(per) || PyTuple_GET_SIZE(per) != 3) {
    PyErr_SetString(PyExc_TypeError, "gate_layer: a plan entry's arrays[layer] must be a "
                                     "(src, dst, len) tuple");
    goto out;
  }
  if (reqs_from(PyTuple_GET_ITEM(per, 0), PyTuple_GET_ITEM(per, 1), PyTuple_GET_ITEM(per, 2),
                MC_OP_WRITE, &reqs, &n) < 0)
    goto out;
  if (n == 0) { /* nothing to write (HMA null blocks): the caller's path says landed */
    id = Py_NewRef(Py_None);
    goto out;
  }
  if (notes != Py_None) {
    if (!(note = PySequence_GetItem(notes, g->li)) ||
        PyObject_GetBuffer(note, &nb, PyBUF_SIMPLE) < 0)
      goto out;
    has_nb = 1;
  }
  double left = lease - g->now, ntmo = left < g->note_cap ? left : g->note_cap;
  /* CPU KV caches (no event) to a peer the same-host CPU path serves: its
   * copy (process_vm_writev) would run inside the submit, on this thread
   * (vLLM's forward thread): handed to the engine's gate thread instead,
   * which submits (copies) and, once the layer's bytes landed, has the
   * notifier send the note.  A route not known yet (the first submit to
   * the peer asks it) or another transport (TCP: its own threads send)
   * submits here. */
  int hand = !g->event && g->handover && mc_engine_route_copies_here(self->eng, target);
  mc_gate_opts_t o = {.cuda_event = g->event, .cuda_device = g->dev,
                      .notify = has_nb ? nb.buf : NULL, .notify_len = has_nb ? (size_t)nb.len : 0,
                      .notify_timeout_ms = (int64_t)((ntmo > 0.1 ? ntmo : 0.1) * 1000.0),
                      .on_gate_thread = hand,
                      /* queued: not written once the lease's margin began
                       * (the check above, again when its turn comes) */
                      .submit_by_ns = (int64_t)((lease - g->margin) * 1e9)};
  mc_err_t err = {0};
  /* With an event, or handed to the gate thread: only queued (as
   * batch_transfer_async_write_gated with an event), the GIL is kept: a
   * release would hand it to any thread waiting for it, to be taken back
   * after.  Submitted here (CPU KV caches, TCP or a route not known yet):
   * the GIL is released, as that call does. */
  PyThreadState *ts = g->event || hand ? NULL : PyEval_SaveThread();
  mc_batch_t *b = batch_submit_new(self, target, reqs, (size_t)n, &o, &err);
  if (ts)
    PyEval_RestoreThread(ts);
  /* not taken (busy, lease, a bad segment): None, the caller's path retries */
  id = b ? table_batch(self, b) : Py_NewRef(Py_None);
out:
  if (has_nb)
    PyBuffer_Release(&nb);
  PyMem_RawFree(reqs);
  Py_XDECREF(per);
  Py_XDECREF(note);
  return id;
}

PyDoc_STRVAR(gate_layer_doc,
"gate_layer(layer, plan, stream, device, margin, notify_cap, handover=True)\n"
"    -> None | int | (int, tuple)\n\n"
"One layer's writes to several targets gated on one CUDA event, in one call\n"
"(the push producer's save of a layer with CUDA KV caches on vLLM's forward\n"
"thread).  None when a notification or a lost peer waits (nothing done: the\n"
"caller drains first).  plan None: nothing else to do, returns 0.  Else plan is\n"
"a tuple of targets, each (name: str, lease_until: float, time.time() seconds,\n"
"arrays: per layer a (src, dst, len) tuple of address arrays, notes: per layer\n"
"the bytes of the notification sent once that layer's writes landed, or None):\n"
"records the next of the engine's gate events on `stream` (a CUstream of\n"
"`device`) and submits each target's arrays[layer] gated on it with notes[layer]\n"
"(notify_timeout: min(notify_cap, lease left), at least 0.1 s), unless its\n"
"lease ends within `margin` seconds.  Returns (event, results): the event's\n"
"handle and, per plan target, the batch id or None (not submitted: lease near\n"
"its end, nothing to write, the engine did not take it).  The GIL is kept\n"
"(nothing blocks).  device -1 (CPU KV caches, the layer's KV in memory): no\n"
"event (0 returned for it), stream ignored; a target the same-host CPU path\n"
"serves (its route known) is queued for the engine's gate thread, which copies\n"
"the layer (process_vm_writev) and has the note sent once it landed: the call\n"
"only queues, GIL kept (handover=False: copied in the call, GIL released); any\n"
"other target's writes start at once, its submit with the GIL released.");

static PyObject *Engine_gate_layer(EngineObject *self, PyObject *args) {
  long li;
  PyObject *plan;
  unsigned long long stream;
  gate_layer_t g = {0};
  g.handover = 1;
  if (!PyArg_ParseTuple(args, "lOKidd|p:gate_layer", &li, &plan, &stream, &g.dev, &g.margin,
                        &g.note_cap, &g.handover))
    return NULL;
  if (li < 0 || g.dev < -1) {
    PyErr_Format(PyExc_ValueError, "gate_layer: layer (%ld) must be >= 0 and device (%d) a "
                 "CUDA ordinal >= 0, or -1 for CPU KV caches (no event)", li, g.dev);
    return NULL;
  }
  if (plan != Py_None && !PyTuple_Check(plan)) {
    PyErr_SetString(PyExc_TypeError, "gate_layer: plan must be None or a tuple of (name, "
                                     "lease_until, arrays, notes) tuples");
    return NULL;
  }
  if (enter(self) < 0)
    return NULL;
  PyObject *res = NULL, *ids = NULL;
  if (mc_engine_notifies_pending(self->eng)) {
    res = Py_NewRef(Py_None);
    goto out;
  }
  if (plan == Py_None) {
    res = PyLong_FromLong(0);
    goto out;
  }
  mc_err_t err = {0};
  if (g.dev >= 0 && mc_engine_gate_record(self->eng, g.dev, stream, &g.event, &err) < 0) {
    res = mc_py_raise(ST(self), &err);
    goto out;
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  g.now = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
  g.li = li;
  Py_ssize_t nt = PyTuple_GET_SIZE(plan);
  if (!(ids = PyTuple_New(nt)))
    goto out;
  for (Py_ssize_t i = 0; i < nt; i++) {
    PyObject *id = gate_target(self, PyTuple_GET_ITEM(plan, i), &g);
    if (!id)
      goto out;
    PyTuple_SET_ITEM(ids, i, id);
  }
  res = Py_BuildValue("(KO)", (unsigned long long)g.event, ids);
out:
  leave(self);
  Py_XDECREF(ids);
  return res;
}

static PyObject *Engine_batch_transfer_async_read(EngineObject *self, PyObject *a, PyObject *k) {
  return async_batch(self, a, k, MC_OP_READ, "OOOO:batch_transfer_async_read");
}

#define BATCH_ID_MUST "a batch id (the int batch_transfer_async_* returned)"

/* The table's entry for a batch id (what: the argument's name, idx >= 0 an
 * item of that list), borrowed, or NULL raised: an id that is no int (a
 * bool or 1.0 would find batch 1) or none the table holds (taken). */
static PyObject *batch_cap(EngineObject *self, PyObject *id, const char *what,
                           Py_ssize_t idx) {
  if (!PyLong_Check(id) || PyBool_Check(id)) {
    bad_arg(PyExc_TypeError, what, idx, id, BATCH_ID_MUST);
    return NULL;
  }
  PyObject *cap = PyDict_GetItemWithError(self->batches, id);
  if (!cap && !PyErr_Occurred())
    PyErr_Format(PyExc_ValueError,
                 "unknown batch id %S (already waited for, or never returned by "
                 "batch_transfer_async_*)",
                 id);
  return cap;
}

/* Removes a batch id from the table (caller holds the life lock); returns
 * the table's reference to the batch, or NULL (raised). */
static py_batch_t *take_batch(EngineObject *self, PyObject *id, Py_ssize_t idx) {
  PyObject *cap = batch_cap(self, id, idx >= 0 ? "batch_ids" : "batch_id", idx);
  if (!cap)
    return NULL;
  py_batch_t *pb = PyCapsule_GetPointer(cap, "mc_batch");
  if (!pb || PyDict_DelItem(self->batches, id) < 0)
    return NULL;
  return pb;
}

/* The table's entry for id with a reference taken for the caller (who
 * holds the life lock), or NULL (raised). */
static py_batch_t *get_batch(EngineObject *self, PyObject *id) {
  PyObject *cap = batch_cap(self, id, "batch_id", -1);
  if (!cap)
    return NULL;
  py_batch_t *pb = PyCapsule_GetPointer(cap, "mc_batch");
  if (pb)
    pb->refs++;
  return pb;
}

/* The engine entered and the batch `id` held (a reference), or NULL with
 * the error set and nothing held: the preamble of the calls on one batch
 * id.  Undone by batch_leave. */
static py_batch_t *batch_enter(EngineObject *self, PyObject *id) {
  if (enter(self) < 0)
    return NULL;
  py_batch_t *pb = get_batch(self, id);
  if (!pb)
    leave(self);
  return pb;
}

/* Drops batch_enter's reference (freeing the batch if another thread took
 * its id meanwhile) and leaves the engine. */
static void batch_leave(EngineObject *self, py_batch_t *pb) {
  batch_free(self, batch_unref(pb));
  leave(self);
}

PyDoc_STRVAR(get_status_doc,
"get_batch_transfer_status(batch_ids) -> 0\n\n"
"Waits for every batch in the list and frees them. Raises the first failure.");

static PyObject *Engine_get_batch_transfer_status(EngineObject *self, PyObject *args,
                                                  PyObject *kw) {
  static char *kwlist[] = {"batch_ids", "timeout", NULL};
  PyObject *ids;
  double timeout = -1;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|d:get_batch_transfer_status", kwlist, &ids,
                                   &timeout))
    return NULL;
  if (timeout < 0 && timeout == timeout && timeout > -1e300)
    timeout = -1; /* any negative: the engine default */
  if (mc_py_check_timeout(timeout, -1, 0, 86400, "timeout") < 0)
    return NULL;
  PyObject *fast = list_arg(ids, "batch_ids", "a list of batch ids (the ints "
                            "batch_transfer_async_* returned; one batch: [batch_id])");
  if (!fast)
    return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  py_batch_t **bs = PyMem_RawCalloc((size_t)(n ? n : 1), sizeof *bs);
  if (!bs) {
    Py_DECREF(fast);
    return PyErr_NoMemory();
  }
  if (enter(self) < 0) {
    PyMem_RawFree(bs);
    Py_DECREF(fast);
    return NULL;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    bs[i] = take_batch(self, PySequence_Fast_GET_ITEM(fast, i), i);
    if (!bs[i]) {
      /* Put nothing back: ids taken so far are still waited for below. */
      n = i;
      break;
    }
  }
  PyObject *et = NULL, *ev = NULL, *tb = NULL;
  int pending_exc = PyErr_Occurred() != NULL;
  if (pending_exc)
    PyErr_Fetch(&et, &ev, &tb);
  Py_DECREF(fast);
  mc_err_t err = {0}, e2;
  int rc = 0;
  int64_t tmo = timeout < 0 ? -1 : (int64_t)(timeout * 1000.0);
  Py_BEGIN_ALLOW_THREADS
  for (Py_ssize_t i = 0; i < n; i++) {
    int r = mc_batch_wait(self->eng, bs[i]->b, tmo, &e2);
    if (r < 0 && rc == 0) {
      rc = r;
      err = e2;
    }
  }
  Py_END_ALLOW_THREADS
  /* Freed unless another thread is polling one (it frees it then). */
  for (Py_ssize_t i = 0; i < n; i++)
    batch_free(self, batch_unref(bs[i]));
  leave(self);
  PyMem_RawFree(bs);
  if (pending_exc) {
    PyErr_Restore(et, ev, tb);
    return NULL;
  }
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  return PyLong_FromLong(0);
}

static const char *state_name(mc_task_state_t s) {
  switch (s) {
  case MC_TASK_WAITING: return "waiting";
  case MC_TASK_PENDING: return "pending";
  case MC_TASK_INVALID: return "invalid";
  case MC_TASK_CANCELED: return "canceled";
  case MC_TASK_COMPLETED: return "completed";
  case MC_TASK_TIMEOUT: return "timeout";
  case MC_TASK_FAILED: return "failed";
  }
  return "?";
}

PyDoc_STRVAR(check_doc,
"transfer_check_status(batch_id) -> int\n\n"
"Non-blocking: 0 while running, 1 when every request completed (the batch is\n"
"freed), -1 if one failed (freed; use get_batch_status first for details).");

/* 0 while requests are pending, else 1 (all completed), -2 (one timed
 * out) or -1 (one failed).  May reap a finished GPU copy (completion
 * callbacks, driver calls): called without the GIL. */
static long batch_result(mc_batch_t *b) {
  if (mc_batch_pending(b) > 0)
    return 0;
  long res = 1;
  size_t n = mc_batch_size(b);
  for (size_t i = 0; i < n; i++) {
    mc_task_status_t s;
    mc_batch_status(b, i, &s);
    if (s.state != MC_TASK_COMPLETED)
      res = s.state == MC_TASK_TIMEOUT ? -2 : -1;
  }
  return res;
}

static PyObject *Engine_transfer_check_status(EngineObject *self, PyObject *id) {
  py_batch_t *pb = batch_enter(self, id);
  if (!pb)
    return NULL;
  long res;
  mc_batch_t *b = pb->b;
  Py_BEGIN_ALLOW_THREADS
  res = batch_result(b);
  Py_END_ALLOW_THREADS
  int failed = 0;
  if (res != 0) {
    /* Finished: the id goes (unless another thread's call took it meanwhile,
     * or an id object raised in comparison). */
    PyObject *cap = PyDict_GetItemWithError(self->batches, id);
    if (cap && PyCapsule_GetPointer(cap, "mc_batch") == pb) {
      py_batch_t *t = take_batch(self, id, -1);
      if (t)
        batch_unref(t); /* not the last: we hold one */
    }
    failed = PyErr_Occurred() != NULL;
  }
  batch_leave(self, pb);
  return failed ? NULL : PyLong_FromLong(res);
}

/* The calling thread's last wait_notifies / transfer_wait: when the wait
 * ended in C (CLOCK_MONOTONIC ns, time.monotonic()'s clock) and how long the
 * thread then waited to hold the GIL again (another thread of the process
 * running Python keeps it up to the switch interval).  Thread-local: each
 * thread reads its own (last_wake). */
static _Thread_local uint64_t wake_ns, wake_gil_ns;

#define WAIT_RELEASED(call)  \
  do {                       \
    uint64_t woke_;          \
    Py_BEGIN_ALLOW_THREADS   \
    call;                    \
    woke_ = mc_now_ns();     \
    Py_END_ALLOW_THREADS     \
    wake_ns = woke_;         \
    wake_gil_ns = mc_now_ns() - woke_; \
  } while (0)

static PyObject *Engine_last_wake(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
  (void)self;
  if (!wake_ns)
    Py_RETURN_NONE;
  return Py_BuildValue("(dd)", (double)wake_ns / 1e9, (double)wake_gil_ns / 1e9);
}

PyDoc_STRVAR(transfer_wait_doc,
"transfer_wait(batch_id, timeout) -> bool\n\n"
"Waits (GIL released, on the batch's condition variable: no polling) until no\n"
"request of the batch is in flight, or timeout seconds (0..60) passed; True\n"
"when none is.  Takes no result and frees nothing: transfer_check_status\n"
"reads the outcome.  ValueError for an id already taken.");

static PyObject *Engine_transfer_wait(EngineObject *self, PyObject *args) {
  PyObject *id;
  double timeout;
  if (!PyArg_ParseTuple(args, "Od:transfer_wait", &id, &timeout))
    return NULL;
  if (mc_py_check_timeout(timeout, 0, 0, 60, "timeout") < 0)
    return NULL;
  py_batch_t *pb = batch_enter(self, id);
  if (!pb)
    return NULL;
  int idle;
  WAIT_RELEASED(idle = mc_batch_wait_idle(pb->b, (uint64_t)(timeout * 1e9)));
  batch_leave(self, pb); /* freed here if another thread took it meanwhile */
  return PyBool_FromLong(idle);
}

static PyObject *Engine_get_batch_status(EngineObject *self, PyObject *id) {
  py_batch_t *pb = batch_enter(self, id);
  if (!pb)
    return NULL;
  mc_batch_t *b = pb->b;
  size_t n = mc_batch_size(b);
  PyObject *list = PyList_New((Py_ssize_t)n);
  for (size_t i = 0; list && i < n; i++) {
    mc_task_status_t s;
    mc_batch_status(b, i, &s);
    PyObject *d = Py_BuildValue("{s:s,s:i,s:s,s:K,s:N}", "state", state_name(s.state), "code",
                                s.code, "code_name", mc_err_name(s.code), "transferred",
                                (unsigned long long)s.transferred, "message", mc_py_peer_str(s.msg));
    if (!d)
      Py_CLEAR(list);
    else
      PyList_SET_ITEM(list, (Py_ssize_t)i, d);
  }
  batch_leave(self, pb);
  return list;
}

/* ---- notifications ---- */

#define PEER_NAME_MAX 512

/* The preamble of a call on one peer (send_notify, describe_segment,
 * cut_peer): its name copied into tbuf, which the call passes on without
 * the GIL, the timeout checked (0 < timeout <= hi seconds), the engine
 * entered; 0, or -1 raised. */
static int peer_enter(EngineObject *self, const char *target, double timeout, double hi,
                      char tbuf[PEER_NAME_MAX]) {
  snprintf(tbuf, PEER_NAME_MAX, "%s", target);
  if (mc_py_check_timeout(timeout, 0, 1, hi, "timeout") < 0 || enter(self) < 0)
    return -1;
  return 0;
}

static PyObject *Engine_send_notify(EngineObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"target_hostname", "message", "timeout", NULL};
  const char *target;
  Py_buffer msg;
  double timeout = 5.0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "ss*|d:send_notify", kwlist, &target, &msg,
                                   &timeout))
    return NULL;
  char tbuf[PEER_NAME_MAX];
  if (peer_enter(self, target, timeout, 86400, tbuf) < 0) {
    PyBuffer_Release(&msg);
    return NULL;
  }
  mc_err_t err = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_engine_notify(self->eng, tbuf, msg.buf, (size_t)msg.len, (int64_t)(timeout * 1000),
                        &err);
  Py_END_ALLOW_THREADS
  PyObject *r = leave_with(self, rc, &err);
  PyBuffer_Release(&msg);
  return r;
}

PyDoc_STRVAR(notify_gated_doc,
"notify_gated(target_hostname, message, cuda_event=0, cuda_device=0, timeout=0,\n"
"    send_by=0) -> 0\n\n"
"Queues message (bytes) in the engine's gate FIFO, behind the gated batches and\n"
"notes queued before it: in its turn, once cuda_event (a CUevent handle; 0: none)\n"
"completed, the engine's notifier thread sends it to target_hostname (as\n"
"send_notify's message); no Python thread is woken.  Notes to a peer keep their\n"
"order.  Dropped (counted gate_notes_dropped) when the event fails, the engine\n"
"stops or send_by (time.time() seconds; 0: none) passed before its turn.\n"
"timeout: its receipt's limit in seconds (0: the engine's).  Only queues (the GIL\n"
"is kept); MooncakeError MC_EBUSY when the gate holds MC_GATE_MAX entries.");

static PyObject *Engine_notify_gated(EngineObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"target_hostname", "message", "cuda_event", "cuda_device", "timeout",
                           "send_by", NULL};
  const char *target;
  Py_buffer msg;
  unsigned long long ev = 0;
  int dev = 0;
  double timeout = 0, send_by = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "sy*|Kidd:notify_gated", kwlist, &target, &msg,
                                   &ev, &dev, &timeout, &send_by))
    return NULL;
  PyObject *r = NULL;
  if (dev < 0 || !(send_by >= 0 && send_by < 1e11))
    PyErr_Format(PyExc_ValueError, "notify_gated: cuda_device must be >= 0 and send_by a "
                 "time.time() value or 0");
  else if (mc_py_check_timeout(timeout, 0, 0, 3600, "timeout") == 0 && enter(self) == 0) {
    mc_note_opts_t o = {.cuda_event = ev, .cuda_device = dev,
                        .timeout_ms = (int64_t)(timeout * 1000.0),
                        .send_by_ns = (int64_t)(send_by * 1e9)};
    mc_err_t err = {0};
    int rc = mc_engine_notify_gated(self->eng, target, msg.buf, (size_t)msg.len, &o, &err);
    r = leave_with(self, rc, &err);
  }
  PyBuffer_Release(&msg);
  return r;
}

/* A peer's segment descriptor (its registered buffers) asked from the peer
 * itself over the control channel (also in P2P mode). */
static PyObject *Engine_describe_segment(EngineObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"segment_name", "timeout", NULL};
  const char *target;
  double timeout = 5.0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "s|d:describe_segment", kwlist, &target, &timeout))
    return NULL;
  if (!*target)
    return PyErr_Format(PyExc_ValueError, "describe_segment: segment_name is empty");
  char tbuf[PEER_NAME_MAX];
  if (peer_enter(self, target, timeout, 86400, tbuf) < 0)
    return NULL;
  mc_err_t err = {0};
  char *reply = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_engine_describe_peer(self->eng, tbuf, (int64_t)(timeout * 1000), &reply, &err);
  Py_END_ALLOW_THREADS
  leave(self);
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  PyObject *r = PyUnicode_DecodeUTF8(reply, (Py_ssize_t)strlen(reply), "replace");
  free(reply);
  return r;
}

/* `from` is the name the peer gave in its HELLO: any bytes (escaped, never
 * an exception).  A notification that cannot be appended (out of memory) is
 * counted in *lost; the others are still returned. */
typedef struct notify_sink {
  PyObject *list;
  size_t lost;
} notify_sink_t;

static void collect_notify(void *arg, const char *from, const void *msg, size_t len) {
  notify_sink_t *sink = arg;
  PyObject *t = Py_BuildValue("(Ny#)", mc_py_peer_str(from), (const char *)msg, (Py_ssize_t)len);
  if (!t || PyList_Append(sink->list, t) < 0) {
    PyErr_Clear();
    sink->lost++;
  }
  Py_XDECREF(t);
}

static PyObject *Engine_get_notifies(EngineObject *self, PyObject *unused) {
  (void)unused;
  PyObject *list = PyList_New(0);
  if (!list)
    return NULL;
  if (enter(self) < 0) {
    Py_DECREF(list);
    return NULL;
  }
  notify_sink_t sink = {list, 0};
  mc_engine_drain_notifies(self->eng, SIZE_MAX, collect_notify, &sink);
  leave(self);
  if (sink.lost && PyErr_WarnFormat(PyExc_ResourceWarning, 1,
                                    "get_notifies: %zu notification(s) dropped: out of memory",
                                    sink.lost) < 0)
    PyErr_Clear();
  return list;
}

static PyObject *Engine_wait_notifies(EngineObject *self, PyObject *args) {
  double timeout;
  if (!PyArg_ParseTuple(args, "d:wait_notifies", &timeout))
    return NULL;
  if (mc_py_check_timeout(timeout, 0, 0, 60, "timeout") < 0 || enter(self) < 0)
    return NULL;
  int have;
  WAIT_RELEASED(have = mc_engine_wait_notifies(self->eng, (int64_t)(timeout * 1e6)));
  leave(self);
  return PyBool_FromLong(have);
}

static PyObject *Engine_take_lost_peers(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
  if (enter(self) < 0)
    return NULL;
  char *names[MC_LOST_PEERS_MAX];
  size_t n = mc_engine_take_lost_peers(self->eng, names, MC_LOST_PEERS_MAX);
  leave(self);
  PyObject *out = PyList_New(0);
  for (size_t i = 0; i < n; i++) {
    PyObject *s = out ? PyUnicode_DecodeUTF8(names[i], (Py_ssize_t)strlen(names[i]), "replace")
                      : NULL;
    if (s && PyList_Append(out, s) < 0)
      Py_CLEAR(out);
    Py_XDECREF(s);
    if (!s)
      Py_CLEAR(out);
    free(names[i]);
  }
  return out;
}

/* The consumer's fence (mc_engine_cut_peer). */
static PyObject *Engine_cut_peer(EngineObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"segment_name", "timeout", NULL};
  const char *target;
  double timeout = 5.0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "s|d:cut_peer", kwlist, &target, &timeout))
    return NULL;
  char tbuf[PEER_NAME_MAX];
  if (strlen(target) >= sizeof tbuf)
    return PyErr_Format(PyExc_ValueError, "cut_peer: segment_name is %zu bytes long; give the "
                        "peer's \"host:port\"", strlen(target));
  if (peer_enter(self, target, timeout, 600, tbuf) < 0)
    return NULL;
  mc_err_t err = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_engine_cut_peer(self->eng, tbuf, (int64_t)(timeout * 1000), &err);
  Py_END_ALLOW_THREADS
  leave(self);
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  return PyLong_FromLong(rc);
}

/* ---- raw memory helpers (as in Mooncake's API) ----
 * The range must lie in memory registered with this engine (managed buffers
 * included), so a stale or wrong address raises instead of crashing, and
 * close() (which frees managed buffers) cannot race a copy: the life lock is
 * held across it. */

static int raw_enter(EngineObject *self, uint64_t addr, uint64_t len) {
  if (enter(self) < 0)
    return -1;
  mc_err_t err = {0};
  if (len > 0 && mc_engine_check_local(self->eng, addr, len, &err) < 0) {
    leave(self);
    mc_py_raise(ST(self), &err);
    return -1;
  }
  return 0;
}

static PyObject *Engine_write_bytes_to_buffer(EngineObject *self, PyObject *args) {
  PyObject *ao;
  Py_buffer data;
  Py_ssize_t len = -1;
  if (!PyArg_ParseTuple(args, "Oy*|n:write_bytes_to_buffer", &ao, &data, &len))
    return NULL;
  uint64_t addr;
  if (get_u64(ao, &addr, "buffer") < 0 || addr == 0) {
    PyBuffer_Release(&data);
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_ValueError, "buffer address is 0");
    return NULL;
  }
  if (len > data.len) {
    /* Was copied as data's length without a word (Mooncake's memcpy reads
     * past the end of data). */
    Py_ssize_t have = data.len;
    PyBuffer_Release(&data);
    return PyErr_Format(PyExc_ValueError, "write_bytes_to_buffer: length %zd is more than "
                        "the %zd bytes of data; pass at most len(data) (or leave length out)",
                        len, have);
  }
  if (len < 0)
    len = data.len;
  if (raw_enter(self, addr, (uint64_t)len) < 0) {
    PyBuffer_Release(&data);
    return NULL;
  }
  mc_err_t err = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_cuda_memcpy_any((void *)(uintptr_t)addr, data.buf, (size_t)len, &err);
  Py_END_ALLOW_THREADS
  PyObject *r = leave_with(self, rc, &err);
  PyBuffer_Release(&data);
  return r;
}

static PyObject *Engine_read_bytes_from_buffer(EngineObject *self, PyObject *args) {
  PyObject *ao;
  Py_ssize_t len;
  if (!PyArg_ParseTuple(args, "On:read_bytes_from_buffer", &ao, &len))
    return NULL;
  uint64_t addr;
  if (get_u64(ao, &addr, "buffer") < 0)
    return NULL;
  if (addr == 0 || len < 0)
    return PyErr_Format(PyExc_ValueError, "invalid buffer address or length");
  /* Checked before allocating: a claimed length beyond the region raises. */
  if (raw_enter(self, addr, (uint64_t)len) < 0)
    return NULL;
  PyObject *out = PyBytes_FromStringAndSize(NULL, len);
  if (!out) {
    leave(self);
    return NULL;
  }
  mc_err_t err = {0};
  int rc;
  char *dst = PyBytes_AS_STRING(out);
  Py_BEGIN_ALLOW_THREADS
  rc = mc_cuda_memcpy_any(dst, (const void *)(uintptr_t)addr, (size_t)len, &err);
  Py_END_ALLOW_THREADS
  leave(self);
  if (rc < 0) {
    Py_DECREF(out);
    return mc_py_raise(ST(self), &err);
  }
  return out;
}

/* Counters added after the first set (kept apart so the list above stays
 * readable); consumes d. */
static PyObject *add_more_stats(PyObject *d, const mc_engine_stats_t *s) {
  const struct {
    const char *k;
    uint64_t v;
  } more[] = {{"same_host_cpu_refused_unbound", s->same_host_cpu_refused_unbound},
              {"prehandshake_evicted", s->prehandshake_evicted},
              {"handshake_redials", s->handshake_redials},
              {"gpu_jobs", s->gpu_jobs},
              {"gpu_jobs_direct", s->gpu_jobs_direct},
              {"gate_notified", s->gate_notified},
              {"gate_event_failures", s->gate_event_failures},
              {"gate_host_batches", s->gate_host_batches},
              {"gate_notes_dropped", s->gate_notes_dropped},
              {"same_host_gpu_peers", s->same_host_gpu_peers},
              {"same_host_gpu_cached_blocks", s->same_host_gpu_cached_blocks},
              {"same_host_gpu_block_reuses", s->same_host_gpu_block_reuses},
              {"tcp_peers", s->tcp_peers},
              {"same_host_cpu_peer_entries", s->same_host_cpu_peer_entries}};
  for (size_t i = 0; i < sizeof more / sizeof more[0]; i++) {
    PyObject *v = PyLong_FromUnsignedLongLong(more[i].v);
    if (!v || PyDict_SetItemString(d, more[i].k, v) < 0) {
      Py_XDECREF(v);
      Py_DECREF(d);
      return NULL;
    }
    Py_DECREF(v);
  }
  return d;
}

static PyObject *Engine_get_stats(EngineObject *self, PyObject *unused) {
  (void)unused;
  if (enter(self) < 0)
    return NULL;
  mc_engine_stats_t s;
  mc_engine_get_stats(self->eng, &s);
  leave(self);
  PyObject *d = Py_BuildValue(
      "{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "notify_queue_bytes", (unsigned long long)s.notify_queue_bytes,
      "notify_queue_limit", (unsigned long long)s.notify_queue_limit, "notify_queue_msgs",
      (unsigned long long)s.notify_queue_msgs, "notify_refused",
      (unsigned long long)s.notify_refused, "reply_queue_bytes",
      (unsigned long long)s.reply_queue_bytes, "reply_queue_conn_limit",
      (unsigned long long)s.reply_queue_conn_limit, "reply_queue_total_limit",
      (unsigned long long)s.reply_queue_total_limit, "paused_conns",
      (unsigned long long)s.paused_conns, "prehandshake_conns",
      (unsigned long long)s.prehandshake_conns, "prehandshake_limit",
      (unsigned long long)s.prehandshake_limit, "prehandshake_refused",
      (unsigned long long)s.prehandshake_refused, "prehandshake_bytes_each",
      (unsigned long long)s.prehandshake_bytes_each, "same_host_cpu_bytes_written",
      (unsigned long long)s.same_host_cpu_bytes_written, "same_host_cpu_bytes_read",
      (unsigned long long)s.same_host_cpu_bytes_read, "same_host_cpu_ops",
      (unsigned long long)s.same_host_cpu_ops, "same_host_cpu_peers",
      (unsigned long long)s.same_host_cpu_peers, "detached_msgs",
      (unsigned long long)s.detached_msgs, "detached_bytes",
      (unsigned long long)s.detached_bytes);
  if (!d || !add_more_stats(d, &s))
    return NULL;
  /* Batches submitted from Python and not yet freed by a status call that
   * saw them end (transfer_check_status, get_batch_transfer_status). */
  PyObject *nb = PyLong_FromSsize_t(self->batches ? PyDict_Size(self->batches) : 0);
  if (!nb || PyDict_SetItemString(d, "open_batches", nb) < 0) {
    Py_XDECREF(nb);
    Py_DECREF(d);
    return NULL;
  }
  Py_DECREF(nb);
  return d;
}

/* A method entry whose Python name is its C function's without Engine_. */
#define METHOD(name, flags, doc) {#name, (PyCFunction)(void (*)(void))Engine_##name, flags, doc}
#define KWARGS (METH_VARARGS | METH_KEYWORDS)

static PyMethodDef Engine_methods[] = {
    METHOD(initialize, KWARGS, initialize_doc),
    METHOD(close, METH_NOARGS,
           "Cancels transfers in flight, unpublishes the segment, stops the engine."),
    {"__enter__", (PyCFunction)Engine_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Engine_exit, METH_VARARGS, NULL},
    METHOD(get_rpc_port, METH_NOARGS,
           "The TCP port peers reach this engine on (the port of its segment name)."),
    METHOD(get_segment_name, METH_NOARGS, "This engine's segment name, 'host:port'."),
    METHOD(describe_segment, KWARGS, "describe_segment(segment_name, timeout=5.0) -> str\n\n"
           "The segment descriptor (JSON: its registered buffers) of a peer, asked from the\n"
           "peer itself over the control channel (also in P2P mode); the own segment's\n"
           "without a request."),
    METHOD(get_metadata, METH_NOARGS, "The segment descriptor JSON this engine publishes."),
    METHOD(register_memory, KWARGS, "register_memory(addr, length, location='cpu') -> 0"),
    METHOD(batch_register_memory, KWARGS,
           "batch_register_memory(addrs, lengths, location='cpu') -> 0"),
    METHOD(unregister_memory, METH_O,
           "unregister_memory(addr) -> 0; waits for accesses in flight."),
    METHOD(batch_unregister_memory, METH_O, "batch_unregister_memory(addrs) -> 0"),
    METHOD(transfer_sync_write, KWARGS,
           "transfer_sync_write(target_hostname, buffer, peer_buffer_address, length) -> 0"),
    METHOD(transfer_sync_read, KWARGS,
           "transfer_sync_read(target_hostname, buffer, peer_buffer_address, length) -> 0"),
    METHOD(transfer_sync, KWARGS,
           "transfer_sync(target_hostname, buffer, peer_buffer_address, length, opcode) -> 0"),
    METHOD(batch_transfer_sync_write, KWARGS,
           "batch_transfer_sync_write(target_hostname, buffers, peer_buffer_addresses, "
           "lengths) -> 0"),
    METHOD(batch_transfer_sync_read, KWARGS,
           "batch_transfer_sync_read(target_hostname, buffers, peer_buffer_addresses, "
           "lengths) -> 0"),
    METHOD(batch_transfer_sync, KWARGS,
           "batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses, lengths, "
           "opcode) -> 0"),
    METHOD(batch_transfer_async, KWARGS,
           "batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths, opcode) "
           "-> batch_id"),
    METHOD(transfer_submit_write, KWARGS,
           "transfer_submit_write(target_hostname, buffer, peer_buffer_address, length) "
           "-> batch_id"),
    METHOD(batch_transfer_async_write, KWARGS, "batch_transfer_async_write(...) -> batch_id"),
    METHOD(batch_transfer_async_read, KWARGS, "batch_transfer_async_read(...) -> batch_id"),
    METHOD(get_batch_transfer_status, KWARGS, get_status_doc),
    METHOD(batch_transfer_async_write_gated, KWARGS, gated_doc),
    METHOD(gate_layer, METH_VARARGS, gate_layer_doc),
    METHOD(transfer_check_status, METH_O, check_doc),
    METHOD(transfer_wait, METH_VARARGS, transfer_wait_doc),
    METHOD(get_batch_status, METH_O,
           "get_batch_status(batch_id) -> list of per-request dicts (non-blocking)."),
    METHOD(send_notify, KWARGS,
           "send_notify(target_hostname, message: bytes|str, timeout=5.0) -> 0"),
    METHOD(notify_gated, KWARGS, notify_gated_doc),
    METHOD(get_stats, METH_NOARGS,
           "get_stats() -> dict: current use of the engine's budgets (unread notifications,\n"
           "queued replies, connections before their handshake) and their limits\n"
           "(docs/connector.md, Budgets); open_batches: batches not yet seen ended;\n"
           "gpu_jobs / gpu_jobs_direct: GPU copy jobs so far / launched by the submitting thread;\n"
           "gate_notified / gate_event_failures: notifications sent for completed gated\n"
           "batches / their CUDA event waits that failed; gate_host_batches: batches without\n"
           "an event the gate thread submitted (gate_layer's same-host CPU copies);\n"
           "gate_notes_dropped: notify_gated notes dropped (event failed, engine stopped,\n"
           "send_by passed)."),
    METHOD(get_notifies, METH_NOARGS,
           "get_notifies() -> list of (from_segment, message_bytes); drains the queue."),
    METHOD(wait_notifies, METH_VARARGS,
           "wait_notifies(timeout) -> bool: waits (GIL released) up to timeout seconds (0..60)\n"
           "for a notification get_notifies() would return, or a peer lost since it last\n"
           "returned (take_lost_peers names it; a loss wakes it once); takes none."),
    METHOD(last_wake, METH_NOARGS,
           "last_wake() -> (woke, gil_wait) | None: this thread's last wait_notifies or\n"
           "transfer_wait: when its wait ended (time.monotonic() seconds) and the seconds it\n"
           "then waited to hold the GIL again (another thread running Python keeps it up to\n"
           "sys.getswitchinterval()); None before the thread's first such wait."),
    METHOD(take_lost_peers, METH_NOARGS,
           "take_lost_peers() -> list[str]: peers (segment names) whose connection to or from\n"
           "this engine failed or closed since the last call, each once (at most 64 kept)."),
    METHOD(cut_peer, KWARGS,
           "cut_peer(segment_name, timeout=5.0) -> int: the consumer's fence: resets every\n"
           "incoming connection from that peer and returns (GIL released) once none of its\n"
           "bytes can be written into our memory any more: how many were cut.  Its other\n"
           "transfers in flight fail; raises (timed out) if the I/O threads did not confirm.\n"
           "Same-host CPU / GPU copies the peer makes itself are not fenced (docs/connector.md)."),
    METHOD(allocate_managed_buffer, METH_O,
           "allocate_managed_buffer(length) -> addr: zeroed, page-aligned, registered host memory"),
    METHOD(free_managed_buffer, METH_VARARGS,
           "free_managed_buffer(addr, length) -> 0: unregisters (waits for accesses) and frees"),
    METHOD(write_bytes_to_buffer, METH_VARARGS,
           "write_bytes_to_buffer(addr, data, length=-1) -> 0 (memcpy; the address is trusted)"),
    METHOD(read_bytes_from_buffer, METH_VARARGS,
           "read_bytes_from_buffer(addr, length) -> bytes (the address is trusted)"),
    {NULL, NULL, 0, NULL},
};
#undef KWARGS
#undef METHOD

static PyType_Slot Engine_slots[] = {
    {Py_tp_new, Engine_new},
    {Py_tp_dealloc, Engine_dealloc},
    {Py_tp_traverse, Engine_traverse},
    {Py_tp_clear, Engine_clear},
    {Py_tp_methods, Engine_methods},
    {Py_tp_doc, "TransferEngine(): Mooncake-compatible transfer engine (TCP)."},
    {0, NULL},
};

static PyType_Spec Engine_spec = {
    .name = "mooncake_connector.TransferEngine",
    .basicsize = sizeof(EngineObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_BASETYPE,
    .slots = Engine_slots,
};

int mc_py_engine_add(PyObject *module, mc_py_state_t *st) {
  PyObject *t = PyType_FromModuleAndSpec(module, &Engine_spec, NULL);
  if (!t)
    return -1;
  st->EngineType = (PyTypeObject *)t;
  if (PyModule_AddObjectRef(module, "TransferEngine", t) < 0)
    return -1;
  if (PyModule_AddIntConstant(module, "OPCODE_READ", MC_OP_READ) < 0 ||
      PyModule_AddIntConstant(module, "OPCODE_WRITE", MC_OP_WRITE) < 0)
    return -1;
  return 0;
}
