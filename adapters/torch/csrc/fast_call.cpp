// An eager caller for one npukern:: op overload that skips the torch.ops door
// (the JIT argument parser matching Python objects against the schema and
// pybind's conversions), measured at 2.4-4 us of a 1x4096 RmsNorm call
// (docs/performance.md, "Per-call cost"). It still calls the op through the
// dispatcher, boxed, as torch.ops does: autograd, inference mode, tracing,
// functorch and Python dispatch modes (FakeTensorMode, make_fx) see the same
// call. Anything it does not recognise goes to the overload itself, with the
// same arguments: keyword arguments, tensor subclasses (and any other
// object; nn.Parameter, whose __torch_function__ is disabled, is taken),
// __torch_function__ modes, argument types other than exact
// bool / int / float / None. So errors and overrides are torch.ops' own.
// Under torch.compile the Python side calls the overload instead
// (npukern_torch/_fast.py): Dynamo cannot trace a C function.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <optional>
#include <string>
#include <vector>

namespace {

enum class Kind { Tensor, OptionalTensor, Float, Int, Bool };

// The overloads called unboxed when every argument is given, exactly typed:
// the decode-sized norms, where the boxed call's stack and conversions are
// 0.1-0.2 us of a 1x4096 call.
enum class Unboxed { None, RmsNorm, AddRmsNorm };

// One overload's state, owned by the capsule the bound builtin holds.
struct FastOp {
  c10::OperatorHandle op;
  std::vector<Kind> kinds;
  std::vector<std::optional<c10::IValue>> defaults;  // per argument; nullopt where required
  size_t returns = 0;
  PyObject *fallback = nullptr;  // the torch.ops overload (a new reference)
  Unboxed unboxed = Unboxed::None;
};

PyObject *g_parameter_type = nullptr;  // torch.nn.Parameter

bool plain_tensor(PyObject *o) {
  return THPVariable_CheckExact(o) || reinterpret_cast<PyObject *>(Py_TYPE(o)) == g_parameter_type;
}

// An exact Python int that fits int64 (false, and no Python error, otherwise).
bool exact_int(PyObject *o, int64_t *out) {
  if (!PyLong_CheckExact(o)) return false;  // bool is a subclass: not taken
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  *out = static_cast<int64_t>(v);
  return true;
}

// An exact Python float, or an exact int that fits int64 (the schema's float
// takes an int); false, and no Python error, otherwise.
bool exact_double(PyObject *o, double *out) {
  if (PyFloat_CheckExact(o)) {
    *out = PyFloat_AS_DOUBLE(o);
    return true;
  }
  int64_t v = 0;
  if (!exact_int(o, &v)) return false;
  *out = static_cast<double>(v);
  return true;
}

// Pushes `o` as an argument of `kind`; false when the fast path does not take it.
bool push(torch::jit::Stack &stack, Kind kind, PyObject *o) {
  switch (kind) {
    case Kind::OptionalTensor:
      if (o == Py_None) {
        stack.emplace_back();
        return true;
      }
      [[fallthrough]];
    case Kind::Tensor:
      if (!plain_tensor(o)) return false;
      stack.emplace_back(THPVariable_Unpack(o));
      return true;
    case Kind::Float: {
      double v = 0;
      if (!exact_double(o, &v)) return false;
      stack.emplace_back(v);
      return true;
    }
    case Kind::Int: {
      int64_t v = 0;
      if (!exact_int(o, &v)) return false;
      stack.emplace_back(v);
      return true;
    }
    case Kind::Bool:
      if (!PyBool_Check(o)) return false;
      stack.emplace_back(o == Py_True);
      return true;
  }
  return false;
}

// (eps, offset, cast_before_gamma) from exact Python values; false otherwise.
bool norm_scalars(PyObject *const *args, double *eps, double *offset, bool *cast_before_gamma) {
  if (!exact_double(args[0], eps) || !exact_double(args[1], offset) || !PyBool_Check(args[2])) return false;
  *cast_before_gamma = args[2] == Py_True;
  return true;
}

using T2 = std::tuple<at::Tensor, at::Tensor>;
using T3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

const c10::TypedOperatorHandle<T2(const at::Tensor &, const at::Tensor &, double, double, bool)> &rms_norm_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("npukern::rms_norm", "")
                                 .typed<T2(const at::Tensor &, const at::Tensor &, double, double, bool)>();
  return handle;
}

const c10::TypedOperatorHandle<T3(const at::Tensor &, const at::Tensor &, const at::Tensor &, double, double, bool)>
    &add_rms_norm_op() {
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("npukern::add_rms_norm", "")
          .typed<T3(const at::Tensor &, const at::Tensor &, const at::Tensor &, double, double, bool)>();
  return handle;
}

// The norms called unboxed through the dispatcher, the GIL released.
T2 rms_norm_nogil(PyObject *const *args, double eps, double offset, bool cbg) {
  pybind11::gil_scoped_release no_gil;
  return rms_norm_op().call(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), eps, offset, cbg);
}

T3 add_rms_norm_nogil(PyObject *const *args, double eps, double offset, bool cbg) {
  pybind11::gil_scoped_release no_gil;
  return add_rms_norm_op().call(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]),
                                THPVariable_Unpack(args[2]), eps, offset, cbg);
}

// A tuple of the tensors, wrapped (nullptr with a Python error on failure).
template <size_t N>
PyObject *wrap_all(std::array<at::Tensor, N> &&ts) {
  PyObject *out = PyTuple_New(static_cast<Py_ssize_t>(N));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < N; ++i) {
    PyObject *t = THPVariable_Wrap(std::move(ts[i]));
    if (t == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), t);
  }
  return out;
}

const char *kCapsule = "npukern_torch.FastOp";

PyObject *call(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
  HANDLE_TH_ERRORS
  auto *fast = static_cast<FastOp *>(PyCapsule_GetPointer(self, kCapsule));
  if (fast == nullptr) return nullptr;
  const size_t nargs = static_cast<size_t>(PyVectorcall_NARGS(nargsf));
  bool taken = kwnames == nullptr && nargs <= fast->kinds.size() && !at::impl::torch_function_mode_enabled();
  if (taken && fast->unboxed != Unboxed::None) {
    double eps = 0, offset = 0;
    bool cbg = false;
    if (fast->unboxed == Unboxed::RmsNorm && nargs == 5 && plain_tensor(args[0]) && plain_tensor(args[1]) &&
        norm_scalars(args + 2, &eps, &offset, &cbg)) {
      T2 out = rms_norm_nogil(args, eps, offset, cbg);
      return wrap_all<2>({std::move(std::get<0>(out)), std::move(std::get<1>(out))});
    }
    if (fast->unboxed == Unboxed::AddRmsNorm && nargs == 6 && plain_tensor(args[0]) && plain_tensor(args[1]) &&
        plain_tensor(args[2]) && norm_scalars(args + 3, &eps, &offset, &cbg)) {
      T3 out = add_rms_norm_nogil(args, eps, offset, cbg);
      return wrap_all<3>({std::move(std::get<0>(out)), std::move(std::get<1>(out)), std::move(std::get<2>(out))});
    }
  }
  torch::jit::Stack stack;
  if (taken) {
    stack.reserve(fast->kinds.size());
    for (size_t i = 0; taken && i < fast->kinds.size(); ++i) {
      if (i < nargs) {
        taken = push(stack, fast->kinds[i], args[i]);
      } else if (fast->defaults[i]) {
        stack.push_back(*fast->defaults[i]);
      } else {
        taken = false;
      }
    }
  }
  if (!taken) return PyObject_Vectorcall(fast->fallback, args, nargsf, kwnames);
  {
    pybind11::gil_scoped_release no_gil;
    fast->op.callBoxed(stack);
  }
  if (stack.size() != fast->returns) {
    PyErr_SetString(PyExc_RuntimeError, "npukern_torch: an op returned an unexpected number of values");
    return nullptr;
  }
  if (fast->returns == 1) return THPVariable_Wrap(std::move(stack[0]).toTensor());
  PyObject *out = PyTuple_New(static_cast<Py_ssize_t>(fast->returns));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < fast->returns; ++i) {
    PyObject *t = THPVariable_Wrap(std::move(stack[i]).toTensor());
    if (t == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), t);
  }
  return out;
  END_HANDLE_TH_ERRORS
}

PyMethodDef call_def = {"npukern_fast_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(call)),
                        METH_FASTCALL | METH_KEYWORDS, "An npukern:: op overload called from eager Python."};

void destroy(PyObject *capsule) {
  auto *fast = static_cast<FastOp *>(PyCapsule_GetPointer(capsule, kCapsule));
  if (fast != nullptr) {
    Py_XDECREF(fast->fallback);
    delete fast;
  }
}

std::optional<Kind> kind_of(const c10::Argument &a) {
  using c10::TypeKind;
  const auto &t = *a.type();
  switch (t.kind()) {
    case TypeKind::TensorType:
      return Kind::Tensor;
    case TypeKind::FloatType:
      return Kind::Float;
    case TypeKind::IntType:
    case TypeKind::SymIntType:
      return Kind::Int;
    case TypeKind::BoolType:
      return Kind::Bool;
    case TypeKind::OptionalType:
      if (t.expectRef<c10::OptionalType>().getElementType()->kind() == TypeKind::TensorType) {
        return Kind::OptionalTensor;
      }
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

bool kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// The tensor arguments of a norm module's forward that its general path
// (modules.py) would hand to the op unchanged: plain CPU tensors of the
// kernels' dtypes, gamma in x's dtype or (unless cast_before_gamma, where
// float32 promotes y past x's dtype) float32. `xs` are x and, for
// AddRMSNorm, the residual (same dtype and shape as x).
bool module_takes(std::initializer_list<PyObject *> xs, PyObject *gamma_obj, bool cast_before_gamma) {
  const at::Tensor *x0 = nullptr;
  for (PyObject *o : xs) {
    if (!plain_tensor(o)) return false;
    const at::Tensor &x = THPVariable_Unpack(o);
    if (!kernel_dtype(x.scalar_type()) || !x.device().is_cpu()) return false;
    if (x0 == nullptr) {
      x0 = &x;
    } else if (x.scalar_type() != x0->scalar_type() || !x.sizes().equals(x0->sizes())) {
      return false;
    }
  }
  if (!plain_tensor(gamma_obj)) return false;
  const at::ScalarType g = THPVariable_Unpack(gamma_obj).scalar_type();
  return g == x0->scalar_type() || (!cast_before_gamma && g == at::kFloat);
}


}  // namespace

namespace npk_torch {

// _C.rms_norm_module(x, gamma, eps, offset, cast_before_gamma): RMSNorm's
// eager forward, y of npukern::rms_norm called unboxed through the
// dispatcher (autograd, modes and fake tensors see the same op), or
// NotImplemented when the module's general path would do anything but hand
// these arguments to the op as they are (then it runs that path).
PyObject *rms_norm_module(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  double eps = 0, offset = 0;
  bool cbg = false;
  if (nargs != 5 || at::impl::torch_function_mode_enabled() || !norm_scalars(args + 2, &eps, &offset, &cbg) ||
      !module_takes({args[0]}, args[1], cbg))
    Py_RETURN_NOTIMPLEMENTED;
  return THPVariable_Wrap(std::get<0>(rms_norm_nogil(args, eps, offset, cbg)));
  END_HANDLE_TH_ERRORS
}

// _C.add_rms_norm_module(x, residual, gamma, eps, offset, cast_before_gamma):
// AddRMSNorm's eager forward, (y, x_sum) of npukern::add_rms_norm, or
// NotImplemented as above.
PyObject *add_rms_norm_module(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  double eps = 0, offset = 0;
  bool cbg = false;
  if (nargs != 6 || at::impl::torch_function_mode_enabled() || !norm_scalars(args + 3, &eps, &offset, &cbg) ||
      !module_takes({args[0], args[1]}, args[2], cbg))
    Py_RETURN_NOTIMPLEMENTED;
  T3 out = add_rms_norm_nogil(args, eps, offset, cbg);
  return wrap_all<2>({std::move(std::get<0>(out)), std::move(std::get<2>(out))});
  END_HANDLE_TH_ERRORS
}

// _C.fast_op(overload, name, overload_name, parameter_type): the builtin
// calling `overload` (a torch.ops OpOverload of npukern::name) eagerly, or
// None when its schema has an argument or return the fast path does not take.
PyObject *fast_op(PyObject *, PyObject *args) {
  HANDLE_TH_ERRORS
  PyObject *overload = nullptr;
  PyObject *parameter_type = nullptr;
  const char *name = nullptr;
  const char *overload_name = nullptr;
  if (!PyArg_ParseTuple(args, "OssO", &overload, &name, &overload_name, &parameter_type)) return nullptr;
  if (g_parameter_type == nullptr) {
    Py_INCREF(parameter_type);
    g_parameter_type = parameter_type;
  }
  auto handle = c10::Dispatcher::singleton().findSchema({std::string("npukern::") + name, overload_name});
  if (!handle) Py_RETURN_NONE;
  const auto &schema = handle->schema();
  if (schema.is_vararg() || schema.is_varret()) Py_RETURN_NONE;
  auto fast = std::make_unique<FastOp>(FastOp{*handle, {}, {}, schema.returns().size(), nullptr});
  for (const auto &a : schema.arguments()) {
    auto kind = kind_of(a);
    if (!kind) Py_RETURN_NONE;
    fast->kinds.push_back(*kind);
    fast->defaults.push_back(a.default_value());
  }
  for (const auto &r : schema.returns()) {
    if (r.type()->kind() != c10::TypeKind::TensorType) Py_RETURN_NONE;
  }
  if (fast->returns == 0) Py_RETURN_NONE;
  if (overload_name[0] == '\0' && std::string(name) == "rms_norm") fast->unboxed = Unboxed::RmsNorm;
  if (overload_name[0] == '\0' && std::string(name) == "add_rms_norm") fast->unboxed = Unboxed::AddRmsNorm;
  Py_INCREF(overload);
  fast->fallback = overload;
  PyObject *capsule = PyCapsule_New(fast.get(), kCapsule, destroy);
  if (capsule == nullptr) {
    Py_DECREF(overload);
    return nullptr;
  }
  fast.release();
  PyObject *fn = PyCFunction_NewEx(&call_def, capsule, nullptr);
  Py_DECREF(capsule);
  return fn;
  END_HANDLE_TH_ERRORS
}

}  // namespace npk_torch
