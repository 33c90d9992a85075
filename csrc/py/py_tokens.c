/* Token ids and (addr, length[, tag]) extents from Python objects, shared by
 * the lookup-buffer and send_kv/recv_kv bindings.  Token ids come from any
 * C-contiguous buffer of 4- or 8-byte integers (array.array, numpy, a
 * memoryview of a CPU tensor) or a sequence of ints; torch is never
 * imported. */
#include <stdint.h>
#include <string.h>

#include "py/py_common.h"


static int int_format(const char *f, Py_ssize_t itemsize) {
  if (!f)
    return 0; /* unsigned bytes */
  if (*f == '@' || *f == '=' || *f == '<')
    f++;
  if (f[0] == 0 || f[1] != 0)
    return 0;
  return strchr("iIlLqQnN", f[0]) != NULL && (itemsize == 4 || itemsize == 8);
}

/* A torch tensor (or anything with the same duck type) on the CPU: read it
 * in place through data_ptr() without importing torch. 1 = handled, 0 = not
 * a tensor, -1 = error set. */
static int tensor_get(PyObject *o, mc_py_tokens_t *t) {
  if (!PyObject_HasAttrString(o, "data_ptr") || !PyObject_HasAttrString(o, "element_size") ||
      !PyObject_HasAttrString(o, "is_contiguous") || !PyObject_HasAttrString(o, "dtype"))
    return 0;
  int rc = -1;
  PyObject *dev = NULL, *devtype = NULL, *dtype = NULL, *contig = NULL, *es = NULL, *n = NULL,
           *ptr = NULL;
  dev = PyObject_GetAttrString(o, "device");
  devtype = dev ? PyObject_GetAttrString(dev, "type") : NULL;
  if (!devtype || !PyUnicode_Check(devtype))
    goto done;
  if (PyUnicode_CompareWithASCIIString(devtype, "cpu") != 0) {
    /* Token ids on a GPU (a few KiB): read them through a host copy. */
    PyObject *cpu = PyObject_CallMethod(o, "cpu", NULL);
    if (cpu) {
      PyObject *devc = PyObject_GetAttrString(cpu, "device");
      PyObject *tc = devc ? PyObject_GetAttrString(devc, "type") : NULL;
      int is_cpu = tc && PyUnicode_Check(tc) && !PyUnicode_CompareWithASCIIString(tc, "cpu");
      Py_XDECREF(devc);
      Py_XDECREF(tc);
      if (is_cpu)
        rc = tensor_get(cpu, t);
      else if (!PyErr_Occurred())
        PyErr_Format(PyExc_TypeError, "tokens are on device %U; pass them on the CPU "
                     "(tokens.cpu())", devtype);
      Py_DECREF(cpu);
    }
    goto done;
  }
  es = PyObject_GetAttrString(o, "dtype"); /* reused below for its str() */
  dtype = es ? PyObject_Str(es) : NULL;
  if (!dtype)
    goto done;
  int w = PyUnicode_CompareWithASCIIString(dtype, "torch.int32") == 0   ? 4
          : PyUnicode_CompareWithASCIIString(dtype, "torch.int64") == 0 ? 8
                                                                        : 0;
  if (!w) {
    PyErr_Format(PyExc_TypeError, "tokens must be torch.int32 or torch.int64, not %U", dtype);
    goto done;
  }
  contig = PyObject_CallMethod(o, "is_contiguous", NULL);
  if (!contig)
    goto done;
  if (!PyObject_IsTrue(contig)) {
    PyErr_SetString(PyExc_TypeError, "tokens tensor must be contiguous (tokens.contiguous())");
    goto done;
  }
  n = PyObject_CallMethod(o, "numel", NULL);
  ptr = PyObject_CallMethod(o, "data_ptr", NULL);
  if (!n || !ptr)
    goto done;
  t->ptr = (const void *)(uintptr_t)PyLong_AsUnsignedLongLong(ptr);
  t->n = (size_t)PyLong_AsSsize_t(n);
  if (PyErr_Occurred())
    goto done;
  t->width = w;
  t->hold = Py_NewRef(o);
  rc = 1;
done:
  Py_XDECREF(dev);
  Py_XDECREF(devtype);
  Py_XDECREF(dtype);
  Py_XDECREF(contig);
  Py_XDECREF(es);
  Py_XDECREF(n);
  Py_XDECREF(ptr);
  return rc;
}

int mc_py_tokens_get(PyObject *o, mc_py_tokens_t *t) {
  memset(t, 0, sizeof *t);
  if (!PyObject_CheckBuffer(o)) {
    int r = tensor_get(o, t);
    if (r != 0)
      return r < 0 ? -1 : 0;
  }
  if (PyObject_CheckBuffer(o) && !PyBytes_Check(o) && !PyByteArray_Check(o)) {
    if (PyObject_GetBuffer(o, &t->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
      return -1;
    t->has_view = 1;
    if (!int_format(t->view.format, t->view.itemsize)) {
      PyErr_Format(PyExc_TypeError,
                   "tokens must hold 4- or 8-byte integers (format 'i', 'l' or 'q'), not "
                   "format '%s' of %zd-byte items",
                   t->view.format ? t->view.format : "B", t->view.itemsize);
      PyBuffer_Release(&t->view);
      t->has_view = 0;
      return -1;
    }
    t->ptr = t->view.buf;
    t->width = (int)t->view.itemsize;
    t->n = (size_t)(t->view.len / t->view.itemsize);
    return 0;
  }
  PyObject *fast = PySequence_Fast(o, "tokens must be a buffer of int32/int64 or a list of ints");
  if (!fast)
    return -1;
  Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
  t->owned = PyMem_RawMalloc((size_t)(k ? k : 1) * sizeof(int64_t));
  if (!t->owned) {
    Py_DECREF(fast);
    PyErr_NoMemory();
    return -1;
  }
  PyObject **items = PySequence_Fast_ITEMS(fast);
  for (Py_ssize_t i = 0; i < k; i++) {
    long long v = PyLong_AsLongLong(items[i]);
    if (v == -1 && PyErr_Occurred()) {
      PyMem_RawFree(t->owned);
      t->owned = NULL;
      Py_DECREF(fast);
      PyErr_Format(PyExc_TypeError, "tokens[%zd] must be an int", i);
      return -1;
    }
    t->owned[i] = v;
  }
  Py_DECREF(fast);
  t->ptr = t->owned;
  t->n = (size_t)k;
  t->width = 8;
  return 0;
}

void mc_py_tokens_put(mc_py_tokens_t *t) {
  Py_CLEAR(t->hold);
  if (t->has_view)
    PyBuffer_Release(&t->view);
  PyMem_RawFree(t->owned);
  memset(t, 0, sizeof *t);
}

/* A contiguous tensor (CPU or CUDA: anything with data_ptr(), numel(),
 * element_size()) as one extent: its bytes, tag 0.  1 = handled, 0 = not a
 * tensor, -1 = error set. */
static int tensor_extent(PyObject *o, mc_lookup_extent_t *x, const char *what, Py_ssize_t i) {
  if (PyTuple_Check(o) || !PyObject_HasAttrString(o, "data_ptr") ||
      !PyObject_HasAttrString(o, "element_size") || !PyObject_HasAttrString(o, "numel"))
    return 0;
  PyObject *contig = PyObject_HasAttrString(o, "is_contiguous")
                         ? PyObject_CallMethod(o, "is_contiguous", NULL)
                         : Py_NewRef(Py_True);
  PyObject *ptr = contig ? PyObject_CallMethod(o, "data_ptr", NULL) : NULL;
  PyObject *n = ptr ? PyObject_CallMethod(o, "numel", NULL) : NULL;
  PyObject *es = n ? PyObject_CallMethod(o, "element_size", NULL) : NULL;
  int rc = -1;
  if (es) {
    if (!PyObject_IsTrue(contig)) {
      PyErr_Format(PyExc_TypeError, "%s[%zd]: the tensor must be contiguous (.contiguous()) "
                   "or given as (addr, length) tuples", what, i);
    } else {
      unsigned long long a = PyLong_AsUnsignedLongLong(ptr);
      long long k = PyLong_AsLongLong(n), w = PyLong_AsLongLong(es);
      if (!PyErr_Occurred()) {
        *x = (mc_lookup_extent_t){.addr = a, .len = (uint64_t)(k * w), .tag = 0};
        rc = 1;
      }
    }
  }
  Py_XDECREF(contig);
  Py_XDECREF(ptr);
  Py_XDECREF(n);
  Py_XDECREF(es);
  return rc;
}

/* (addr, length[, tag]) or a tensor -> extent */
int mc_py_get_extent(PyObject *o, mc_lookup_extent_t *x, const char *what, Py_ssize_t i) {
  int tr = tensor_extent(o, x, what, i);
  if (tr != 0)
    return tr < 0 ? -1 : 0;
  unsigned long long a, l, g = 0;
  if (!PyTuple_Check(o) || !PyArg_ParseTuple(o, "KK|K", &a, &l, &g)) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError,
                 "%s[%zd] must be a tuple (addr, length[, tag]) of ints or a contiguous tensor",
                 what, i);
    return -1;
  }
  /* "K" takes -1 as 2**64-1 and wraps 2**64: a negative length would read
   * as a huge one.  Each field must be a 64-bit unsigned int as it is. */
  static const char *const field[] = {"addr", "length", "tag"};
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(o) && k < 3; k++) {
    PyObject *v = PyTuple_GET_ITEM(o, k);
    if (PyLong_Check(v) && PyLong_AsUnsignedLongLong(v) == (unsigned long long)-1 &&
        PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError, "%s[%zd]: %s %R is out of range; it must be 0..2**64-1",
                   what, i, field[k], v);
      return -1;
    }
  }
  *x = (mc_lookup_extent_t){.addr = a, .len = l, .tag = g};
  return 0;
}

