/* The push flow's extent arrays, each built in one pass in C instead of a
 * Python loop over blocks x extents:
 *
 * _core.gate_arrays: the producer's per-layer write arrays of one target
 * (push.py PushProducer._gate_arrays), built when the decode's target
 * arrives (often inside the prefill's forward, on vLLM's forward thread):
 * for each layer (src, dst, len) array('Q')s and its bytes, block-major
 * then extent, null extents (len 0, HMA) left out, the first extent too
 * long for this side's found first (block, then layer).
 *
 * _core.target_extents: the consumer's target body (push.py
 * PushConsumer.start, in the decode's start_load_kv): per block, layer and
 * outer slice (addr, len, src_off), the bytes layout.mapped_extents gives
 * (a null block of an HMA group: (addr, 0, 0)).
 *
 * The Python loops stay as the references (tests/test_push_gate_arrays.py). */
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "py/py_common.h"

/* One layer tuple of either call: gate_arrays's (k0, nk, base, group,
 * stride, bbytes, outer) or target_extents's (base, group, stride, outer,
 * dst_off, len, src_off). */
typedef struct {
  uint64_t k0, nk, base, group, stride, bbytes, dst_off, len, src_off;
  Py_buffer outer; /* obj NULL until taken */
} layer_t;

/* A zeroed layer per item of the layers tuple; NULL raised. */
static layer_t *layers_new(Py_ssize_t nl) {
  layer_t *L = PyMem_RawCalloc((size_t)(nl ? nl : 1), sizeof *L);
  if (!L)
    PyErr_NoMemory();
  return L;
}

/* Releases every outer view taken (however far parsing got) and L. */
static void layers_free(layer_t *L, Py_ssize_t nl) {
  for (Py_ssize_t i = 0; i < nl; i++)
    PyBuffer_Release(&L[i].outer); /* nothing when obj is NULL */
  PyMem_RawFree(L);
}

/* An 8-byte unsigned buffer (array('Q') and the like); 0, or -1 raised. */
static int u64_view(PyObject *o, Py_buffer *v, const char *what) {
  if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
    return -1;
  const char *f = v->format ? v->format : "B";
  if (*f == '@' || *f == '=' || *f == '<')
    f++;
  if (v->itemsize != 8 || !f[0] || f[1] || !strchr("QL", f[0])) {
    PyBuffer_Release(v);
    PyErr_Format(PyExc_TypeError, "%s must be an array('Q')", what);
    return -1;
  }
  return 0;
}

static uint64_t at(const Py_buffer *v, Py_ssize_t i) {
  uint64_t x;
  memcpy(&x, (const char *)v->buf + 8 * i, 8);
  return x;
}

/* Every block id in ids below nblocks; 0, or -1 raised (ValueError). */
static int check_ids(const Py_buffer *ids, unsigned long long nblocks) {
  for (Py_ssize_t i = 0; i < ids->len / 8; i++)
    if (at(ids, i) >= nblocks) {
      PyErr_Format(PyExc_ValueError, "block id %llu is outside 0..%llu",
                   (unsigned long long)at(ids, i), nblocks - 1);
      return -1;
    }
  return 0;
}

/* A layer tuple o parsed by fmt (PyArg_ParseTuple's, the targets after
 * it); TypeError `usage` when o is not a tuple, or one PyArg_ParseTuple
 * refused without an exception of its own.  0, or -1 raised. */
static int parse_layer(PyObject *o, const char *usage, const char *fmt, ...) {
  int ok = 0;
  if (PyTuple_Check(o)) {
    va_list ap;
    va_start(ap, fmt);
    ok = PyArg_VaParse(o, fmt, ap);
    va_end(ap);
  }
  if (!ok && !PyErr_Occurred())
    PyErr_SetString(PyExc_TypeError, usage);
  return ok ? 0 : -1;
}

static int parse_layers(PyObject *layers, layer_t *L, Py_ssize_t nl, uint64_t epb,
                        uint64_t ng) {
  for (Py_ssize_t i = 0; i < nl; i++) {
    PyObject *o = PyTuple_GET_ITEM(layers, i), *outer;
    layer_t *l = &L[i];
    if (parse_layer(o, "gate_arrays: each layer must be a tuple (k0, nk, base, group, "
                       "block_stride, block_bytes, outer)",
                    "KKKKKKO:gate_arrays layer", &l->k0, &l->nk, &l->base, &l->group,
                    &l->stride, &l->bbytes, &outer) < 0)
      return -1;
    if (u64_view(outer, &l->outer, "gate_arrays: a layer's outer offsets") < 0)
      return -1;
    if ((uint64_t)(l->outer.len / 8) != l->nk || l->k0 + l->nk > epb || l->group >= ng) {
      PyBuffer_Release(&l->outer);
      l->outer.obj = NULL;
      PyErr_Format(PyExc_ValueError, "gate_arrays: layer %zd's extents %llu..+%llu / group "
                   "%llu do not fit %llu extents per block, %llu groups", i,
                   (unsigned long long)l->k0, (unsigned long long)l->nk,
                   (unsigned long long)l->group, (unsigned long long)epb,
                   (unsigned long long)ng);
      return -1;
    }
  }
  return 0;
}

/* The first extent (block-major, then layer) asking more bytes than this
 * side's extent holds: (k, b, n, off, s_len) as push._extent_too_long
 * takes them, Py_None when none, NULL raised. */
static PyObject *first_too_long(const Py_buffer *dest, const layer_t *L, Py_ssize_t nl,
                                uint64_t nb, uint64_t epb) {
  for (uint64_t b = 0; b < nb; b++)
    for (Py_ssize_t li = 0; li < nl; li++)
      for (uint64_t k = L[li].k0; k < L[li].k0 + L[li].nk; k++) {
        Py_ssize_t i = (Py_ssize_t)((b * epb + k) * 3);
        uint64_t n = at(dest, i + 1), off = at(dest, i + 2), s = L[li].bbytes;
        if (n && (off > s || n > s - off))
          return Py_BuildValue("(KKKKK)", (unsigned long long)k, (unsigned long long)b,
                               (unsigned long long)n, (unsigned long long)off,
                               (unsigned long long)s);
      }
  Py_RETURN_NONE;
}

static PyObject *g_array_type; /* array.array, looked up once */

static PyObject *u64_array(const uint64_t *p, size_t n) {
  if (!g_array_type) {
    PyObject *m = PyImport_ImportModule("array");
    g_array_type = m ? PyObject_GetAttrString(m, "array") : NULL;
    Py_XDECREF(m);
    if (!g_array_type)
      return NULL;
  }
  return PyObject_CallFunction(g_array_type, "sy#", "Q", (const char *)p,
                               (Py_ssize_t)(n * 8));
}

/* One layer's (src, dst, len) arrays and its bytes into per / gbytes. */
static int build_layer(const Py_buffer *ids, const Py_buffer *dest, const layer_t *l,
                       uint64_t nb, uint64_t epb, uint64_t ng, PyObject *per,
                       PyObject *gbytes) {
  size_t cap = (size_t)(nb * l->nk), n = 0;
  uint64_t *buf = PyMem_RawMalloc(3 * (cap ? cap : 1) * sizeof *buf), total = 0;
  if (!buf) {
    PyErr_NoMemory();
    return -1;
  }
  uint64_t *src = buf, *dst = buf + cap, *len = buf + 2 * cap;
  for (uint64_t b = 0; b < nb; b++) {
    uint64_t base = l->base + at(ids, (Py_ssize_t)(b * ng + l->group)) * l->stride;
    for (uint64_t k = 0; k < l->nk; k++) {
      Py_ssize_t i = (Py_ssize_t)((b * epb + l->k0 + k) * 3);
      uint64_t d = at(dest, i), c = at(dest, i + 1), off = at(dest, i + 2);
      if (!c)
        continue; /* HMA: a null block on the consumer */
      src[n] = base + at(&l->outer, (Py_ssize_t)k) + off;
      dst[n] = d;
      len[n] = c;
      total += c;
      n++;
    }
  }
  PyObject *a = u64_array(src, n), *b = a ? u64_array(dst, n) : NULL,
           *c = b ? u64_array(len, n) : NULL, *t = c ? PyTuple_Pack(3, a, b, c) : NULL,
           *g = t ? PyLong_FromUnsignedLongLong(total) : NULL;
  int rc = (g && PyList_Append(per, t) == 0 && PyList_Append(gbytes, g) == 0) ? 0 : -1;
  Py_XDECREF(a);
  Py_XDECREF(b);
  Py_XDECREF(c);
  Py_XDECREF(t);
  Py_XDECREF(g);
  PyMem_RawFree(buf);
  return rc;
}

static PyObject *gate_arrays(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *ids_o, *dest_o, *layers, *res = NULL, *per = NULL, *gbytes = NULL;
  unsigned long long epb, ng, nblocks;
  if (!PyArg_ParseTuple(args, "OOKKO!K:gate_arrays", &ids_o, &dest_o, &epb, &ng,
                        &PyTuple_Type, &layers, &nblocks))
    return NULL;
  if (!epb || !ng) {
    PyErr_SetString(PyExc_ValueError, "gate_arrays: extents per block and groups must be >= 1");
    return NULL;
  }
  Py_buffer ids = {0}, dest = {0};
  Py_ssize_t nl = PyTuple_GET_SIZE(layers);
  layer_t *L = layers_new(nl);
  if (!L)
    return NULL;
  if (u64_view(ids_o, &ids, "gate_arrays: ids") < 0)
    goto out;
  if (u64_view(dest_o, &dest, "gate_arrays: dest") < 0)
    goto out;
  uint64_t nb = (uint64_t)(dest.len / 8) / (epb * 3);
  if (nb * epb * 3 != (uint64_t)(dest.len / 8) || (uint64_t)(ids.len / 8) != nb * ng) {
    PyErr_Format(PyExc_ValueError, "gate_arrays: %zd destination words are not blocks x %llu "
                 "extents x 3, or %zd ids not those blocks x %llu groups", dest.len / 8, epb,
                 ids.len / 8, ng);
    goto out;
  }
  if (check_ids(&ids, nblocks) < 0)
    goto out;
  if (parse_layers(layers, L, nl, epb, ng) < 0)
    goto out;
  PyObject *bad = first_too_long(&dest, L, nl, nb, epb);
  if (!bad || bad != Py_None) {
    res = bad ? Py_BuildValue("(ON)", Py_None, bad) : NULL;
    goto out;
  }
  Py_DECREF(bad);
  if (!(per = PyList_New(0)) || !(gbytes = PyList_New(0)))
    goto out;
  for (Py_ssize_t li = 0; li < nl; li++)
    if (build_layer(&ids, &dest, &L[li], nb, epb, ng, per, gbytes) < 0)
      goto out;
  res = PyTuple_Pack(2, per, gbytes);
out:
  layers_free(L, nl);
  if (ids.obj)
    PyBuffer_Release(&ids);
  if (dest.obj)
    PyBuffer_Release(&dest);
  Py_XDECREF(per);
  Py_XDECREF(gbytes);
  return res;
}

/* ---- the consumer's target extents ---- */

static int parse_te_layers(PyObject *layers, layer_t *L, Py_ssize_t nl, uint64_t ng) {
  for (Py_ssize_t i = 0; i < nl; i++) {
    PyObject *o = PyTuple_GET_ITEM(layers, i), *outer;
    layer_t *l = &L[i];
    if (parse_layer(o, "target_extents: each layer must be a tuple (base, group, "
                       "block_stride, outer, dst_off, len, src_off)",
                    "KKKOKKK:target_extents layer", &l->base, &l->group, &l->stride, &outer,
                    &l->dst_off, &l->len, &l->src_off) < 0)
      return -1;
    if (u64_view(outer, &l->outer, "target_extents: a layer's outer offsets") < 0)
      return -1;
    if (l->group >= ng) {
      PyErr_Format(PyExc_ValueError, "target_extents: layer %zd's group %llu does not fit "
                   "%llu groups", i, (unsigned long long)l->group, (unsigned long long)ng);
      return -1;
    }
  }
  return 0;
}

static PyObject *target_extents(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *ids_o, *layers, *res = NULL;
  unsigned long long ng, nblocks;
  if (!PyArg_ParseTuple(args, "OKKO!:target_extents", &ids_o, &ng, &nblocks, &PyTuple_Type,
                        &layers))
    return NULL;
  if (!ng) {
    PyErr_SetString(PyExc_ValueError, "target_extents: groups must be >= 1");
    return NULL;
  }
  Py_buffer ids = {0};
  Py_ssize_t nl = PyTuple_GET_SIZE(layers);
  layer_t *L = layers_new(nl);
  if (!L)
    return NULL;
  if (u64_view(ids_o, &ids, "target_extents: ids") < 0)
    goto out;
  uint64_t nid = (uint64_t)(ids.len / 8), nb = nid / ng, per_block = 0;
  if (nb * ng != nid) {
    PyErr_Format(PyExc_ValueError, "target_extents: %llu ids are not blocks x %llu groups",
                 (unsigned long long)nid, ng);
    goto out;
  }
  if (check_ids(&ids, nblocks) < 0)
    goto out;
  if (parse_te_layers(layers, L, nl, ng) < 0)
    goto out;
  for (Py_ssize_t li = 0; li < nl; li++)
    per_block += (uint64_t)(L[li].outer.len / 8);
  if (per_block && nb > (uint64_t)PY_SSIZE_T_MAX / 24 / per_block) {
    PyErr_NoMemory();
    goto out;
  }
  res = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(nb * per_block * 24));
  if (!res)
    goto out;
  uint64_t *w = (uint64_t *)(void *)PyBytes_AS_STRING(res);
  for (uint64_t b = 0; b < nb; b++)
    for (Py_ssize_t li = 0; li < nl; li++) {
      const layer_t *l = &L[li];
      uint64_t id = at(&ids, (Py_ssize_t)(b * ng + l->group));
      uint64_t off = l->base + id * l->stride;
      int null = ng > 1 && id == 0; /* HMA: a group's null block is not moved */
      for (Py_ssize_t k = 0; k < l->outer.len / 8; k++) {
        uint64_t a = off + at(&l->outer, k), e[3];
        e[0] = null ? a : a + l->dst_off;
        e[1] = null ? 0 : l->len;
        e[2] = null ? 0 : l->src_off;
        memcpy(w, e, sizeof e);
        w += 3;
      }
    }
out:
  layers_free(L, nl);
  if (ids.obj)
    PyBuffer_Release(&ids);
  return res;
}

static PyMethodDef gate_arrays_functions[] = {
    {"gate_arrays", gate_arrays, METH_VARARGS,
     "gate_arrays(ids, dest, extents_per_block, groups, layers, num_blocks)\n"
     "    -> (per, gbytes) | (None, (k, b, n, off, s_len))\n\n"
     "The push producer's per-layer write arrays of one target: ids (array('Q'),\n"
     "blocks x groups: this side's block ids of the target's blocks), dest (the\n"
     "target's array('Q') of blocks x extents x (addr, len, src_off)), layers (a\n"
     "tuple per layer: (first extent, extents, base, group, block_stride,\n"
     "block_bytes, array('Q') of outer offsets)).  per: per layer (src, dst, len)\n"
     "array('Q')s, block-major then extent, null extents left out; gbytes: each\n"
     "layer's bytes.  The first extent too long for this side's (block, then\n"
     "layer): (None, its numbers).  ValueError: a block id >= num_blocks."},
    {"target_extents", target_extents, METH_VARARGS,
     "target_extents(ids, groups, num_blocks, layers) -> bytes\n\n"
     "The push consumer's target body: ids (array('Q'), blocks x groups: this\n"
     "side's block rows), layers (a tuple per layer: (base, group, block_stride,\n"
     "array('Q') of outer offsets, dst_off, len, src_off): its tp_map piece).  Per\n"
     "block, then layer, then outer slice, three native u64 (addr + dst_off, len,\n"
     "src_off); a group's null block (id 0, groups > 1): (addr, 0, 0).\n"
     "ValueError: a block id >= num_blocks."},
    {NULL, NULL, 0, NULL},
};

int mc_py_gate_arrays_add(PyObject *module, mc_py_state_t *st) {
  (void)st;
  return PyModule_AddFunctions(module, gate_arrays_functions);
}
