/* mooncake_connector.LookupBuffer and hash_token_blocks(): the lookup buffer
 * (csrc/lookup/) for Python.  Token ids come from any C-contiguous buffer of
 * 4- or 8-byte integers (array.array, numpy, memoryview of a CPU tensor) or
 * a sequence of ints; torch is never imported.  The GIL is released around
 * hashing and every buffer operation. */
#include <stdint.h>
#include <string.h>

#include "lookup/lookup_buffer.h"
#include "py/py_common.h"

typedef struct {
  PyObject_HEAD
  mc_lookup_t *lb;
  PyObject *leases; /* dict: lease id -> capsule(mc_lookup_match_t*) */
  PyObject *result_type;
  long long next_lease;
  int mode;
} LookupObject;

#define ST(self) mc_py_state_from_type(Py_TYPE(self))

/* Token ids and extents are parsed by py_tokens.c. */
#define tokens_t mc_py_tokens_t
#define tokens_get mc_py_tokens_get
#define tokens_put mc_py_tokens_put
#define get_extent mc_py_get_extent

static PyObject *extent_tuple(const mc_lookup_extent_t *x) {
  return Py_BuildValue("(KKK)", (unsigned long long)x->addr, (unsigned long long)x->len,
                       (unsigned long long)x->tag);
}

/* ---- LookupBuffer ---- */

mc_lookup_t *mc_py_lookup_ptr(PyObject *o) {
  if (mc_py_check_type(o, MC_PY_TYPE(LookupType), "LookupBuffer") < 0)
    return NULL;
  return ((LookupObject *)o)->lb;
}

static PyObject *Lookup_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"capacity_bytes", "block_size", "seed", "mode", "policy", "ttl_s",
                           "extents_per_block", "track_freed", "_test_weak_hash_bits", NULL};
  unsigned long long cap, seed = 0;
  unsigned int bs = MC_LOOKUP_DEFAULT_BLOCK, epb = 1, weak = 0;
  const char *mode = "keep", *policy = "evict";
  double ttl = 0;
  int track = 0;
  PyObject *capo;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|IKssdIpI:LookupBuffer", kwlist, &capo, &bs, &seed,
                                   &mode, &policy, &ttl, &epb, &track, &weak))
    return NULL;
  mc_py_state_t *st = mc_py_state_from_type(type);
  mc_err_t err = {0};
  /* "K" would take -1 as 2**64-1 (a buffer without bound) and 2**64 as 0. */
  if (!PyLong_Check(capo) || PyBool_Check(capo)) {
    PyErr_Format(PyExc_TypeError, "LookupBuffer capacity_bytes must be an int (bytes), not "
                 "%.80s", Py_TYPE(capo)->tp_name);
    return NULL;
  }
  cap = PyLong_AsUnsignedLongLong(capo);
  if (cap == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyObject *r = PyObject_Repr(capo);
    mc_err_set(&err, MC_EINVAL, "lookup buffer capacity_bytes %.60s is out of range; give the "
               "bytes of KV it may hold, 1..2**64-1", r ? PyUnicode_AsUTF8(r) : "?");
    Py_XDECREF(r);
    PyErr_Clear();
    return mc_py_raise(st, &err);
  }
  mc_lookup_opts_t o = {.capacity_bytes = cap, .block_size = bs, .seed = seed,
                        .extents_per_block = epb, .track_freed = track,
                        .test_weak_hash_bits = weak};
  if (!strcmp(mode, "keep"))
    o.mode = MC_LOOKUP_KEEP;
  else if (!strcmp(mode, "consume"))
    o.mode = MC_LOOKUP_CONSUME;
  else {
    mc_err_set(&err, MC_EINVAL, "mode \"%.40s\" is not accepted; use \"keep\" or \"consume\"",
               mode);
    return mc_py_raise(st, &err);
  }
  if (!strcmp(policy, "evict"))
    o.policy = MC_LOOKUP_EVICT;
  else if (!strcmp(policy, "backpressure"))
    o.policy = MC_LOOKUP_BACKPRESSURE;
  else {
    mc_err_set(&err, MC_EINVAL,
               "policy \"%.40s\" is not accepted; use \"evict\" or \"backpressure\"", policy);
    return mc_py_raise(st, &err);
  }
  if (!(ttl >= 0) || ttl > 1e9) {
    mc_err_set(&err, MC_EINVAL, "ttl_s %g is out of range; use 0 (never) or seconds > 0", ttl);
    return mc_py_raise(st, &err);
  }
  o.ttl_ns = (uint64_t)(ttl * 1e9);
  if (bs == 0) {
    mc_err_set(&err, MC_EINVAL, "block_size 0 is out of range; use 1..%d tokens",
               MC_LOOKUP_MAX_BLOCK);
    return mc_py_raise(st, &err);
  }
  PyObject *module = PyType_GetModuleByDef(type, &mc_py_moduledef);
  PyObject *rt = module ? PyObject_GetAttrString(module, "LookupResult") : NULL;
  if (!rt)
    return NULL;
  LookupObject *self = (LookupObject *)type->tp_alloc(type, 0);
  if (!self) {
    Py_DECREF(rt);
    return NULL;
  }
  self->result_type = rt;
  self->mode = o.mode;
  self->leases = PyDict_New();
  if (!self->leases) {
    Py_DECREF(self);
    return NULL;
  }
  if (mc_lookup_create(&o, &self->lb, &err) < 0) {
    Py_DECREF(self);
    return mc_py_raise(st, &err);
  }
  return (PyObject *)self;
}

static void release_all(LookupObject *self) {
  PyObject *key, *val;
  Py_ssize_t pos = 0;
  while (self->leases && PyDict_Next(self->leases, &pos, &key, &val)) {
    mc_lookup_match_t *m = PyCapsule_GetPointer(val, "mc_lookup_match");
    if (m && self->lb)
      mc_lookup_release(self->lb, m);
  }
  if (self->leases)
    PyDict_Clear(self->leases);
}

static void Lookup_dealloc(LookupObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  release_all(self);
  mc_lookup_destroy(self->lb);
  self->lb = NULL;
  Py_CLEAR(self->leases);
  Py_CLEAR(self->result_type);
  tp->tp_free((PyObject *)self);
  Py_DECREF(tp);
}

static int Lookup_traverse(LookupObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(self->leases);
  Py_VISIT(self->result_type);
  return 0;
}

static int Lookup_clear(LookupObject *self) {
  release_all(self);
  Py_CLEAR(self->leases);
  Py_CLEAR(self->result_type);
  return 0;
}

static int get_extent_list(PyObject *o, size_t want, mc_lookup_extent_t **out,
                           const char *what, const char *per) {
  PyObject *fast = PySequence_Fast(o, "extents must be a list of (addr, length[, tag]) tuples");
  if (!fast)
    return -1;
  Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
  if ((size_t)k != want) {
    Py_DECREF(fast);
    PyErr_Format(PyExc_ValueError, "%s has %zd items but the tokens fill %zu (%s)", what, k,
                 want, per);
    return -1;
  }
  mc_lookup_extent_t *v = PyMem_RawMalloc((want ? want : 1) * sizeof *v);
  if (!v) {
    Py_DECREF(fast);
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < k; i++) {
    if (get_extent(PySequence_Fast_GET_ITEM(fast, i), &v[i], what, i) < 0) {
      PyMem_RawFree(v);
      Py_DECREF(fast);
      return -1;
    }
  }
  Py_DECREF(fast);
  *out = v;
  return 0;
}

PyDoc_STRVAR(insert_doc,
"insert(tokens, extents, hidden=None, copy=False, timeout=0.0) -> int\n\n"
"Stores the KV of the full blocks of `tokens`. extents: one (addr, length[, tag])\n"
"per block and per extent (block-major); hidden: None or one per block. With\n"
"copy=True the bytes are copied into staging memory the buffer owns. Blocks of a\n"
"prefix already stored are shared. Returns the number of tokens stored. When\n"
"full: policy 'evict' drops LRU entries, 'backpressure' waits up to `timeout` s\n"
"(MooncakeError code MC_EBUSY at once, TransferTimeout after waiting).");

static PyObject *Lookup_insert(LookupObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"tokens", "extents", "hidden", "copy", "timeout", NULL};
  PyObject *to, *eo, *ho = Py_None;
  int copy = 0;
  double timeout = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|Opd:insert", kwlist, &to, &eo, &ho, &copy,
                                   &timeout))
    return NULL;
  if (mc_py_check_timeout(timeout, 0, 0, 86400, "timeout") < 0)
    return NULL;
  tokens_t t;
  if (tokens_get(to, &t) < 0)
    return NULL;
  const mc_token_hasher_t *hs = mc_lookup_hasher(self->lb);
  size_t n = t.n / hs->block_size, epb = mc_lookup_extents_per_block(self->lb);
  mc_lookup_extent_t *kv = NULL, *hid = NULL;
  if (get_extent_list(eo, n * epb, &kv, "extents", "blocks x extents_per_block") < 0 ||
      (ho != Py_None && get_extent_list(ho, n, &hid, "hidden", "blocks") < 0)) {
    PyMem_RawFree(kv);
    tokens_put(&t);
    return NULL;
  }
  int tms = timeout <= 0 ? 0 : timeout > 2e6 ? 2000000000 : (int)(timeout * 1000 + 0.5);
  if (timeout > 0 && tms == 0)
    tms = 1;
  mc_err_t err = {0};
  long rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_lookup_insert(self->lb, t.ptr, t.n, t.width, kv, hid, copy ? MC_LOOKUP_COPY : 0, tms,
                        NULL, &err);
  Py_END_ALLOW_THREADS
  PyMem_RawFree(kv);
  PyMem_RawFree(hid);
  tokens_put(&t);
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  return PyLong_FromLong(rc * (long)hs->block_size);
}

PyDoc_STRVAR(lookup_doc,
"lookup(tokens, hold=False) -> LookupResult(matched_tokens, extents)\n\n"
"Longest block-aligned prefix of `tokens` stored here. extents: (addr, length, tag)\n"
"per matched block and extent; .hidden: the hidden-states extent per block (length\n"
"0 = none). In 'consume' mode a hit removes the entry. With hold=True the matched\n"
"blocks stay valid (not freed by consume/evict/expiry) until release(result.lease).");

static PyObject *Lookup_lookup(LookupObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"tokens", "hold", NULL};
  PyObject *to;
  int hold = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p:lookup", kwlist, &to, &hold))
    return NULL;
  tokens_t t;
  if (tokens_get(to, &t) < 0)
    return NULL;
  mc_err_t err = {0};
  mc_lookup_match_t *m = NULL;
  long rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_lookup_find(self->lb, t.ptr, t.n, t.width, &m, &err);
  Py_END_ALLOW_THREADS
  tokens_put(&t);
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  size_t nb = mc_lookup_match_blocks(m), epb = mc_lookup_extents_per_block(self->lb);
  PyObject *ext = PyList_New((Py_ssize_t)(nb * epb));
  PyObject *hid = PyList_New((Py_ssize_t)nb);
  PyObject *res = PyStructSequence_New((PyTypeObject *)self->result_type);
  PyObject *lease = NULL;
  if (!ext || !hid || !res)
    goto fail;
  for (size_t i = 0; i < nb; i++) {
    const mc_lookup_extent_t *kv = mc_lookup_match_kv(m, i);
    for (size_t e = 0; e < epb; e++) {
      PyObject *x = extent_tuple(&kv[e]);
      if (!x)
        goto fail;
      PyList_SET_ITEM(ext, (Py_ssize_t)(i * epb + e), x);
    }
    PyObject *x = extent_tuple(mc_lookup_match_hidden(m, i));
    if (!x)
      goto fail;
    PyList_SET_ITEM(hid, (Py_ssize_t)i, x);
  }
  if (hold && m) {
    PyObject *cap = PyCapsule_New(m, "mc_lookup_match", NULL);
    lease = cap ? PyLong_FromLongLong(++self->next_lease) : NULL;
    if (!lease || PyDict_SetItem(self->leases, lease, cap) < 0) {
      Py_XDECREF(cap);
      goto fail;
    }
    Py_DECREF(cap);
    m = NULL; /* owned by the lease now */
  } else {
    lease = Py_NewRef(Py_None);
  }
  mc_lookup_release(self->lb, m);
  PyStructSequence_SET_ITEM(res, 0, PyLong_FromLong(rc));
  PyStructSequence_SET_ITEM(res, 1, ext);
  PyStructSequence_SET_ITEM(res, 2, hid);
  PyStructSequence_SET_ITEM(res, 3, lease);
  if (!PyStructSequence_GET_ITEM(res, 0)) {
    Py_DECREF(res);
    return NULL;
  }
  return res;
fail:
  mc_lookup_release(self->lb, m);
  Py_XDECREF(ext);
  Py_XDECREF(hid);
  Py_XDECREF(res);
  Py_XDECREF(lease);
  return NULL;
}

static PyObject *Lookup_release(LookupObject *self, PyObject *lease) {
  PyObject *cap = PyDict_GetItemWithError(self->leases, lease);
  if (!cap) {
    if (PyErr_Occurred())
      return NULL;
    return PyErr_Format(PyExc_ValueError, "%R is not a lease held on this LookupBuffer", lease);
  }
  mc_lookup_match_t *m = PyCapsule_GetPointer(cap, "mc_lookup_match");
  if (PyDict_DelItem(self->leases, lease) < 0)
    return NULL;
  Py_BEGIN_ALLOW_THREADS
  mc_lookup_release(self->lb, m);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *Lookup_remove(LookupObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"tokens", "max", NULL};
  PyObject *to;
  Py_ssize_t max = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|n:remove", kwlist, &to, &max))
    return NULL;
  if (max < 0)
    return PyErr_Format(PyExc_ValueError, "max must be >= 0, not %zd", max);
  tokens_t t;
  if (tokens_get(to, &t) < 0)
    return NULL;
  mc_err_t err = {0};
  long rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_lookup_remove_n(self->lb, t.ptr, t.n, t.width, (size_t)max, &err);
  Py_END_ALLOW_THREADS
  tokens_put(&t);
  if (rc < 0)
    return mc_py_raise(ST(self), &err);
  return PyLong_FromLong(rc);
}

static PyObject *Lookup_expire(LookupObject *self, PyObject *unused) {
  (void)unused;
  size_t n;
  Py_BEGIN_ALLOW_THREADS
  n = mc_lookup_expire(self->lb);
  Py_END_ALLOW_THREADS
  return PyLong_FromSize_t(n);
}

static PyObject *Lookup_stats(LookupObject *self, PyObject *unused) {
  (void)unused;
  mc_lookup_stats_t s;
  Py_BEGIN_ALLOW_THREADS
  mc_lookup_get_stats(self->lb, &s);
  Py_END_ALLOW_THREADS
#define F(name) #name, (unsigned long long)s.name
  return Py_BuildValue(
      "{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", F(capacity_bytes), F(used_bytes),
      F(index_bytes),
      F(pinned_bytes), F(entries), F(blocks), F(pinned_blocks), F(inserts),
      F(insert_reused_blocks), F(lookups), F(hits), F(misses), F(matched_blocks), F(consumed),
      F(evicted), F(expired), F(removed), F(busy), F(collisions), F(probes));
#undef F
}

static PyObject *Lookup_wait_freed(LookupObject *self, PyObject *args) {
  double timeout_s;
  if (!PyArg_ParseTuple(args, "d:wait_freed", &timeout_s))
    return NULL;
  if (!(timeout_s >= 0.0) || timeout_s > 3600.0) {
    PyErr_SetString(PyExc_ValueError, "wait_freed: timeout_s must be between 0 and 3600");
    return NULL;
  }
  int any;
  Py_BEGIN_ALLOW_THREADS
  any = mc_lookup_wait_freed(self->lb, (int64_t)(timeout_s * 1000.0 + 0.5));
  Py_END_ALLOW_THREADS
  return PyBool_FromLong(any);
}

static PyObject *Lookup_take_freed(LookupObject *self, PyObject *unused) {
  (void)unused;
  PyObject *out = PyList_New(0);
  mc_lookup_extent_t buf[256];
  size_t n;
  while (out && (n = mc_lookup_take_freed(self->lb, buf, 256)) > 0) {
    for (size_t i = 0; i < n; i++) {
      PyObject *x = extent_tuple(&buf[i]);
      if (!x || PyList_Append(out, x) < 0) {
        Py_XDECREF(x);
        Py_CLEAR(out);
        break;
      }
      Py_DECREF(x);
    }
  }
  return out;
}

static PyObject *Lookup_get_block_size(LookupObject *self, void *c) {
  (void)c;
  return PyLong_FromUnsignedLong(mc_lookup_hasher(self->lb)->block_size);
}
static PyObject *Lookup_get_seed(LookupObject *self, void *c) {
  (void)c;
  return PyLong_FromUnsignedLongLong(mc_lookup_hasher(self->lb)->seed);
}
static PyObject *Lookup_get_mode(LookupObject *self, void *c) {
  (void)c;
  return PyUnicode_FromString(self->mode == MC_LOOKUP_CONSUME ? "consume" : "keep");
}

static PyMethodDef Lookup_methods[] = {
    {"insert", (PyCFunction)(void (*)(void))Lookup_insert, METH_VARARGS | METH_KEYWORDS,
     insert_doc},
    {"lookup", (PyCFunction)(void (*)(void))Lookup_lookup, METH_VARARGS | METH_KEYWORDS,
     lookup_doc},
    {"release", (PyCFunction)Lookup_release, METH_O,
     "release(lease): unpins the blocks of a lookup(..., hold=True)."},
    {"remove", (PyCFunction)(void (*)(void))Lookup_remove, METH_VARARGS | METH_KEYWORDS,
     "remove(tokens, max=0) -> int: drops the entries stored for exactly these full blocks\n"
     "(at most max of them; 0 = every one)."},
    {"expire", (PyCFunction)Lookup_expire, METH_NOARGS,
     "expire() -> int: drops entries older than ttl_s now (every call also does)."},
    {"stats", (PyCFunction)Lookup_stats, METH_NOARGS, "stats() -> dict of counters."},
    {"wait_freed", (PyCFunction)Lookup_wait_freed, METH_VARARGS,
     "wait_freed(timeout_s) -> bool: blocks (without the GIL) until take_freed() has "
     "extents to give or timeout_s passed; True if it has."},
    {"take_freed", (PyCFunction)Lookup_take_freed, METH_NOARGS,
     "take_freed() -> list of (addr, length, tag) of zero-copy extents no longer referenced "
     "(track_freed=True)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Lookup_getset[] = {
    {"block_size", (getter)Lookup_get_block_size, NULL, "tokens per block", NULL},
    {"seed", (getter)Lookup_get_seed, NULL, "hash seed", NULL},
    {"mode", (getter)Lookup_get_mode, NULL, "'keep' or 'consume'", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Lookup_doc,
"LookupBuffer(capacity_bytes, block_size=16, seed=0, mode='keep', policy='evict',\n"
"             ttl_s=0, extents_per_block=1, track_freed=False)\n\n"
"KV extents keyed by chained hashes of token blocks; longest block-aligned prefix\n"
"match, verified token by token. Thread-safe.");

static PyType_Slot Lookup_slots[] = {
    {Py_tp_new, Lookup_new},
    {Py_tp_dealloc, Lookup_dealloc},
    {Py_tp_traverse, Lookup_traverse},
    {Py_tp_clear, Lookup_clear},
    {Py_tp_methods, Lookup_methods},
    {Py_tp_getset, Lookup_getset},
    {Py_tp_doc, (void *)Lookup_doc},
    {0, NULL},
};

static PyType_Spec Lookup_spec = {
    .name = "mooncake_connector.LookupBuffer",
    .basicsize = sizeof(LookupObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = Lookup_slots,
};

/* ---- hash_token_blocks ---- */

static PyObject *py_hash_token_blocks(PyObject *module, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"tokens", "block_size", "seed", NULL};
  PyObject *to;
  unsigned int bs = MC_LOOKUP_DEFAULT_BLOCK;
  unsigned long long seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|IK:hash_token_blocks", kwlist, &to, &bs, &seed))
    return NULL;
  mc_py_state_t *st = mc_py_state_from_module(module);
  mc_err_t err = {0};
  mc_token_hasher_t h;
  if (mc_token_hasher_init(&h, bs, seed, &err) < 0)
    return mc_py_raise(st, &err);
  tokens_t t;
  if (tokens_get(to, &t) < 0)
    return NULL;
  size_t n = t.n / bs;
  mc_block_hash_t *out = PyMem_RawMalloc((n ? n : 1) * sizeof *out);
  if (!out) {
    tokens_put(&t);
    return PyErr_NoMemory();
  }
  long rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mc_token_hash_blocks(&h, t.ptr, t.n, t.width, out, n, NULL, &err);
  Py_END_ALLOW_THREADS
  tokens_put(&t);
  if (rc < 0) {
    PyMem_RawFree(out);
    return mc_py_raise(st, &err);
  }
  PyObject *list = PyList_New(rc);
  for (long i = 0; list && i < rc; i++) {
    unsigned char c[16];
    mc_block_hash_canonical(out[i], c);
    PyObject *b = PyBytes_FromStringAndSize((const char *)c, 16);
    if (!b) {
      Py_CLEAR(list);
      break;
    }
    PyList_SET_ITEM(list, i, b);
  }
  PyMem_RawFree(out);
  return list;
}

static PyMethodDef hash_def = {
    "hash_token_blocks", (PyCFunction)(void (*)(void))py_hash_token_blocks,
    METH_VARARGS | METH_KEYWORDS,
    "hash_token_blocks(tokens, block_size=16, seed=0) -> list[bytes]\n\n"
    "16-byte chained XXH3-128 hash of each full block (each covers its whole prefix)."};

static PyStructSequence_Field result_fields[] = {
    {"matched_tokens", "number of leading tokens matched (a multiple of block_size)"},
    {"extents", "(addr, length, tag) per matched block and extent"},
    {"hidden", "hidden-states (addr, length, tag) per matched block"},
    {"lease", "id for release() when hold=True, else None"},
    {NULL, NULL},
};

static PyStructSequence_Desc result_desc = {
    "mooncake_connector.LookupResult",
    "Result of LookupBuffer.lookup(); unpacks as (matched_tokens, extents).", result_fields, 2};

int mc_py_lookup_add(PyObject *module, mc_py_state_t *st) {
  PyTypeObject *rt = PyStructSequence_NewType(&result_desc);
  if (!rt)
    return -1;
  if (PyModule_AddObjectRef(module, "LookupResult", (PyObject *)rt) < 0) {
    Py_DECREF(rt);
    return -1;
  }
  Py_DECREF(rt);
  PyObject *tp = PyType_FromModuleAndSpec(module, &Lookup_spec, NULL);
  if (!tp)
    return -1;
  st->LookupType = (PyTypeObject *)tp; /* the state keeps this reference */
  if (PyModule_AddObjectRef(module, "LookupBuffer", tp) < 0)
    return -1;
  PyObject *fn = PyCFunction_NewEx(&hash_def, module, NULL);
  if (!fn)
    return -1;
  int rc = PyModule_AddObjectRef(module, "hash_token_blocks", fn);
  Py_DECREF(fn);
  return rc;
}
