// The eager fast caller of npukern:: op overloads (fast_call.cpp).
#pragma once

#include <Python.h>

namespace npk_torch {

// _C.fast_op(overload, name, overload_name, parameter_type) -> builtin or None.
PyObject *fast_op(PyObject *self, PyObject *args);

}  // namespace npk_torch
