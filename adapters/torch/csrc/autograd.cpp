// The autograd formulas of the npukern:: ops, in C++ (registered at the
// Autograd key). Each forward op, called with nothing that requires grad (or
// with grad mode off), goes straight to its CPU kernel below autograd: no
// graph node, no Python. Otherwise a torch::autograd::Function saves what the
// backward op needs (x or x_sum, gamma, rstd; the indices) and its backward
// calls npukern's backward op through the dispatcher. rstd and lse are
// auxiliary outputs, not differentiable (as in torch_npu): they are returned
// beside the Function's outputs, never through it.
//
// Double backward: when a backward runs with create_graph=True and any
// tensor it reads requires grad, the norms, SwiGLU, GeGLU and RoPE (and the cos/sin
// gradients, whenever they are wanted) run the differentiable float32 torch
// composites of npukern_torch/_composite.py instead, called as the
// npukern::_*_composite ops (schemas in register.cpp, CompositeImplicitAutograd
// implementations registered from Python by npukern_torch/_autograd.py), so
// that second derivatives are exact. The embedding's backward op is linear in
// its gradient and has its own derivative (a lookup, also a composite). The
// backward ops called directly have no derivative and say so.
//
// The in-place add_rms_norm_ also has an ADInplaceOrView kernel: the version
// bump torch's own in-place ops make there.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <tuple>
#include <vector>
#include <utility>

namespace npk_torch::grad {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

// ---------------------------------------------------------------------------
// The ops, looked up once (typed handles: unboxed calls).

template <class Sig>
c10::TypedOperatorHandle<Sig> find(const char *name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

#define NPK_OP(fn, name, ...)                                   \
  const c10::TypedOperatorHandle<__VA_ARGS__> &fn() {           \
    static const auto handle = find<__VA_ARGS__>("npukern::" name); \
    return handle;                                              \
  }

using T2 = std::tuple<Tensor, Tensor>;
using T3 = std::tuple<Tensor, Tensor, Tensor>;
using Opt = std::optional<Tensor>;
using c10::SymInt;

NPK_OP(rms_norm_op, "rms_norm", T2(const Tensor &, const Tensor &, double, double, bool))
NPK_OP(rms_norm_backward_op, "rms_norm_backward",
       T2(const Tensor &, const Tensor &, const Tensor &, const Tensor &, double))
NPK_OP(add_rms_norm_op, "add_rms_norm", T3(const Tensor &, const Tensor &, const Tensor &, double, double, bool))
NPK_OP(add_rms_norm_inplace_op, "add_rms_norm_", T2(Tensor &, const Tensor &, const Tensor &, double, double, bool))
NPK_OP(add_rms_norm_backward_op, "add_rms_norm_backward",
       T2(const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &, double))
NPK_OP(embedding_op, "embedding", Tensor(const Tensor &, const Tensor &, SymInt, bool))
NPK_OP(embedding_shard_op, "embedding_shard", Tensor(const Tensor &, const Tensor &, SymInt, SymInt, SymInt, bool))
NPK_OP(dense_grad_op, "embedding_dense_backward", Tensor(const Tensor &, const Tensor &, SymInt, SymInt, bool))
NPK_OP(dense_grad_shard_op, "embedding_dense_backward_shard",
       Tensor(const Tensor &, const Tensor &, SymInt, SymInt, SymInt, bool))
NPK_OP(swiglu_op, "swiglu", Tensor(const Tensor &, int64_t, bool))
NPK_OP(swiglu_backward_op, "swiglu_backward", Tensor(const Tensor &, const Tensor &, int64_t, bool))
NPK_OP(silu_mul_op, "silu_mul", Tensor(const Tensor &, const Tensor &, bool))
NPK_OP(silu_mul_backward_op, "silu_mul_backward", T2(const Tensor &, const Tensor &, const Tensor &, bool))
NPK_OP(geglu_op, "geglu", T2(const Tensor &, int64_t, int64_t, bool, bool))
NPK_OP(geglu_backward_op, "geglu_backward", Tensor(const Tensor &, const Tensor &, int64_t, int64_t, bool, bool))
NPK_OP(gelu_mul_op, "gelu_mul", Tensor(const Tensor &, const Tensor &, int64_t, bool))
NPK_OP(gelu_mul_backward_op, "gelu_mul_backward", T2(const Tensor &, const Tensor &, const Tensor &, int64_t, bool))
NPK_OP(rotary_mul_op, "rotary_mul", Tensor(const Tensor &, const Tensor &, const Tensor &, bool, bool))
NPK_OP(rope_qk_op, "rope_qk", T2(const Tensor &, const Tensor &, const Tensor &, const Tensor &, bool, bool))
NPK_OP(cross_entropy_train_op, "cross_entropy_train",
       T3(const Tensor &, const Tensor &, const Opt &, int64_t, int64_t, double, double, double))
NPK_OP(cross_entropy_op, "cross_entropy",
       T2(const Tensor &, const Tensor &, const Opt &, int64_t, int64_t, double, double, double))
NPK_OP(cross_entropy_backward_op, "cross_entropy_backward",
       Tensor(const Tensor &, const Tensor &, const Tensor &, const Opt &, const Tensor &, int64_t, int64_t, double,
              double, double))
NPK_OP(matmul_op, "matmul",
       Tensor(const Tensor &, const Tensor &, bool, bool, std::optional<at::ScalarType>, int64_t))
NPK_OP(linear_op, "linear", Tensor(const Tensor &, const Tensor &, const Opt &, int64_t))
NPK_OP(attention_op, "attention", T3(const Tensor &, const Tensor &, const Tensor &, bool, std::optional<double>))
NPK_OP(attention_backward_op, "attention_backward",
       T3(const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
          const Tensor &, bool, std::optional<double>))

// The differentiable float32 composites (npukern_torch/_composite.py).
NPK_OP(rms_norm_grads_composite, "_rms_norm_grads_composite",
       T2(const Tensor &, const Tensor &, const Tensor &, double, double, const Opt &))
NPK_OP(silu_mul_grads_composite, "_silu_mul_grads_composite", T2(const Tensor &, const Tensor &, const Tensor &))
NPK_OP(swiglu_grad_composite, "_swiglu_grad_composite", Tensor(const Tensor &, const Tensor &, int64_t))
NPK_OP(gelu_mul_grads_composite, "_gelu_mul_grads_composite",
       T2(const Tensor &, const Tensor &, const Tensor &, int64_t))
NPK_OP(geglu_grad_composite, "_geglu_grad_composite", Tensor(const Tensor &, const Tensor &, int64_t, int64_t, bool))
NPK_OP(rotary_dx_composite, "_rotary_dx_composite",
       Tensor(const Tensor &, const Tensor &, const Tensor &, bool, const Tensor &))
NPK_OP(rotary_table_grads_composite, "_rotary_table_grads_composite",
       T2(at::TensorList, at::TensorList, const Tensor &, const Tensor &, bool))
NPK_OP(embedding_grad_of_grad_composite, "_embedding_grad_of_grad_composite",
       Tensor(const Tensor &, const Tensor &, SymInt, SymInt, bool, at::ScalarType))

#undef NPK_OP

// ---------------------------------------------------------------------------
// Helpers.

bool any_requires_grad(std::initializer_list<const Tensor *> ts) {
  for (const Tensor *t : ts)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

// Forward-mode AD: the ops have no jvp formula (register_autograd's Function
// raised NotImplementedError on a dual input that requires grad; a C++
// Function would raise a RuntimeError from deep inside apply). Checked on
// every call, not only when recording: a dual input that does not require
// grad (torch.func.jvp's, or make_dual of a plain tensor) would otherwise
// run below autograd and return outputs without tangents, which jvp reads
// as zeros.
void no_forward_ad(const char *op, std::initializer_list<const Tensor *> ts) {
  for (const Tensor *t : ts)
    TORCH_CHECK_NOT_IMPLEMENTED(!t->defined() || !t->_fw_grad(/*level=*/0).defined(), "npukern::", op,
                                " has no forward-mode AD formula (jvp)");
}

// Whether op's forward must record a graph node (what register_autograd's
// kernel asked: grad mode on and any input requiring grad), after refusing
// a forward-mode tangent.
bool recording(const char *op, std::initializer_list<const Tensor *> ts) {
  no_forward_ad(op, ts);
  return c10::GradMode::is_enabled() && any_requires_grad(ts);
}

// True inside a create_graph=True backward that must record how the
// gradients depend on their inputs.
bool building_graph(std::initializer_list<const Tensor *> ts) {
  return c10::GradMode::is_enabled() && any_requires_grad(ts);
}

// The kernel's dgamma is f32 (the main-grad dtype); autograd needs gamma's.
Tensor cast_dgamma(const Tensor &dgamma, const Tensor &gamma) {
  return dgamma.scalar_type() == gamma.scalar_type() ? dgamma : dgamma.to(gamma.scalar_type());
}

// The auxiliary outputs (rstd, lse) are not differentiable, so not outputs
// of the autograd Function (whose mark_non_differentiable compiled autograd
// refuses): the caller passes a Tensor* (a plain argument, not an input of
// the graph: its gradient slot is empty) that the forward fills. No state
// outlives the call.

// The keys below autograd, for the no-grad path's redispatch (the guard
// keeps whatever the kernel itself calls below autograd too).
constexpr c10::DispatchKeySet kBelow = c10::after_ADInplaceOrView_keyset;
using Below = at::AutoDispatchBelowADInplaceOrView;

// ---------------------------------------------------------------------------
// RmsNorm, AddRmsNorm.

struct RmsNorm : Function<RmsNorm> {
  static variable_list forward(AutogradContext *ctx, const Tensor &x, const Tensor &gamma, double eps,
                               double offset, bool cast_before_gamma, Tensor *rstd_out) {
    Below guard;
    auto [y, rstd] = rms_norm_op().call(x, gamma, eps, offset, cast_before_gamma);
    ctx->save_for_backward({x, gamma, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    *rstd_out = rstd;
    return {y};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &gamma = saved[1], &rstd = saved[2], &dy = grads[0];
    const double eps = ctx->saved_data["eps"].toDouble(), offset = ctx->saved_data["offset"].toDouble();
    if (building_graph({&dy, &x, &gamma})) {
      auto [dx, dgamma] = rms_norm_grads_composite().call(dy, x, gamma, eps, offset, std::nullopt);
      return {dx, dgamma, {}, {}, {}, {}};
    }
    auto [dx, dgamma] = rms_norm_backward_op().call(dy, x, gamma, rstd, offset);
    return {dx, cast_dgamma(dgamma, gamma), {}, {}, {}, {}};
  }
};

T2 rms_norm(c10::DispatchKeySet ks, const Tensor &x, const Tensor &gamma, double eps, double offset,
            bool cast_before_gamma) {
  if (!recording("rms_norm", {&x, &gamma})) {
    Below guard;
    return rms_norm_op().redispatch(ks & kBelow, x, gamma, eps, offset, cast_before_gamma);
  }
  Tensor rstd;
  variable_list out = RmsNorm::apply(x, gamma, eps, offset, cast_before_gamma, &rstd);
  return {out[0], rstd};
}

struct AddRmsNorm : Function<AddRmsNorm> {
  static variable_list forward(AutogradContext *ctx, const Tensor &x1, const Tensor &x2, const Tensor &gamma,
                               double eps, double offset, bool cast_before_gamma, Tensor *rstd_out) {
    Below guard;
    auto [y, rstd, x_sum] = add_rms_norm_op().call(x1, x2, gamma, eps, offset, cast_before_gamma);
    ctx->save_for_backward({x_sum, gamma, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    *rstd_out = rstd;
    return {y, x_sum};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &x_sum = saved[0], &gamma = saved[1], &rstd = saved[2], &dy = grads[0], &dx_sum = grads[1];
    const double eps = ctx->saved_data["eps"].toDouble(), offset = ctx->saved_data["offset"].toDouble();
    if (building_graph({&dy, &x_sum, &gamma, &dx_sum})) {
      auto [dx, dgamma] = rms_norm_grads_composite().call(dy, x_sum, gamma, eps, offset, dx_sum);
      return {dx, dx, dgamma, {}, {}, {}, {}};
    }
    auto [dx, dgamma] = add_rms_norm_backward_op().call(dy, x_sum, gamma, rstd, dx_sum, offset);
    // x_sum = x1 + x2: both addends get the same gradient.
    return {dx, dx, cast_dgamma(dgamma, gamma), {}, {}, {}, {}};
  }
};

T3 add_rms_norm(c10::DispatchKeySet ks, const Tensor &x1, const Tensor &x2, const Tensor &gamma, double eps,
                double offset, bool cast_before_gamma) {
  if (!recording("add_rms_norm", {&x1, &x2, &gamma})) {
    Below guard;
    return add_rms_norm_op().redispatch(ks & kBelow, x1, x2, gamma, eps, offset, cast_before_gamma);
  }
  Tensor rstd;
  variable_list out = AddRmsNorm::apply(x1, x2, gamma, eps, offset, cast_before_gamma, &rstd);
  return {out[0], rstd, out[1]};
}

// AddRmsNorm with x_sum written over x1 (IPEX's add_back). x1 then holds the
// x_sum AddRmsNorm's backward reads, so that backward serves as is.
struct AddRmsNormInPlace : Function<AddRmsNormInPlace> {
  static variable_list forward(AutogradContext *ctx, Tensor x1, const Tensor &x2, const Tensor &gamma, double eps,
                               double offset, bool cast_before_gamma, Tensor *rstd_out) {
    T2 out;
    {
      // Through ADInplaceOrView, whose bump refuses an inference x1 before
      // the write (mark_dirty bumps the version once more).
      at::AutoDispatchBelowAutograd guard;
      out = add_rms_norm_inplace_op().call(x1, x2, gamma, eps, offset, cast_before_gamma);
    }
    const auto &[y, rstd] = out;
    ctx->mark_dirty({x1});
    ctx->save_for_backward({x1, gamma, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    *rstd_out = rstd;
    return {y, x1};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    return AddRmsNorm::backward(ctx, std::move(grads));
  }
};

T2 add_rms_norm_(c10::DispatchKeySet ks, Tensor &x1, const Tensor &x2, const Tensor &gamma, double eps,
                 double offset, bool cast_before_gamma) {
  const bool rec = recording("add_rms_norm_", {&x1, &x2, &gamma});
  // torch's in-place rules (no leaf requiring grad, no view autograd cannot
  // rebase), checked before anything is written.
  torch::autograd::check_inplace(x1, rec);
  // Autograd lets a Function that writes a view in place return one tensor
  // only (it checks after the forward ran); this one returns y too.
  TORCH_CHECK(!rec || !x1.is_view(), "npukern::add_rms_norm_: x1 is a view of another tensor, which autograd cannot ",
              "record this in-place op on; clone x1, or call add_rms_norm (out of place)");
  if (!rec) {
    at::AutoDispatchBelowAutograd guard;
    return add_rms_norm_inplace_op().redispatch(ks & c10::after_autograd_keyset, x1, x2, gamma, eps, offset,
                                                cast_before_gamma);
  }
  Tensor rstd;
  variable_list out = AddRmsNormInPlace::apply(x1, x2, gamma, eps, offset, cast_before_gamma, &rstd);
  // apply has rebased x1's history; compiled autograd refuses a node whose
  // context still lists dirty inputs, so the list is emptied.
  static_cast<torch::autograd::CppNode<AddRmsNormInPlace> *>(out[0].grad_fn().get())->ctx_.mark_dirty({});
  return {out[0], rstd};
}

// The version bump torch's own in-place ops make at this key, made before
// the call so that an inference tensor outside InferenceMode is refused
// before anything is written.
T2 add_rms_norm_inplace_or_view(c10::DispatchKeySet ks, Tensor &x1, const Tensor &x2, const Tensor &gamma,
                                double eps, double offset, bool cast_before_gamma) {
  torch::autograd::increment_version(x1);
  Below guard;
  return add_rms_norm_inplace_op().redispatch(ks & kBelow, x1, x2, gamma, eps, offset, cast_before_gamma);
}

// ---------------------------------------------------------------------------
// Embedding lookups and EmbeddingDenseGrad (whose derivative in its grad is
// the lookup of the table's gradient: a composite).

struct Embedding : Function<Embedding> {
  static variable_list forward(AutogradContext *ctx, const Tensor &weight, const Tensor &indices,
                               SymInt padding_idx, bool scale_grad_by_freq) {
    Tensor out;
    {
      Below guard;
      out = embedding_op().call(weight, indices, padding_idx, scale_grad_by_freq);
    }
    ctx->save_for_backward({indices});
    ctx->saved_data["num_weights"] = weight.sym_size(0);
    ctx->saved_data["padding_idx"] = std::move(padding_idx);
    ctx->saved_data["scale_grad_by_freq"] = scale_grad_by_freq;
    return {out};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const Tensor indices = ctx->get_saved_variables()[0];
    Tensor dw = dense_grad_op().call(grads[0], indices, ctx->saved_data["num_weights"].toSymInt(),
                                     ctx->saved_data["padding_idx"].toSymInt(),
                                     ctx->saved_data["scale_grad_by_freq"].toBool());
    return {dw, {}, {}, {}};
  }
};

Tensor embedding(c10::DispatchKeySet ks, const Tensor &weight, const Tensor &indices, SymInt padding_idx,
                 bool scale_grad_by_freq) {
  if (!recording("embedding", {&weight, &indices})) {
    Below guard;
    return embedding_op().redispatch(ks & kBelow, weight, indices, std::move(padding_idx), scale_grad_by_freq);
  }
  return Embedding::apply(weight, indices, std::move(padding_idx), scale_grad_by_freq)[0];
}

struct EmbeddingShard : Function<EmbeddingShard> {
  static variable_list forward(AutogradContext *ctx, const Tensor &weight, const Tensor &indices,
                               SymInt num_embeddings, SymInt vocab_start, SymInt padding_idx,
                               bool scale_grad_by_freq) {
    Tensor out;
    {
      Below guard;
      out = embedding_shard_op().call(weight, indices, std::move(num_embeddings), vocab_start, padding_idx,
                                      scale_grad_by_freq);
    }
    ctx->save_for_backward({indices});
    ctx->saved_data["rows"] = weight.sym_size(0);
    ctx->saved_data["vocab_start"] = std::move(vocab_start);
    ctx->saved_data["padding_idx"] = std::move(padding_idx);
    ctx->saved_data["scale_grad_by_freq"] = scale_grad_by_freq;
    return {out};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const Tensor indices = ctx->get_saved_variables()[0];
    Tensor dw = dense_grad_shard_op().call(grads[0], indices, ctx->saved_data["rows"].toSymInt(),
                                           ctx->saved_data["vocab_start"].toSymInt(),
                                           ctx->saved_data["padding_idx"].toSymInt(),
                                           ctx->saved_data["scale_grad_by_freq"].toBool());
    return {dw, {}, {}, {}, {}, {}};
  }
};

Tensor embedding_shard(c10::DispatchKeySet ks, const Tensor &weight, const Tensor &indices, SymInt num_embeddings,
                       SymInt vocab_start, SymInt padding_idx, bool scale_grad_by_freq) {
  if (!recording("embedding_shard", {&weight, &indices})) {
    Below guard;
    return embedding_shard_op().redispatch(ks & kBelow, weight, indices, std::move(num_embeddings),
                                           std::move(vocab_start), std::move(padding_idx), scale_grad_by_freq);
  }
  return EmbeddingShard::apply(weight, indices, std::move(num_embeddings), std::move(vocab_start),
                               std::move(padding_idx), scale_grad_by_freq)[0];
}

// The derivative of EmbeddingDenseGrad (whole table: vocab_start 0, or one
// shard) in its `grad` input.
Tensor dense_grad_of_grad(AutogradContext *ctx, const Tensor &ggw) {
  const Tensor indices = ctx->get_saved_variables()[0];
  return embedding_grad_of_grad_composite().call(
      ggw, indices, ctx->saved_data["vocab_start"].toSymInt(), ctx->saved_data["padding_idx"].toSymInt(),
      ctx->saved_data["scale_grad_by_freq"].toBool(),
      static_cast<at::ScalarType>(ctx->saved_data["grad_dtype"].toInt()));
}

void save_dense_grad(AutogradContext *ctx, const Tensor &grad, const Tensor &indices, SymInt vocab_start,
                     SymInt padding_idx, bool scale_grad_by_freq) {
  ctx->save_for_backward({indices});
  ctx->saved_data["vocab_start"] = std::move(vocab_start);
  ctx->saved_data["padding_idx"] = std::move(padding_idx);
  ctx->saved_data["scale_grad_by_freq"] = scale_grad_by_freq;
  ctx->saved_data["grad_dtype"] = static_cast<int64_t>(grad.scalar_type());
}

struct DenseGrad : Function<DenseGrad> {
  static variable_list forward(AutogradContext *ctx, const Tensor &grad, const Tensor &indices, SymInt num_weights,
                               SymInt padding_idx, bool scale_grad_by_freq) {
    Tensor out;
    {
      Below guard;
      out = dense_grad_op().call(grad, indices, std::move(num_weights), padding_idx, scale_grad_by_freq);
    }
    save_dense_grad(ctx, grad, indices, SymInt(0), std::move(padding_idx), scale_grad_by_freq);
    return {out};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    return {dense_grad_of_grad(ctx, grads[0]), {}, {}, {}, {}};
  }
};

Tensor embedding_dense_backward(c10::DispatchKeySet ks, const Tensor &grad, const Tensor &indices,
                                SymInt num_weights, SymInt padding_idx, bool scale_grad_by_freq) {
  if (!recording("embedding_dense_backward", {&grad, &indices})) {
    Below guard;
    return dense_grad_op().redispatch(ks & kBelow, grad, indices, std::move(num_weights), std::move(padding_idx),
                                      scale_grad_by_freq);
  }
  return DenseGrad::apply(grad, indices, std::move(num_weights), std::move(padding_idx), scale_grad_by_freq)[0];
}

struct DenseGradShard : Function<DenseGradShard> {
  static variable_list forward(AutogradContext *ctx, const Tensor &grad, const Tensor &indices, SymInt num_weights,
                               SymInt vocab_start, SymInt padding_idx, bool scale_grad_by_freq) {
    Tensor out;
    {
      Below guard;
      out = dense_grad_shard_op().call(grad, indices, std::move(num_weights), vocab_start, padding_idx,
                                       scale_grad_by_freq);
    }
    save_dense_grad(ctx, grad, indices, std::move(vocab_start), std::move(padding_idx), scale_grad_by_freq);
    return {out};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    return {dense_grad_of_grad(ctx, grads[0]), {}, {}, {}, {}, {}};
  }
};

Tensor embedding_dense_backward_shard(c10::DispatchKeySet ks, const Tensor &grad, const Tensor &indices,
                                      SymInt num_weights, SymInt vocab_start, SymInt padding_idx,
                                      bool scale_grad_by_freq) {
  if (!recording("embedding_dense_backward_shard", {&grad, &indices})) {
    Below guard;
    return dense_grad_shard_op().redispatch(ks & kBelow, grad, indices, std::move(num_weights),
                                            std::move(vocab_start), std::move(padding_idx), scale_grad_by_freq);
  }
  return DenseGradShard::apply(grad, indices, std::move(num_weights), std::move(vocab_start), std::move(padding_idx),
                               scale_grad_by_freq)[0];
}

// ---------------------------------------------------------------------------
// The backward ops: no derivative of their own.

[[noreturn]] void no_derivative(const char *op) {
  TORCH_CHECK(false, "npukern::", op, " has no derivative of its own (no double backward for it)");
}

[[noreturn]] void no_norm_derivative(const char *op) {
  TORCH_CHECK(false, "npukern::", op,
              " has no derivative of its own (its rstd input hides how it depends on x); to differentiate a norm "
              "twice, call backward with create_graph=True through npukern.rms_norm / add_rms_norm (or the "
              "modules), which then run a differentiable composite");
}

struct RmsNormBackward : Function<RmsNormBackward> {
  static variable_list forward(AutogradContext *, const Tensor &dy, const Tensor &x, const Tensor &gamma,
                               const Tensor &rstd, double offset) {
    Below guard;
    auto [dx, dgamma] = rms_norm_backward_op().call(dy, x, gamma, rstd, offset);
    return {dx, dgamma};
  }
  static variable_list backward(AutogradContext *, variable_list) { no_norm_derivative("rms_norm_backward"); }
};

T2 rms_norm_backward(c10::DispatchKeySet ks, const Tensor &dy, const Tensor &x, const Tensor &gamma,
                     const Tensor &rstd, double offset) {
  if (!recording("rms_norm_backward", {&dy, &x, &gamma, &rstd})) {
    Below guard;
    return rms_norm_backward_op().redispatch(ks & kBelow, dy, x, gamma, rstd, offset);
  }
  variable_list out = RmsNormBackward::apply(dy, x, gamma, rstd, offset);
  return {out[0], out[1]};
}

struct AddRmsNormBackward : Function<AddRmsNormBackward> {
  static variable_list forward(AutogradContext *, const Tensor &dy, const Tensor &x_sum, const Tensor &gamma,
                               const Tensor &rstd, const Tensor &dx_sum, double offset) {
    Below guard;
    auto [dx, dgamma] = add_rms_norm_backward_op().call(dy, x_sum, gamma, rstd, dx_sum, offset);
    return {dx, dgamma};
  }
  static variable_list backward(AutogradContext *, variable_list) { no_norm_derivative("add_rms_norm_backward"); }
};

T2 add_rms_norm_backward(c10::DispatchKeySet ks, const Tensor &dy, const Tensor &x_sum, const Tensor &gamma,
                         const Tensor &rstd, const Tensor &dx_sum, double offset) {
  if (!recording("add_rms_norm_backward", {&dy, &x_sum, &gamma, &rstd, &dx_sum})) {
    Below guard;
    return add_rms_norm_backward_op().redispatch(ks & kBelow, dy, x_sum, gamma, rstd, dx_sum, offset);
  }
  variable_list out = AddRmsNormBackward::apply(dy, x_sum, gamma, rstd, dx_sum, offset);
  return {out[0], out[1]};
}

struct SwigluBackward : Function<SwigluBackward> {
  static variable_list forward(AutogradContext *, const Tensor &dy, const Tensor &x, int64_t dim, bool eager) {
    Below guard;
    return {swiglu_backward_op().call(dy, x, dim, eager)};
  }
  static variable_list backward(AutogradContext *, variable_list) { no_derivative("swiglu_backward"); }
};

Tensor swiglu_backward(c10::DispatchKeySet ks, const Tensor &dy, const Tensor &x, int64_t dim, bool eager) {
  if (!recording("swiglu_backward", {&dy, &x})) {
    Below guard;
    return swiglu_backward_op().redispatch(ks & kBelow, dy, x, dim, eager);
  }
  return SwigluBackward::apply(dy, x, dim, eager)[0];
}

struct SiluMulBackward : Function<SiluMulBackward> {
  static variable_list forward(AutogradContext *, const Tensor &dy, const Tensor &gate, const Tensor &up,
                               bool eager) {
    Below guard;
    auto [dgate, dup] = silu_mul_backward_op().call(dy, gate, up, eager);
    return {dgate, dup};
  }
  static variable_list backward(AutogradContext *, variable_list) { no_derivative("silu_mul_backward"); }
};

T2 silu_mul_backward(c10::DispatchKeySet ks, const Tensor &dy, const Tensor &gate, const Tensor &up, bool eager) {
  if (!recording("silu_mul_backward", {&dy, &gate, &up})) {
    Below guard;
    return silu_mul_backward_op().redispatch(ks & kBelow, dy, gate, up, eager);
  }
  variable_list out = SiluMulBackward::apply(dy, gate, up, eager);
  return {out[0], out[1]};
}

// ---------------------------------------------------------------------------
// SwiGLU.

struct Swiglu : Function<Swiglu> {
  static variable_list forward(AutogradContext *ctx, const Tensor &x, int64_t dim, bool eager) {
    Below guard;
    Tensor y = swiglu_op().call(x, dim, eager);
    ctx->save_for_backward({x});
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["eager"] = eager;
    return {y};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const Tensor x = ctx->get_saved_variables()[0];
    const Tensor &grad = grads[0];
    const int64_t dim = ctx->saved_data["dim"].toInt();
    if (building_graph({&grad, &x})) return {swiglu_grad_composite().call(grad, x, dim), {}, {}};
    return {swiglu_backward_op().call(grad, x, dim, ctx->saved_data["eager"].toBool()), {}, {}};
  }
};

Tensor swiglu(c10::DispatchKeySet ks, const Tensor &x, int64_t dim, bool eager) {
  if (!recording("swiglu", {&x})) {
    Below guard;
    return swiglu_op().redispatch(ks & kBelow, x, dim, eager);
  }
  return Swiglu::apply(x, dim, eager)[0];
}

struct SiluMul : Function<SiluMul> {
  static variable_list forward(AutogradContext *ctx, const Tensor &gate, const Tensor &up, bool eager) {
    Below guard;
    Tensor y = silu_mul_op().call(gate, up, eager);
    ctx->save_for_backward({gate, up});
    ctx->saved_data["eager"] = eager;
    return {y};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &gate = saved[0], &up = saved[1], &grad = grads[0];
    if (building_graph({&grad, &gate, &up})) {
      auto [dgate, dup] = silu_mul_grads_composite().call(grad, gate, up);
      return {dgate, dup, {}};
    }
    auto [dgate, dup] = silu_mul_backward_op().call(grad, gate, up, ctx->saved_data["eager"].toBool());
    return {dgate, dup, {}};
  }
};

Tensor silu_mul(c10::DispatchKeySet ks, const Tensor &gate, const Tensor &up, bool eager) {
  if (!recording("silu_mul", {&gate, &up})) {
    Below guard;
    return silu_mul_op().redispatch(ks & kBelow, gate, up, eager);
  }
  return SiluMul::apply(gate, up, eager)[0];
}

// ---------------------------------------------------------------------------
// GeGLU: SwiGLU's formulas with GELU (tanh or erf form) as the gate's
// activation. npu_geglu also returns gelu(gate); a gradient reaching it (rare)
// adds torch's gelu_backward of it to the gate's half.

struct GegluBackward : Function<GegluBackward> {
  static variable_list forward(AutogradContext *, const Tensor &dy, const Tensor &x, int64_t dim,
                               int64_t approximate, bool activate_left, bool eager) {
    Below guard;
    return {geglu_backward_op().call(dy, x, dim, approximate, activate_left, eager)};
  }
  static variable_list backward(AutogradContext *, variable_list) { no_derivative("geglu_backward"); }
};

Tensor geglu_backward(c10::DispatchKeySet ks, const Tensor &dy, const Tensor &x, int64_t dim, int64_t approximate,
                      bool activate_left, bool eager) {
  if (!recording("geglu_backward", {&dy, &x})) {
    Below guard;
    return geglu_backward_op().redispatch(ks & kBelow, dy, x, dim, approximate, activate_left, eager);
  }
  return GegluBackward::apply(dy, x, dim, approximate, activate_left, eager)[0];
}

struct GeluMulBackward : Function<GeluMulBackward> {
  static variable_list forward(AutogradContext *, const Tensor &dy, const Tensor &gate, const Tensor &up,
                               int64_t approximate, bool eager) {
    Below guard;
    auto [dgate, dup] = gelu_mul_backward_op().call(dy, gate, up, approximate, eager);
    return {dgate, dup};
  }
  static variable_list backward(AutogradContext *, variable_list) { no_derivative("gelu_mul_backward"); }
};

T2 gelu_mul_backward(c10::DispatchKeySet ks, const Tensor &dy, const Tensor &gate, const Tensor &up,
                     int64_t approximate, bool eager) {
  if (!recording("gelu_mul_backward", {&dy, &gate, &up})) {
    Below guard;
    return gelu_mul_backward_op().redispatch(ks & kBelow, dy, gate, up, approximate, eager);
  }
  variable_list out = GeluMulBackward::apply(dy, gate, up, approximate, eager);
  return {out[0], out[1]};
}

struct Geglu : Function<Geglu> {
  static variable_list forward(AutogradContext *ctx, const Tensor &x, int64_t dim, int64_t approximate,
                               bool activate_left, bool eager) {
    Below guard;
    auto [y, gelu] = geglu_op().call(x, dim, approximate, activate_left, eager);
    ctx->save_for_backward({x});
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["approximate"] = approximate;
    ctx->saved_data["activate_left"] = activate_left;
    ctx->saved_data["eager"] = eager;
    // The gelu output's gradient is usually absent: no zeros for it.
    ctx->set_materialize_grads(false);
    return {y, gelu};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const Tensor x = ctx->get_saved_variables()[0];
    const Tensor &dy = grads[0], &dgelu = grads[1];
    const int64_t dim = ctx->saved_data["dim"].toInt(), approximate = ctx->saved_data["approximate"].toInt();
    const bool left = ctx->saved_data["activate_left"].toBool();
    Tensor dx;
    if (dy.defined()) {
      dx = building_graph({&dy, &x}) || (dgelu.defined() && building_graph({&dgelu}))
               ? geglu_grad_composite().call(dy, x, dim, approximate, left)
               : geglu_backward_op().call(dy, x, dim, approximate, left, ctx->saved_data["eager"].toBool());
    }
    if (dgelu.defined()) {
      std::vector<Tensor> halves = x.chunk(2, dim);
      Tensor &gate = halves[left ? 0 : 1];
      Tensor dgate = at::gelu_backward(dgelu, gate, approximate == 0 ? "none" : "tanh");
      Tensor zero = at::zeros_like(gate);
      Tensor extra = left ? at::cat({dgate, zero}, dim) : at::cat({zero, dgate}, dim);
      dx = dx.defined() ? at::add(dx, extra) : extra;
    }
    return {dx, {}, {}, {}, {}};
  }
};

T2 geglu(c10::DispatchKeySet ks, const Tensor &x, int64_t dim, int64_t approximate, bool activate_left,
         bool eager) {
  if (!recording("geglu", {&x})) {
    Below guard;
    return geglu_op().redispatch(ks & kBelow, x, dim, approximate, activate_left, eager);
  }
  variable_list out = Geglu::apply(x, dim, approximate, activate_left, eager);
  return {out[0], out[1]};
}

struct GeluMul : Function<GeluMul> {
  static variable_list forward(AutogradContext *ctx, const Tensor &gate, const Tensor &up, int64_t approximate,
                               bool eager) {
    Below guard;
    Tensor y = gelu_mul_op().call(gate, up, approximate, eager);
    ctx->save_for_backward({gate, up});
    ctx->saved_data["approximate"] = approximate;
    ctx->saved_data["eager"] = eager;
    return {y};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &gate = saved[0], &up = saved[1], &grad = grads[0];
    const int64_t approximate = ctx->saved_data["approximate"].toInt();
    if (building_graph({&grad, &gate, &up})) {
      auto [dgate, dup] = gelu_mul_grads_composite().call(grad, gate, up, approximate);
      return {dgate, dup, {}, {}};
    }
    auto [dgate, dup] = gelu_mul_backward_op().call(grad, gate, up, approximate, ctx->saved_data["eager"].toBool());
    return {dgate, dup, {}, {}};
  }
};

Tensor gelu_mul(c10::DispatchKeySet ks, const Tensor &gate, const Tensor &up, int64_t approximate, bool eager) {
  if (!recording("gelu_mul", {&gate, &up})) {
    Below guard;
    return gelu_mul_op().redispatch(ks & kBelow, gate, up, approximate, eager);
  }
  return GeluMul::apply(gate, up, approximate, eager)[0];
}

// ---------------------------------------------------------------------------
// RoPE. dx per (grad, x) pair and the cos/sin gradients: the kernel rotates
// the gradients; the tables' gradients (rarely wanted: Hugging Face computes
// cos/sin without grad) and everything under create_graph=True (double
// backward) come from the differentiable float32 composite.

struct Rotation {
  variable_list dxs;
  Tensor dcos, dsin;
};

Rotation rotation_grads(AutogradContext *ctx, const variable_list &gs, const variable_list &xs, const Tensor &cos,
                        const Tensor &sin, size_t cos_at) {
  const bool backward = ctx->saved_data["backward"].toBool(), eager = ctx->saved_data["eager"].toBool();
  Rotation r;
  bool building = building_graph({&cos, &sin});
  for (size_t i = 0; i < gs.size() && !building; i++) building = building_graph({&gs[i], &xs[i]});
  if (building) {
    for (size_t i = 0; i < gs.size(); i++)
      r.dxs.push_back(rotary_dx_composite().call(gs[i], cos, sin, backward, xs[i]));
  } else if (gs.size() == 1) {
    r.dxs.push_back(rotary_mul_op().call(gs[0], cos, sin, eager, !backward));
  } else {
    auto [dq, dk] = rope_qk_op().call(gs[0], gs[1], cos, sin, eager, !backward);
    r.dxs = {dq, dk};
  }
  if (ctx->needs_input_grad(cos_at) || ctx->needs_input_grad(cos_at + 1))
    std::tie(r.dcos, r.dsin) = rotary_table_grads_composite().call(gs, xs, cos, sin, backward);
  return r;
}

struct RotaryMul : Function<RotaryMul> {
  static variable_list forward(AutogradContext *ctx, const Tensor &x, const Tensor &cos, const Tensor &sin,
                               bool eager, bool backward) {
    Below guard;
    Tensor y = rotary_mul_op().call(x, cos, sin, eager, backward);
    ctx->save_for_backward({x, cos, sin});
    ctx->saved_data["eager"] = eager;
    ctx->saved_data["backward"] = backward;
    return {y};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    Rotation r = rotation_grads(ctx, {grads[0]}, {saved[0]}, saved[1], saved[2], 1);
    return {r.dxs[0], r.dcos, r.dsin, {}, {}};
  }
};

Tensor rotary_mul(c10::DispatchKeySet ks, const Tensor &x, const Tensor &cos, const Tensor &sin, bool eager,
                  bool backward) {
  if (!recording("rotary_mul", {&x, &cos, &sin})) {
    Below guard;
    return rotary_mul_op().redispatch(ks & kBelow, x, cos, sin, eager, backward);
  }
  return RotaryMul::apply(x, cos, sin, eager, backward)[0];
}

struct RopeQk : Function<RopeQk> {
  static variable_list forward(AutogradContext *ctx, const Tensor &q, const Tensor &k, const Tensor &cos,
                               const Tensor &sin, bool eager, bool backward) {
    Below guard;
    auto [qo, ko] = rope_qk_op().call(q, k, cos, sin, eager, backward);
    ctx->save_for_backward({q, k, cos, sin});
    ctx->saved_data["eager"] = eager;
    ctx->saved_data["backward"] = backward;
    return {qo, ko};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1];
    // (Autograd hands zeros for an unused output; kept for an undefined one.)
    Tensor gq = grads[0].defined() ? grads[0] : at::zeros_like(q);
    Tensor gk = grads[1].defined() ? grads[1] : at::zeros_like(k);
    Rotation r = rotation_grads(ctx, {gq, gk}, {q, k}, saved[2], saved[3], 2);
    return {r.dxs[0], r.dxs[1], r.dcos, r.dsin, {}, {}};
  }
};

T2 rope_qk(c10::DispatchKeySet ks, const Tensor &q, const Tensor &k, const Tensor &cos, const Tensor &sin, bool eager,
           bool backward) {
  if (!recording("rope_qk", {&q, &k, &cos, &sin})) {
    Below guard;
    return rope_qk_op().redispatch(ks & kBelow, q, k, cos, sin, eager, backward);
  }
  variable_list out = RopeQk::apply(q, k, cos, sin, eager, backward);
  return {out[0], out[1]};
}

// ---------------------------------------------------------------------------
// CrossEntropy: the loss is differentiable in the logits; lse is not.

// A real CPU tensor, not a tracer's (FakeTensor and FunctionalTensor carry
// the Python key, functionalization its own): values may be read.
bool concrete(const Tensor &t) {
  return !t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
}

// Differentiating the loss twice (create_graph=True, then a gradient of its
// gradient): the kernel's backward has no derivative of its own, so its
// result is wrapped as torch's once_differentiable wraps one, and a second
// backward through it raises instead of silently seeing zero.
Tensor once_differentiable(const Tensor &grad, const char *op) {
  if (!c10::GradMode::is_enabled()) return grad;
  Tensor alias = grad.detach();
  alias.set_requires_grad(true);
  torch::autograd::DelayedError err(std::string("npukern::") + op +
                                        " is differentiable once: its gradient has no derivative (use "
                                        "torch.nn.functional.cross_entropy for a second derivative)",
                                    1);
  return err.apply({alias})[0];
}

struct CrossEntropy : Function<CrossEntropy> {
  static variable_list forward(AutogradContext *ctx, const Tensor &logits, const Tensor &target, const Opt &weight,
                               int64_t reduction, int64_t ignore_index, double label_smoothing,
                               double lse_square_scale, double softcap, Tensor *lse_out) {
    Below guard;
    // A reduced loss whose logits require grad: the training forward also
    // writes dlogits for an upstream gradient of 1, in the same pass over
    // the logits (one exp per logit instead of two, one read instead of
    // two). loss.backward() then hands them over as they are; any other
    // upstream gradient (a scaled loss) runs the backward op (the same bits
    // as forward then backward, one rounding), and those dlogits are
    // dropped. Decided by this call alone: no state is kept between calls.
    const bool train = reduction != 0 && logits.requires_grad() && concrete(logits);
    Tensor loss, lse, dlogits;
    if (train) {
      std::tie(loss, lse, dlogits) = cross_entropy_train_op().call(logits, target, weight, reduction, ignore_index,
                                                                   label_smoothing, lse_square_scale, softcap);
    } else {
      std::tie(loss, lse) = cross_entropy_op().call(logits, target, weight, reduction, ignore_index, label_smoothing,
                                                    lse_square_scale, softcap);
    }
    ctx->save_for_backward({logits, target, weight.has_value() ? *weight : Tensor(), lse});
    // Not a saved variable: the backward takes it out (used once, handed
    // over or dropped before the backward op allocates its own).
    if (train) ctx->saved_data["dlogits"] = dlogits;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["lse_square_scale"] = lse_square_scale;
    ctx->saved_data["softcap"] = softcap;
    *lse_out = lse;
    return {loss};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &g = grads[0];
    Tensor fresh;  // the training forward's dlogits, taken out: used once
    if (auto it = ctx->saved_data.find("dlogits"); it != ctx->saved_data.end()) {
      fresh = it->second.toTensor();
      ctx->saved_data.erase(it);
    }
    if (fresh.defined() && concrete(g) && g.numel() == 1 && g.item<double>() == 1.0)
      return {once_differentiable(fresh, "cross_entropy"), {}, {}, {}, {}, {}, {}, {}, {}};
    fresh.reset();  // its memory back before the backward op takes its own
    const Opt weight = saved[2].defined() ? Opt(saved[2]) : std::nullopt;
    auto &d = ctx->saved_data;
    Tensor dlogits;
    {
      at::AutoGradMode no_grad(false);
      dlogits = cross_entropy_backward_op().call(
          grads[0].to(at::kFloat).contiguous(), saved[0], saved[1], weight, saved[3], d["reduction"].toInt(),
          d["ignore_index"].toInt(), d["label_smoothing"].toDouble(), d["lse_square_scale"].toDouble(),
          d["softcap"].toDouble());
    }
    return {once_differentiable(dlogits, "cross_entropy"), {}, {}, {}, {}, {}, {}, {}, {}};
  }
};

T2 cross_entropy(c10::DispatchKeySet ks, const Tensor &logits, const Tensor &target, const Opt &weight,
                 int64_t reduction, int64_t ignore_index, double label_smoothing, double lse_square_scale,
                 double softcap) {
  const Tensor none;
  const Tensor *w = weight.has_value() ? &*weight : &none;
  if (!recording("cross_entropy", {&logits, &target, w})) {
    Below guard;
    return cross_entropy_op().redispatch(ks & kBelow, logits, target, weight, reduction, ignore_index,
                                         label_smoothing, lse_square_scale, softcap);
  }
  Tensor lse;
  variable_list out = CrossEntropy::apply(logits, target, weight, reduction, ignore_index, label_smoothing,
                                          lse_square_scale, softcap, &lse);
  return {out[0], lse};
}

// ---------------------------------------------------------------------------
// Matmul and Linear: every product of the backward is npukern's matmul too,
// with the forward's math (dW = dy^T x summed over the tokens in f32, rounded
// once). A create_graph=True backward runs torch's products instead
// (differentiable).

// The gradients of c = op(a) op(b), each one matmul with the flags that read
// the stored operands as they are (no transposed copies).
T2 matmul_grads(const Tensor &dc, const Tensor &a, const Tensor &b, bool ta, bool tb, bool want_a, bool want_b,
                int64_t math) {
  const Tensor g = dc.scalar_type() == a.scalar_type() ? dc : dc.to(a.scalar_type());
  const auto mm = [math](const Tensor &x, const Tensor &y, bool tx, bool ty) {
    return matmul_op().call(x, y, tx, ty, std::nullopt, math);
  };
  Tensor da, db;
  if (want_a) da = ta ? mm(b, g, tb, true) : mm(g, b, false, !tb);
  if (want_b) db = tb ? mm(g, a, true, ta) : mm(a, g, !ta, false);
  return {da, db};
}

struct Matmul : Function<Matmul> {
  static variable_list forward(AutogradContext *ctx, const Tensor &a, const Tensor &b, bool ta, bool tb,
                               std::optional<at::ScalarType> out_dtype, int64_t math) {
    Below guard;
    Tensor c = matmul_op().call(a, b, ta, tb, out_dtype, math);
    ctx->save_for_backward({a, b});
    ctx->saved_data["ta"] = ta;
    ctx->saved_data["tb"] = tb;
    ctx->saved_data["math"] = math;
    return {c};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &a = saved[0], &b = saved[1], &dc = grads[0];
    const bool ta = ctx->saved_data["ta"].toBool(), tb = ctx->saved_data["tb"].toBool();
    if (building_graph({&dc, &a, &b})) {
      const Tensor g = dc.to(a.scalar_type());
      const Tensor A = ta ? a.t() : a, B = tb ? b.t() : b;
      Tensor dA = g.mm(B.t()), dB = A.t().mm(g);
      return {ta ? dA.t() : dA, tb ? dB.t() : dB, {}, {}, {}, {}};
    }
    auto [da, db] = matmul_grads(dc, a, b, ta, tb, ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                 ctx->saved_data["math"].toInt());
    return {da, db, {}, {}, {}, {}};
  }
};

Tensor matmul(c10::DispatchKeySet ks, const Tensor &a, const Tensor &b, bool ta, bool tb,
              std::optional<at::ScalarType> out_dtype, int64_t math) {
  if (!recording("matmul", {&a, &b})) {
    Below guard;
    return matmul_op().redispatch(ks & kBelow, a, b, ta, tb, out_dtype, math);
  }
  return Matmul::apply(a, b, ta, tb, out_dtype, math)[0];
}

struct Linear : Function<Linear> {
  static variable_list forward(AutogradContext *ctx, const Tensor &input, const Tensor &weight, const Opt &bias,
                               int64_t math) {
    Below guard;
    Tensor y = linear_op().call(input, weight, bias, math);
    ctx->save_for_backward({input, weight});
    ctx->saved_data["bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["math"] = math;
    return {y};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &input = saved[0], &weight = saved[1], &dy = grads[0];
    const int64_t in = weight.size(1), out = weight.size(0);
    const Tensor x = input.reshape({-1, in});
    const Tensor g = dy.reshape({-1, out});
    Tensor dx, dw, db;
    if (building_graph({&dy, &input, &weight})) {
      if (ctx->needs_input_grad(0)) dx = g.mm(weight).view(input.sizes());
      if (ctx->needs_input_grad(1)) dw = g.t().mm(x);
    } else {
      // dx = dy W (W as stored), dW = dy^T x (dy read transposed), with the
      // forward's math.
      const int64_t math = ctx->saved_data["math"].toInt();
      if (ctx->needs_input_grad(0))
        dx = matmul_op().call(g, weight, false, false, std::nullopt, math).view(input.sizes());
      if (ctx->needs_input_grad(1)) dw = matmul_op().call(g, x, true, false, std::nullopt, math);
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2))
      db = g.sum(0, false, at::kFloat).to(dy.scalar_type());
    return {dx, dw, db, {}};
  }
};

Tensor linear(c10::DispatchKeySet ks, const Tensor &input, const Tensor &weight, const Opt &bias, int64_t math) {
  const Tensor none;
  const Tensor *bp = bias.has_value() ? &*bias : &none;
  if (!recording("linear", {&input, &weight, bp})) {
    Below guard;
    return linear_op().redispatch(ks & kBelow, input, weight, bias, math);
  }
  return Linear::apply(input, weight, bias, math)[0];
}

// ---------------------------------------------------------------------------
// Attention: q, k, v differentiable; softmax_max / softmax_sum are not (as
// FlashAttentionScore's). The backward is npukern's attention_backward on
// the saved out and stats; it has no derivative of its own (no double
// backward: create_graph=True through it raises).

struct Attention : Function<Attention> {
  static variable_list forward(AutogradContext *ctx, const Tensor &q, const Tensor &k, const Tensor &v,
                               bool causal, std::optional<double> scale) {
    Below guard;
    auto [out, mx, sm] = attention_op().call(q, k, v, causal, scale);
    ctx->save_for_backward({q, k, v, out, mx, sm});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
    ctx->mark_non_differentiable({mx, sm});
    return {out, mx, sm};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    if (!grads[0].defined()) return {{}, {}, {}, {}, {}};
    if (building_graph({&grads[0], &q, &k, &v})) no_derivative("attention");
    const c10::IValue s = ctx->saved_data["scale"];
    const std::optional<double> scale = s.isNone() ? std::nullopt : std::optional<double>(s.toDouble());
    auto [dq, dk, dv] = attention_backward_op().call(grads[0], q, k, v, out, saved[4], saved[5],
                                                     ctx->saved_data["causal"].toBool(), scale);
    return {dq, dk, dv, {}, {}};
  }
};

T3 attention(c10::DispatchKeySet ks, const Tensor &q, const Tensor &k, const Tensor &v, bool causal,
             std::optional<double> scale) {
  if (!recording("attention", {&q, &k, &v})) {
    Below guard;
    return attention_op().redispatch(ks & kBelow, q, k, v, causal, scale);
  }
  variable_list out = Attention::apply(q, k, v, causal, scale);
  return {out[0], out[1], out[2]};
}

// Called directly with inputs that require grad: a node whose backward
// refuses (no derivative of its own).
struct AttentionBackward : Function<AttentionBackward> {
  static variable_list forward(AutogradContext *, const Tensor &dout, const Tensor &q, const Tensor &k,
                               const Tensor &v, const Tensor &out, const Tensor &mx, const Tensor &sm, bool causal,
                               std::optional<double> scale) {
    Below guard;
    auto [dq, dk, dv] = attention_backward_op().call(dout, q, k, v, out, mx, sm, causal, scale);
    return {dq, dk, dv};
  }

  static variable_list backward(AutogradContext *, variable_list) { no_derivative("attention_backward"); }
};

T3 attention_backward(c10::DispatchKeySet ks, const Tensor &dout, const Tensor &q, const Tensor &k, const Tensor &v,
                      const Tensor &out, const Tensor &mx, const Tensor &sm, bool causal,
                      std::optional<double> scale) {
  if (!recording("attention_backward", {&dout, &q, &k, &v, &out, &mx, &sm})) {
    Below guard;
    return attention_backward_op().redispatch(ks & kBelow, dout, q, k, v, out, mx, sm, causal, scale);
  }
  variable_list r = AttentionBackward::apply(dout, q, k, v, out, mx, sm, causal, scale);
  return {r[0], r[1], r[2]};
}

}  // namespace npk_torch::grad

TORCH_LIBRARY_IMPL(npukern, Autograd, m) {
  m.impl("attention_backward", TORCH_FN(npk_torch::grad::attention_backward));
  using namespace npk_torch::grad;
  m.impl("attention", TORCH_FN(attention));
  m.impl("matmul", TORCH_FN(matmul));
  m.impl("linear", TORCH_FN(linear));
  m.impl("rms_norm", TORCH_FN(rms_norm));
  m.impl("add_rms_norm", TORCH_FN(add_rms_norm));
  m.impl("add_rms_norm_", TORCH_FN(add_rms_norm_));
  m.impl("rms_norm_backward", TORCH_FN(rms_norm_backward));
  m.impl("add_rms_norm_backward", TORCH_FN(add_rms_norm_backward));
  m.impl("embedding", TORCH_FN(embedding));
  m.impl("embedding_shard", TORCH_FN(embedding_shard));
  m.impl("embedding_dense_backward", TORCH_FN(embedding_dense_backward));
  m.impl("embedding_dense_backward_shard", TORCH_FN(embedding_dense_backward_shard));
  m.impl("swiglu", TORCH_FN(swiglu));
  m.impl("swiglu_backward", TORCH_FN(swiglu_backward));
  m.impl("silu_mul", TORCH_FN(silu_mul));
  m.impl("silu_mul_backward", TORCH_FN(silu_mul_backward));
  m.impl("geglu", TORCH_FN(geglu));
  m.impl("geglu_backward", TORCH_FN(geglu_backward));
  m.impl("gelu_mul", TORCH_FN(gelu_mul));
  m.impl("gelu_mul_backward", TORCH_FN(gelu_mul_backward));
  m.impl("rotary_mul", TORCH_FN(rotary_mul));
  m.impl("rope_qk", TORCH_FN(rope_qk));
  m.impl("cross_entropy", TORCH_FN(cross_entropy));
}

TORCH_LIBRARY_IMPL(npukern, ADInplaceOrView, m) {
  m.impl("add_rms_norm_", TORCH_FN(npk_torch::grad::add_rms_norm_inplace_or_view));
}
