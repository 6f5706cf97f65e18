// The eager fast caller of npukern:: op overloads (fast_call.cpp).
#pragma once

#include <Python.h>

namespace npk_torch {

// _C.fast_op(overload, name, overload_name, parameter_type) -> builtin or None.
PyObject *fast_op(PyObject *self, PyObject *args);

// The norm modules' eager forwards (METH_FASTCALL): the op's outputs the
// module returns, or NotImplemented where the module's general path differs.
PyObject *rms_norm_module(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *add_rms_norm_module(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

}  // namespace npk_torch
