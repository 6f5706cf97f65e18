// The CPU kernels registered as npukern:: ops (register.cpp holds the schemas).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace npk_torch {

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor &x, const at::Tensor &gamma, double epsilon,
                                            double gamma_offset, bool cast_before_gamma);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor &dy, const at::Tensor &x,
                                                     const at::Tensor &gamma, const at::Tensor &rstd,
                                                     double gamma_offset);
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm(const at::Tensor &x1, const at::Tensor &x2,
                                                            const at::Tensor &gamma, double epsilon,
                                                            double gamma_offset, bool cast_before_gamma);
// x_sum written over x1 (IPEX's add_rms_norm with add_back): returns y, rstd.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_(at::Tensor &x1, const at::Tensor &x2, const at::Tensor &gamma,
                                                 double epsilon, double gamma_offset, bool cast_before_gamma);
std::tuple<at::Tensor, at::Tensor> add_rms_norm_backward(const at::Tensor &dy, const at::Tensor &x_sum,
                                                         const at::Tensor &gamma, const at::Tensor &rstd,
                                                         const at::Tensor &dx_sum, double gamma_offset);

at::Tensor embedding(const at::Tensor &weight, const at::Tensor &indices, int64_t padding_idx,
                     bool scale_grad_by_freq);
at::Tensor embedding_shard(const at::Tensor &weight, const at::Tensor &indices, int64_t num_embeddings,
                           int64_t vocab_start, int64_t padding_idx, bool scale_grad_by_freq);
at::Tensor embedding_dense_backward(const at::Tensor &grad, const at::Tensor &indices, int64_t num_weights,
                                    int64_t padding_idx, bool scale_grad_by_freq);
at::Tensor embedding_dense_backward_shard(const at::Tensor &grad, const at::Tensor &indices, int64_t num_weights,
                                          int64_t vocab_start, int64_t padding_idx, bool scale_grad_by_freq);

at::Tensor grad_stats(at::TensorList grads);
at::Tensor clip_grad_norm_(at::TensorList grads, double max_norm, bool error_if_nonfinite);
at::Tensor adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList masters, double lr,
                  double beta1, double beta2, double eps, double weight_decay, int64_t step, int64_t flags,
                  double max_grad_norm, double grad_scale, double found_inf, double clip_coef,
                  at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                  at::TensorList max_exp_avg_sq_scales, int64_t split_masters, int64_t rounding, int64_t seed,
                  at::IntArrayRef keys, int64_t quantized_moments, at::IntArrayRef q8_rows);

at::Tensor swiglu(const at::Tensor &x, int64_t dim, bool eager);
at::Tensor swiglu_backward(const at::Tensor &dy, const at::Tensor &x, int64_t dim, bool eager);
at::Tensor silu_mul(const at::Tensor &gate, const at::Tensor &up, bool eager);
std::tuple<at::Tensor, at::Tensor> geglu(const at::Tensor &x, int64_t dim, int64_t approximate, bool activate_left,
                                         bool eager);
at::Tensor geglu_backward(const at::Tensor &dy, const at::Tensor &x, int64_t dim, int64_t approximate,
                          bool activate_left, bool eager);
at::Tensor gelu_mul(const at::Tensor &gate, const at::Tensor &up, int64_t approximate, bool eager);
std::tuple<at::Tensor, at::Tensor> gelu_mul_backward(const at::Tensor &dy, const at::Tensor &gate,
                                                     const at::Tensor &up, int64_t approximate, bool eager);
std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor &dy, const at::Tensor &gate,
                                                     const at::Tensor &up, bool eager);
at::Tensor rotary_mul(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin, bool eager, bool backward);
std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor &q, const at::Tensor &k, const at::Tensor &cos,
                                           const at::Tensor &sin, bool eager, bool backward);

std::tuple<at::Tensor, at::Tensor> cross_entropy(const at::Tensor &logits, const at::Tensor &target,
                                                 const std::optional<at::Tensor> &weight, int64_t reduction,
                                                 int64_t ignore_index, double label_smoothing,
                                                 double lse_square_scale, double softcap);
at::Tensor cross_entropy_backward(const at::Tensor &grad, const at::Tensor &logits, const at::Tensor &target,
                                  const std::optional<at::Tensor> &weight, const at::Tensor &lse, int64_t reduction,
                                  int64_t ignore_index, double label_smoothing, double lse_square_scale,
                                  double softcap);
std::tuple<at::Tensor, at::Tensor> cross_entropy_fused_(at::Tensor &logits, const at::Tensor &target,
                                                        const std::optional<at::Tensor> &weight,
                                                        const at::Tensor &grad_scale, int64_t ignore_index,
                                                        double label_smoothing, double lse_square_scale,
                                                        double softcap);
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_train(
    const at::Tensor &logits, const at::Tensor &target, const std::optional<at::Tensor> &weight, int64_t reduction,
    int64_t ignore_index, double label_smoothing, double lse_square_scale, double softcap);

// The reduction of per-row losses and the gradient factor, as the crate
// defines them (npk_cross_entropy_reduce / npk_cross_entropy_grad_scale).
at::Tensor cross_entropy_reduce(const at::Tensor &loss_rows, const at::Tensor &target,
                                const std::optional<at::Tensor> &weight, int64_t reduction, int64_t ignore_index);
at::Tensor cross_entropy_grad_scale(const at::Tensor &target, const std::optional<at::Tensor> &weight,
                                    int64_t reduction, int64_t ignore_index, double grad);

// math: an npk_matmul_math (0 the FMA chain, 1 the bf16 pair dot).
at::Tensor matmul(const at::Tensor &a, const at::Tensor &b, bool trans_a, bool trans_b,
                  std::optional<at::ScalarType> out_dtype, int64_t math);
void matmul_accumulate_(at::Tensor &c, const at::Tensor &a, const at::Tensor &b, bool trans_a, bool trans_b,
                        int64_t math);
at::Tensor linear(const at::Tensor &input, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                  int64_t math);

// Attention (SDPA without mask or dropout): out, softmax_max, softmax_sum;
// its backward: dq, dk, dv. scale: SDPA's (None: 1 / sqrt(head_dim)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention(const at::Tensor &q, const at::Tensor &k,
                                                         const at::Tensor &v, bool is_causal,
                                                         std::optional<double> scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &out,
    const at::Tensor &softmax_max, const at::Tensor &softmax_sum, bool is_causal, std::optional<double> scale);

}  // namespace npk_torch
