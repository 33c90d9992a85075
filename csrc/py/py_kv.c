/* mooncake_connector.KVTransfer: send_kv / recv_kv (csrc/kv/) for Python.
 *
 *   kv = KVTransfer(engine, lookup_buffer=None, workers=0)
 *   kv.send_kv(tokens, extents, hidden=None, copy=False, timeout=0.0) -> int
 *   kv.recv_kv(producer, tokens, dest, timeout=30.0) -> matched tokens
 *
 * send_kv stores KV extents in this engine's lookup buffer (the producer
 * side); recv_kv asks a producer segment for the longest matching prefix and
 * returns once the bytes have landed in `dest` (memory registered with this
 * engine).  The GIL is released while waiting. */
#include <string.h>

#include "kv/kv_transfer.h"
#include "py/py_common.h"

/* The life lock, as TransferEngine's (py_engine.c): a call using kv holds
 * it for reading; close sets `closing` (new calls fail), stops kv (waiting
 * calls fail and return), takes it for writing (the calls in flight have
 * left), then frees kv.  Nobody waits for it while holding the GIL. */
typedef struct {
  PyObject_HEAD
  mc_kv_t *kv;
  pthread_rwlock_t life;
  int closing; /* GIL-protected */
  PyObject *engine; /* TransferEngine, borrowed for our lifetime */
  PyObject *lookup; /* LookupBuffer or NULL */
  mc_lookup_t *lb;
} KVObject;

#define ST(self) mc_py_state_from_type(Py_TYPE(self))

static void kv_close(KVObject *self) {
  if (self->closing)
    return; /* another thread is closing it */
  if (self->kv) {
    mc_kv_t *kv = self->kv;
    self->closing = 1;
    Py_BEGIN_ALLOW_THREADS
    mc_kv_stop(kv);
    pthread_rwlock_wrlock(&self->life);
    mc_kv_destroy(kv);
    pthread_rwlock_unlock(&self->life);
    Py_END_ALLOW_THREADS
    self->kv = NULL;
    self->closing = 0;
  }
  if (self->engine) {
    mc_py_engine_unborrow(self->engine);
    Py_CLEAR(self->engine);
  }
  Py_CLEAR(self->lookup);
}

static PyObject *KV_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"engine", "lookup_buffer", "workers", NULL};
  PyObject *eng_obj, *lb_obj = Py_None;
  int workers = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Oi:KVTransfer", kwlist, &eng_obj, &lb_obj,
                                   &workers))
    return NULL;
  mc_lookup_t *lb = NULL;
  if (lb_obj != Py_None && !(lb = mc_py_lookup_ptr(lb_obj)))
    return NULL;
  mc_engine_t *eng = mc_py_engine_borrow(eng_obj);
  if (!eng)
    return NULL;
  KVObject *self = (KVObject *)type->tp_alloc(type, 0);
  if (!self) {
    mc_py_engine_unborrow(eng_obj);
    return NULL;
  }
  pthread_rwlock_init(&self->life, NULL);
  self->engine = Py_NewRef(eng_obj);
  self->lookup = lb_obj == Py_None ? NULL : Py_NewRef(lb_obj);
  self->lb = lb;
  mc_err_t err = {0};
  int rc;
  mc_kv_t *kv = NULL;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_kv_create(eng, lb, workers, &kv, &err);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    mc_py_raise(mc_py_state_from_type(type), &err);
    Py_DECREF(self);
    return NULL;
  }
  self->kv = kv;
  return (PyObject *)self;
}

static void KV_dealloc(KVObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  kv_close(self);
  pthread_rwlock_destroy(&self->life);
  tp->tp_free((PyObject *)self);
  Py_DECREF(tp);
}

static int KV_traverse(KVObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(self->engine);
  Py_VISIT(self->lookup);
  return 0;
}

static int live(KVObject *self) {
  if (!self->kv || self->closing) {
    mc_err_t err;
    mc_err_set(&err, MC_ECLOSED, "KVTransfer is closed");
    mc_py_raise(ST(self), &err);
    return 0;
  }
  return 1;
}

/* Takes the life lock (reading) for a call that uses kv, or raises the
 * closed error; the GIL is released only to wait for it. */
static int kv_enter(KVObject *self) {
  if (!live(self))
    return -1;
  int rc = mc_py_life_rdlock(&self->life);
  if (rc != 0) {
    PyErr_Format(PyExc_RuntimeError, "KVTransfer: cannot take its life lock (%s)", strerror(rc));
    return -1;
  }
  if (!live(self)) {
    pthread_rwlock_unlock(&self->life);
    return -1;
  }
  return 0;
}
static void kv_leave(KVObject *self) { pthread_rwlock_unlock(&self->life); }

/* Extents list -> malloc'ed array (PyMem_Raw); NULL with an exception set. */
static mc_lookup_extent_t *extents_from(PyObject *obj, const char *what, Py_ssize_t *n) {
  char msg[96];
  snprintf(msg, sizeof msg, "%s must be a list of (addr, length) tuples", what);
  PyObject *fast = PySequence_Fast(obj, msg);
  if (!fast)
    return NULL;
  *n = PySequence_Fast_GET_SIZE(fast);
  mc_lookup_extent_t *x = PyMem_RawMalloc((size_t)(*n ? *n : 1) * sizeof *x);
  if (!x) {
    Py_DECREF(fast);
    PyErr_NoMemory();
    return NULL;
  }
  for (Py_ssize_t i = 0; i < *n; i++) {
    if (mc_py_get_extent(PySequence_Fast_GET_ITEM(fast, i), &x[i], what, i) < 0) {
      PyMem_RawFree(x);
      Py_DECREF(fast);
      return NULL;
    }
  }
  Py_DECREF(fast);
  return x;
}

/* What recv_kv, pull_start and probe hold across their call: the token
 * ids, the destination extents (dest, hidden_dest: either may be absent)
 * and kv's life lock. */
typedef struct {
  mc_py_tokens_t t;
  mc_lookup_extent_t *dest, *hid;
  Py_ssize_t nd, nh;
} kv_call_t;

/* Converts dest_obj (NULL: none), hid_obj (NULL or None: none) and the
 * tokens, in that order, then enters kv: 0, or -1 raised, nothing held. */
static int kv_call_begin(KVObject *self, kv_call_t *c, PyObject *tok_obj, PyObject *dest_obj,
                         PyObject *hid_obj) {
  memset(c, 0, sizeof *c);
  if (dest_obj && !(c->dest = extents_from(dest_obj, "dest", &c->nd)))
    return -1;
  if (hid_obj && hid_obj != Py_None &&
      !(c->hid = extents_from(hid_obj, "hidden_dest", &c->nh))) {
    PyMem_RawFree(c->dest);
    return -1;
  }
  if (mc_py_tokens_get(tok_obj, &c->t) < 0) {
    PyMem_RawFree(c->dest);
    PyMem_RawFree(c->hid);
    return -1;
  }
  if (kv_enter(self) < 0) {
    mc_py_tokens_put(&c->t);
    PyMem_RawFree(c->dest);
    PyMem_RawFree(c->hid);
    return -1;
  }
  return 0;
}

/* Leaves kv, then releases what kv_call_begin took. */
static void kv_call_end(KVObject *self, kv_call_t *c) {
  kv_leave(self);
  mc_py_tokens_put(&c->t);
  PyMem_RawFree(c->dest);
  PyMem_RawFree(c->hid);
}

static PyObject *KV_recv_kv(KVObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"producer", "tokens", "dest", "timeout", "extents_per_block",
                           "hidden_dest", "pull", "skip_blocks", NULL};
  const char *producer;
  PyObject *tok_obj, *dest_obj, *hid_obj = Py_None;
  double timeout = 30.0;
  unsigned int epb = 1;
  int pull = 0;
  unsigned int skip = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO|dIOpI:recv_kv", kwlist, &producer, &tok_obj,
                                   &dest_obj, &timeout, &epb, &hid_obj, &pull, &skip))
    return NULL;
  if (!live(self))
    return NULL;
  if (mc_py_check_timeout(timeout, 0, 1, 86400, "timeout") < 0)
    return NULL;
  if (pull && hid_obj != Py_None)
    return PyErr_Format(PyExc_ValueError, "recv_kv(pull=True) does not move hidden states; "
                        "leave hidden_dest out or use pull=False");
  if (skip && !pull)
    return PyErr_Format(PyExc_ValueError, "recv_kv: skip_blocks needs pull=True");
  char prod[512];
  snprintf(prod, sizeof prod, "%s", producer);
  kv_call_t c;
  if (kv_call_begin(self, &c, tok_obj, dest_obj, hid_obj) < 0)
    return NULL;
  mc_err_t err = {0};
  long rc;
  mc_kv_t *kv = self->kv;
  Py_BEGIN_ALLOW_THREADS
  if (pull)
    rc = mc_kv_pull_ex(kv, prod, c.t.ptr, c.t.n, c.t.width, skip, c.dest, (size_t)c.nd, epb,
                       (int)(timeout * 1000.0), &err);
  else
    rc = mc_kv_recv_ex(kv, prod, c.t.ptr, c.t.n, c.t.width, c.dest, (size_t)c.nd, epb, c.hid,
                       (size_t)c.nh, (int)(timeout * 1000.0), &err);
  Py_END_ALLOW_THREADS
  kv_call_end(self, &c);
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  return PyLong_FromLong(rc);
}

static PyObject *KV_pull_start(KVObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"producer", "tokens", "dest", "timeout", "extents_per_block",
                           "skip_blocks", NULL};
  const char *producer;
  PyObject *tok_obj, *dest_obj;
  double timeout = 30.0;
  unsigned int epb = 1, skip = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO|dII:pull_start", kwlist, &producer,
                                   &tok_obj, &dest_obj, &timeout, &epb, &skip))
    return NULL;
  if (!live(self))
    return NULL;
  if (mc_py_check_timeout(timeout, 0, 1, 86400, "timeout") < 0)
    return NULL;
  if (epb == 0 || epb > 0xffff)
    return PyErr_Format(PyExc_ValueError, "extents_per_block must be 1..65535");
  kv_call_t c;
  if (kv_call_begin(self, &c, tok_obj, dest_obj, NULL) < 0)
    return NULL;
  mc_err_t err = {0};
  uint64_t id = 0;
  int rc = mc_kv_pull_start(self->kv, producer, c.t.ptr, c.t.n, c.t.width, skip, c.dest,
                            (size_t)c.nd, epb, (int)(timeout * 1000.0), &id, &err);
  kv_call_end(self, &c);
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  return PyLong_FromUnsignedLongLong((unsigned long long)id);
}

static PyObject *KV_pull_poll(KVObject *self, PyObject *arg) {
  if (!live(self))
    return NULL;
  unsigned long long id = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred())
    return NULL;
  long result = 0;
  double secs = 0;
  mc_err_t err = {0};
  if (kv_enter(self) < 0)
    return NULL;
  int rc = mc_kv_pull_poll(self->kv, id, &result, &secs, &err);
  kv_leave(self);
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  if (rc == 0)
    Py_RETURN_NONE;
  if (result < 0)
    return Py_BuildValue("(iNd)", 0, mc_py_peer_str(err.msg), secs);
  return Py_BuildValue("(lOd)", result, Py_None, secs);
}

static PyObject *KV_pull_wait(KVObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"ids", "timeout", NULL};
  PyObject *ids_obj;
  double timeout = 30.0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|d:pull_wait", kwlist, &ids_obj, &timeout))
    return NULL;
  if (!live(self))
    return NULL;
  if (mc_py_check_timeout(timeout, 0, 0, 86400, "timeout") < 0)
    return NULL;
  PyObject *fast = PySequence_Fast(ids_obj, "ids must be a sequence of pull ids");
  if (!fast)
    return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  uint64_t *ids = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof *ids);
  if (!ids) {
    Py_DECREF(fast);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    ids[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (PyErr_Occurred()) {
      PyMem_RawFree(ids);
      Py_DECREF(fast);
      return NULL;
    }
  }
  Py_DECREF(fast);
  mc_err_t err = {0};
  int rc;
  if (kv_enter(self) < 0) {
    PyMem_RawFree(ids);
    return NULL;
  }
  mc_kv_t *kv = self->kv;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_kv_pull_wait(kv, ids, (size_t)n, (int)(timeout * 1000.0), &err);
  Py_END_ALLOW_THREADS
  kv_leave(self);
  PyMem_RawFree(ids);
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  return PyBool_FromLong(rc);
}

static PyObject *KV_probe(KVObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"producer", "tokens", "timeout", "extents_per_block", NULL};
  const char *producer;
  PyObject *tok_obj;
  double timeout = 1.0;
  unsigned int epb = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "sO|dI:probe", kwlist, &producer, &tok_obj,
                                   &timeout, &epb))
    return NULL;
  if (!live(self))
    return NULL;
  if (mc_py_check_timeout(timeout, 0, 1, 86400, "timeout") < 0)
    return NULL;
  if (epb > 0xffff)
    return PyErr_Format(PyExc_ValueError, "extents_per_block must be 0..65535");
  char prod[512];
  snprintf(prod, sizeof prod, "%s", producer);
  kv_call_t c;
  if (kv_call_begin(self, &c, tok_obj, NULL, NULL) < 0)
    return NULL;
  mc_err_t err = {0};
  long rc;
  mc_kv_t *kv = self->kv;
  int ms = (int)(timeout * 1000.0);
  Py_BEGIN_ALLOW_THREADS
  rc = mc_kv_probe(kv, prod, c.t.ptr, c.t.n, c.t.width, epb, ms > 0 ? ms : 1, &err);
  Py_END_ALLOW_THREADS
  kv_call_end(self, &c);
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  return PyLong_FromLong(rc);
}

static PyObject *KV_send_kv(KVObject *self, PyObject *args, PyObject *kw) {
  if (!live(self))
    return NULL;
  if (!self->lookup) {
    mc_err_t err;
    mc_err_set(&err, MC_EINVAL, "send_kv needs a lookup_buffer: KVTransfer(engine, "
               "LookupBuffer(...))");
    return mc_py_raise(ST(self), &err);
  }
  PyObject *lb = Py_NewRef(self->lookup); /* close may drop self->lookup meanwhile */
  PyObject *insert = PyObject_GetAttrString(lb, "insert");
  Py_DECREF(lb);
  if (!insert)
    return NULL;
  PyObject *r = PyObject_Call(insert, args, kw);
  Py_DECREF(insert);
  return r;
}

static PyObject *KV_stats(KVObject *self, PyObject *unused) {
  (void)unused;
  if (kv_enter(self) < 0)
    return NULL;
  mc_kv_stats_t s;
  mc_kv_get_stats(self->kv, &s);
  kv_leave(self);
  const struct {
    const char *k;
    uint64_t v;
  } f[] = {{"requests_served", s.requests_served}, {"tokens_served", s.tokens_served},
           {"bytes_served", s.bytes_served},       {"serve_errors", s.serve_errors},
           {"recvs", s.recvs},                     {"recv_hits", s.recv_hits},
           {"recv_tokens", s.recv_tokens},         {"recv_errors", s.recv_errors},
           {"leases_granted", s.leases_granted},   {"leases_released", s.leases_released},
           {"leases_expired", s.leases_expired},   {"pulls", s.pulls},
           {"pull_hits", s.pull_hits},             {"pull_tokens", s.pull_tokens},
           {"pull_bytes", s.pull_bytes},           {"pull_errors", s.pull_errors},
           {"probes", s.probes},                   {"probes_served", s.probes_served},
           {"queue_bytes", s.queue_bytes},         {"queue_limit", s.queue_limit},
           {"queue_jobs", s.queue_jobs},           {"queue_refused", s.queue_refused},
           {"pulls_open", s.pulls_open}};
  PyObject *d = PyDict_New();
  for (size_t i = 0; d && i < sizeof f / sizeof f[0]; i++) {
    PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)f[i].v);
    if (!v || PyDict_SetItemString(d, f[i].k, v) < 0) {
      Py_XDECREF(v);
      Py_CLEAR(d);
      break;
    }
    Py_DECREF(v);
  }
  return d;
}

static PyObject *KV_close(KVObject *self, PyObject *unused) {
  (void)unused;
  kv_close(self);
  Py_RETURN_NONE;
}

static PyObject *KV_enter(KVObject *self, PyObject *unused) {
  (void)unused;
  return Py_NewRef(self);
}

static PyObject *KV_exit(KVObject *self, PyObject *args) {
  (void)args;
  kv_close(self);
  Py_RETURN_FALSE;
}

static PyMethodDef KV_methods[] = {
    {"recv_kv", (PyCFunction)(void (*)(void))KV_recv_kv, METH_VARARGS | METH_KEYWORDS,
     "recv_kv(producer, tokens, dest, timeout=30.0, extents_per_block=1, hidden_dest=None,\n"
     "        pull=False) -> matched tokens\n\n"
     "pull=True: the producer leases the matching blocks and this engine READs them itself,\n"
     "so nothing can land in dest after the call returns, even on a timeout. skip_blocks\n"
     "(pull only): the first blocks are here already; dest starts at block skip_blocks.\n"
     "Asks the producer segment for the longest block-aligned prefix of tokens it holds;\n"
     "it writes the matching blocks into dest (block-major (addr, length) extents in memory\n"
     "registered with this engine). hidden_dest (one extent per block) also receives the\n"
     "hidden states stored with the blocks. Returns once the bytes have landed (0 on a miss)."},
    {"pull_start", (PyCFunction)(void (*)(void))KV_pull_start, METH_VARARGS | METH_KEYWORDS,
     "pull_start(producer, tokens, dest, timeout=30.0, extents_per_block=1, skip_blocks=0)\n"
     "-> pull id\n\n"
     "recv_kv(pull=True) in the background on the engine's pull threads; returns at once.\n"
     "Poll with pull_poll(id). A dest extent (addr, length, (1 << 63) | offset) reads only\n"
     "length bytes from byte offset of the producer's extent (a share of its KV heads)."},
    {"pull_poll", (PyCFunction)KV_pull_poll, METH_O,
     "pull_poll(id) -> None while running, else (matched tokens, error text or None,\n"
     "seconds); a finished pull is reported once. Never blocks."},
    {"pull_wait", (PyCFunction)(void (*)(void))KV_pull_wait, METH_VARARGS | METH_KEYWORDS,
     "pull_wait(ids, timeout=30.0) -> True once every pull in ids is done (pull_poll then\n"
     "reports it), False if timeout passed first. Releases the GIL while it waits."},
    {"probe", (PyCFunction)(void (*)(void))KV_probe, METH_VARARGS | METH_KEYWORDS,
     "probe(producer, tokens, timeout=1.0, extents_per_block=0) -> matched tokens\n\n"
     "Asks the producer how many tokens of the longest block-aligned prefix of tokens it\n"
     "holds now. Nothing is leased, pinned or consumed: the answer can be stale by the time\n"
     "a pull runs. extents_per_block 0 skips the layout check."},
    {"send_kv", (PyCFunction)(void (*)(void))KV_send_kv, METH_VARARGS | METH_KEYWORDS,
     "send_kv(tokens, extents, hidden=None, copy=False, timeout=0.0) -> stored tokens\n\n"
     "Stores the KV of tokens in this producer's lookup buffer (LookupBuffer.insert)."},
    {"stats", (PyCFunction)KV_stats, METH_NOARGS, "stats() -> dict of counters"},
    {"close", (PyCFunction)KV_close, METH_NOARGS,
     "Stops serving, fails waiting recv_kv calls, releases the engine."},
    {"__enter__", (PyCFunction)KV_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)KV_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot KV_slots[] = {
    {Py_tp_new, KV_new},
    {Py_tp_dealloc, KV_dealloc},
    {Py_tp_traverse, KV_traverse},
    {Py_tp_methods, KV_methods},
    {Py_tp_doc, "KVTransfer(engine, lookup_buffer=None, workers=0): send_kv / recv_kv."},
    {0, NULL},
};

static PyType_Spec KV_spec = {
    .name = "mooncake_connector.KVTransfer",
    .basicsize = sizeof(KVObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = KV_slots,
};

int mc_py_kv_add(PyObject *module, mc_py_state_t *st) {
  (void)st;
  PyObject *t = PyType_FromModuleAndSpec(module, &KV_spec, NULL);
  if (!t)
    return -1;
  int rc = PyModule_AddObjectRef(module, "KVTransfer", t);
  Py_DECREF(t);
  return rc;
}
