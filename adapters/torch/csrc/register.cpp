// The npukern:: op library: schemas (torch_npu's where it has them), the CPU
// kernels, and the Python module stub that loading the package imports.
// The autograd formulas are in autograd.cpp; fake (meta) implementations and
// the double-backward composites are registered from Python
// (npukern_torch/_meta.py, npukern_torch/_autograd.py).
#include <Python.h>
#include <torch/library.h>

#include "fast_call.h"
#include "npukern.h"
#include "ops.h"

TORCH_LIBRARY(npukern, m) {
  // torch_npu's schemas, extended with defaulted arguments: gamma_offset
  // (y = x * rstd * (gamma + offset): 1.0 is Gemma's) and cast_before_gamma
  // (y = round(round(x * rstd) * gamma): Hugging Face Llama's bits).
  m.def("rms_norm(Tensor x, Tensor gamma, float epsilon=1e-06, float gamma_offset=0.0, "
        "bool cast_before_gamma=False) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor dy, Tensor x, Tensor gamma, Tensor rstd, float gamma_offset=0.0) -> "
        "(Tensor, Tensor)");
  m.def("add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06, float gamma_offset=0.0, "
        "bool cast_before_gamma=False) -> (Tensor, Tensor, Tensor)");
  // IPEX's add_rms_norm(residual, x, ..., add_back=True): x1 + x2 (x_sum) is
  // written over x1; y and rstd are add_rms_norm's, bit for bit.
  m.def("add_rms_norm_(Tensor(a!) x1, Tensor x2, Tensor gamma, float epsilon=1e-06, float gamma_offset=0.0, "
        "bool cast_before_gamma=False) -> (Tensor, Tensor)");
  // AddRmsNorm's backward: RmsNormGrad of x_sum with the residual gradient
  // dx_sum added to dx in the same pass (dx is the gradient of x1 and x2).
  m.def("add_rms_norm_backward(Tensor dy, Tensor x_sum, Tensor gamma, Tensor rstd, Tensor dx_sum, "
        "float gamma_offset=0.0) -> (Tensor, Tensor)");
  m.def("embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool scale_grad_by_freq=False) -> Tensor");
  m.def("embedding_shard(Tensor weight, Tensor indices, SymInt num_embeddings, SymInt vocab_start, "
        "SymInt padding_idx=-1, bool scale_grad_by_freq=False) -> Tensor");
  m.def("embedding_dense_backward(Tensor grad, Tensor indices, SymInt num_weights, SymInt padding_idx, "
        "bool scale_grad_by_freq) -> Tensor");
  m.def("embedding_dense_backward_shard(Tensor grad, Tensor indices, SymInt num_weights, SymInt vocab_start, "
        "SymInt padding_idx, bool scale_grad_by_freq) -> Tensor");
  // torch_npu's npu_swiglu / npu_swiglu_backward, with `eager` (silu rounded
  // to x's dtype before the product: eager PyTorch's bits); silu_mul is the
  // two-tensor form (Hugging Face's act_fn(gate) * up).
  m.def("swiglu(Tensor x, int dim=-1, bool eager=False) -> Tensor");
  m.def("swiglu_backward(Tensor grad_output, Tensor x, int dim=-1, bool eager=False) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up, bool eager=False) -> Tensor");
  m.def("silu_mul_backward(Tensor grad_output, Tensor gate, Tensor up, bool eager=False) -> (Tensor, Tensor)");
  // torch_npu's npu_geglu (y and gelu(gate); approximate 0 erf, 1 tanh;
  // activate_left false: the gate is x's second half) and its backward, with
  // `eager` (gelu rounded to x's dtype before the product); gelu_mul is the
  // two-tensor form (Gemma's act_fn(gate) * up).
  m.def("geglu(Tensor x, int dim=-1, int approximate=1, bool activate_left=False, bool eager=False) -> "
        "(Tensor, Tensor)");
  m.def("geglu_backward(Tensor grad_output, Tensor x, int dim=-1, int approximate=1, bool activate_left=False, "
        "bool eager=False) -> Tensor");
  m.def("gelu_mul(Tensor gate, Tensor up, int approximate=1, bool eager=False) -> Tensor");
  m.def("gelu_mul_backward(Tensor grad_output, Tensor gate, Tensor up, int approximate=1, bool eager=False) -> "
        "(Tensor, Tensor)");
  // torch_npu's npu_rotary_mul(x, r1, r2) (rotate-half), and q and k in one
  // call (Hugging Face's apply_rotary_pos_emb); `backward` runs the
  // transposed rotation (the input gradient).
  m.def("rotary_mul(Tensor x, Tensor r1, Tensor r2, bool eager=False, bool backward=False) -> Tensor");
  m.def("rope_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, bool eager=False, bool backward=False) -> "
        "(Tensor, Tensor)");
  // CrossEntropy: F.cross_entropy's options (reduction 0 none, 1 sum, 2
  // mean; label smoothing) plus z-loss (lse_square_scale) and logit
  // soft-capping (softcap, 0 = off); the forward also returns the per-row
  // log-sum-exp. The fused form writes dlogits over the logits (scaled per
  // row or by one grad_scale) and returns the per-row loss and lse.
  m.def("cross_entropy(Tensor logits, Tensor target, Tensor? weight=None, int reduction=2, "
        "int ignore_index=-100, float label_smoothing=0.0, float lse_square_scale=0.0, float softcap=0.0) -> "
        "(Tensor, Tensor)");
  m.def("cross_entropy_backward(Tensor grad, Tensor logits, Tensor target, Tensor? weight, Tensor lse, "
        "int reduction=2, int ignore_index=-100, float label_smoothing=0.0, float lse_square_scale=0.0, "
        "float softcap=0.0) -> Tensor");
  // The training forward: the reduced loss and lse of cross_entropy (the
  // same bits) and, in the same pass over the logits, dlogits for an
  // upstream gradient of 1 (reduction 1 sum or 2 mean): what the autograd
  // formula runs when the logits require grad.
  m.def("cross_entropy_train(Tensor logits, Tensor target, Tensor? weight=None, int reduction=2, "
        "int ignore_index=-100, float label_smoothing=0.0, float lse_square_scale=0.0, float softcap=0.0) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("cross_entropy_fused_(Tensor(a!) logits, Tensor target, Tensor? weight, Tensor grad_scale, "
        "int ignore_index=-100, float label_smoothing=0.0, float lse_square_scale=0.0, float softcap=0.0) -> "
        "(Tensor, Tensor)");
  // The reduction of per-row losses (a 0-dim float32: reduction 1 sum, 2
  // mean) and the factor dlogits get from an upstream gradient `grad` of it:
  // the crate's one definition, for callers that run rows in chunks.
  m.def("cross_entropy_reduce(Tensor loss_rows, Tensor target, Tensor? weight=None, int reduction=2, "
        "int ignore_index=-100) -> Tensor");
  m.def("cross_entropy_grad_scale(Tensor target, Tensor? weight=None, int reduction=2, int ignore_index=-100, "
        "float grad=1.0) -> Tensor");
  // The differentiable float32 composites the autograd formulas
  // (autograd.cpp) run for double backward and for the RoPE tables'
  // gradients: CompositeImplicitAutograd implementations registered from
  // Python (npukern_torch/_autograd.py, over npukern_torch/_composite.py).
  m.def("_rms_norm_grads_composite(Tensor dy, Tensor x, Tensor gamma, float eps, float offset, Tensor? dx_extra) "
        "-> (Tensor, Tensor)");
  m.def("_silu_mul_grads_composite(Tensor dy, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("_swiglu_grad_composite(Tensor dy, Tensor x, int dim) -> Tensor");
  m.def("_gelu_mul_grads_composite(Tensor dy, Tensor gate, Tensor up, int approximate) -> (Tensor, Tensor)");
  m.def("_geglu_grad_composite(Tensor dy, Tensor x, int dim, int approximate, bool activate_left) -> Tensor");
  m.def("_rotary_dx_composite(Tensor g, Tensor cos, Tensor sin, bool backward, Tensor like) -> Tensor");
  m.def("_rotary_table_grads_composite(Tensor[] g, Tensor[] x, Tensor cos, Tensor sin, bool backward) -> "
        "(Tensor, Tensor)");
  m.def("_embedding_grad_of_grad_composite(Tensor ggw, Tensor indices, SymInt vocab_start, SymInt padding_idx, "
        "bool scale_grad_by_freq, ScalarType grad_dtype) -> Tensor");
  m.def("grad_stats(Tensor[] grads) -> Tensor");
  m.def("clip_grad_norm_(Tensor(a!)[] grads, float max_norm, bool error_if_nonfinite=False) -> Tensor");
  m.def("adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] masters, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, int step, int flags, float max_grad_norm, float grad_scale, float found_inf, "
        "float clip_coef, Tensor(f!)[] exp_avg_scales, Tensor(g!)[] exp_avg_sq_scales, "
        "Tensor(h!)[] max_exp_avg_sq_scales, int split_masters=0, int rounding=0, int seed=0, int[] keys=[], "
        "int quantized_moments=0, int[] q8_rows=[]) -> Tensor");
  // aclnnMatmul: c = op(a) op(b) (f32 FMA chains, k ascending, one rounding;
  // c in a's dtype or float32); the accumulating form adds into a float32 c
  // (a weight gradient's sums across micro-batches). linear is F.linear on
  // it, its backward's dx and dW the same matmul. math (aclnnMatmul's
  // cubeMathType; npk_matmul_math): 0 the FMA chain, 1 the bf16 pair dot
  // (VDPBF16PS's sums; bfloat16 operands only).
  m.def("matmul(Tensor a, Tensor b, bool trans_a=False, bool trans_b=False, ScalarType? out_dtype=None, "
        "int math=0) -> Tensor");
  m.def("matmul_accumulate_(Tensor(a!) c, Tensor a, Tensor b, bool trans_a=False, bool trans_b=False, "
        "int math=0) -> ()");
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None, int math=0) -> Tensor");
  // aclnnFlashAttentionScore / its Grad: SDPA without a mask or dropout
  // (causal or not, grouped-query heads: k and v may have fewer heads
  // dividing q's), f32 inside, each sum in one fixed order. The forward's
  // softmax_max / softmax_sum ([B, H, S] float32) are what the backward reads.
  m.def("attention(Tensor q, Tensor k, Tensor v, bool is_causal=False, float? scale=None) -> "
        "(Tensor out, Tensor softmax_max, Tensor softmax_sum)");
  m.def("attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_max, "
        "Tensor softmax_sum, bool is_causal=False, float? scale=None) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(npukern, CPU, m) {
  m.impl("rms_norm", &npk_torch::rms_norm);
  m.impl("rms_norm_backward", &npk_torch::rms_norm_backward);
  m.impl("add_rms_norm", &npk_torch::add_rms_norm);
  m.impl("add_rms_norm_", &npk_torch::add_rms_norm_);
  m.impl("add_rms_norm_backward", &npk_torch::add_rms_norm_backward);
  m.impl("embedding", &npk_torch::embedding);
  m.impl("embedding_shard", &npk_torch::embedding_shard);
  m.impl("embedding_dense_backward", &npk_torch::embedding_dense_backward);
  m.impl("embedding_dense_backward_shard", &npk_torch::embedding_dense_backward_shard);
  m.impl("grad_stats", &npk_torch::grad_stats);
  m.impl("clip_grad_norm_", &npk_torch::clip_grad_norm_);
  m.impl("adamw_", &npk_torch::adamw_);
  m.impl("matmul", &npk_torch::matmul);
  m.impl("matmul_accumulate_", &npk_torch::matmul_accumulate_);
  m.impl("linear", &npk_torch::linear);
  m.impl("attention", &npk_torch::attention);
  m.impl("attention_backward", &npk_torch::attention_backward);
  m.impl("swiglu", &npk_torch::swiglu);
  m.impl("swiglu_backward", &npk_torch::swiglu_backward);
  m.impl("silu_mul", &npk_torch::silu_mul);
  m.impl("silu_mul_backward", &npk_torch::silu_mul_backward);
  m.impl("geglu", &npk_torch::geglu);
  m.impl("geglu_backward", &npk_torch::geglu_backward);
  m.impl("gelu_mul", &npk_torch::gelu_mul);
  m.impl("gelu_mul_backward", &npk_torch::gelu_mul_backward);
  m.impl("rotary_mul", &npk_torch::rotary_mul);
  m.impl("rope_qk", &npk_torch::rope_qk);
  m.impl("cross_entropy", &npk_torch::cross_entropy);
  m.impl("cross_entropy_backward", &npk_torch::cross_entropy_backward);
  m.impl("cross_entropy_fused_", &npk_torch::cross_entropy_fused_);
  m.impl("cross_entropy_train", &npk_torch::cross_entropy_train);
  m.impl("cross_entropy_reduce", &npk_torch::cross_entropy_reduce);
  m.impl("cross_entropy_grad_scale", &npk_torch::cross_entropy_grad_scale);
}

// The list ops also serve an empty list (the dispatcher finds no tensor to
// pick a backend by, and then runs the CompositeExplicitAutograd kernel): the
// same functions give the defined result -- zero sums and counts, a norm of 0.
// A non-empty list of non-CPU tensors reaches them too and gets their error.
TORCH_LIBRARY_IMPL(npukern, CompositeExplicitAutograd, m) {
  m.impl("grad_stats", &npk_torch::grad_stats);
  m.impl("clip_grad_norm_", &npk_torch::clip_grad_norm_);
  m.impl("adamw_", &npk_torch::adamw_);
}

namespace {

PyObject *version(PyObject *, PyObject *) { return PyUnicode_FromString(npk_version()); }

PyObject *detected_isa(PyObject *, PyObject *) {
  return PyUnicode_FromString(npk_isa_name(npk_detected_isa()));
}

PyMethodDef methods[] = {
    {"version", version, METH_NOARGS, "The linked npukern library's version."},
    {"detected_isa", detected_isa, METH_NOARGS, "The SIMD ISA npukern picks on this CPU."},
    {"fast_op", npk_torch::fast_op, METH_VARARGS,
     "fast_op(overload, name, overload_name, parameter_type): the overload's eager caller, or None."},
    {"rms_norm_module", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(npk_torch::rms_norm_module)),
     METH_FASTCALL, "rms_norm_module(x, gamma, eps, offset, cast_before_gamma): RMSNorm's y, or NotImplemented."},
    {"add_rms_norm_module",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(npk_torch::add_rms_norm_module)), METH_FASTCALL,
     "add_rms_norm_module(x, residual, gamma, eps, offset, cast_before_gamma): AddRMSNorm's (y, x_sum), or "
     "NotImplemented."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "npukern's ops, registered under torch.ops.npukern.", -1,
                      methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

// Importing npukern_torch._C loads this library, which runs the TORCH_LIBRARY
// registrations above.
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
