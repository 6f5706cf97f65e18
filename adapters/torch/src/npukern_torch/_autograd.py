"""The Python half of the ops' autograd. The formulas themselves are C++
(``csrc/autograd.cpp``, registered at the Autograd key when ``_C`` loads):
each forward saves what its backward op needs (x or x_sum, gamma, rstd; the
indices), the backward calls npukern's backward op, and a call with nothing
requiring grad goes straight to the kernel (no graph node, no Python). rstd
and lse are auxiliary outputs and not differentiable (as in torch_npu).

Double backward: with ``create_graph=True`` the backward of the norms,
SwiGLU (``swiglu``, ``silu_mul``), GeGLU (``geglu``, ``gelu_mul``) and RoPE (``rotary_mul``, ``rope_qk``,
with or without cos/sin gradients) runs a differentiable float32 torch
composite (``_composite.py``); the embedding's backward op is linear in its
gradient and has its own derivative (a lookup). The C++ backward reaches
these composites through the dispatcher as the ``npukern::_*_composite``
ops (schemas in ``csrc/register.cpp``), whose CompositeImplicitAutograd
implementations, registered here, decompose into differentiable aten ops
(under torch.compile too). The backward ops called directly have no
derivative and say so."""

import torch

from . import _composite

_lib = torch.library.Library("npukern", "IMPL")


def _composite_impl(name):
    def register(fn):
        _lib.impl(name, fn, "CompositeImplicitAutograd")
        return fn

    return register


@_composite_impl("_rms_norm_grads_composite")
def _rms_norm_grads(dy, x, gamma, eps, offset, dx_extra):
    return _composite.rms_norm_grads(dy, x, gamma, eps, offset, dx_extra)


@_composite_impl("_silu_mul_grads_composite")
def _silu_mul_grads(dy, gate, up):
    return _composite.silu_mul_grads(dy, gate, up)


@_composite_impl("_swiglu_grad_composite")
def _swiglu_grad(dy, x, dim):
    return _composite.swiglu_grad(dy, x, dim)


@_composite_impl("_gelu_mul_grads_composite")
def _gelu_mul_grads(dy, gate, up, approximate):
    return _composite.gelu_mul_grads(dy, gate, up, approximate)


@_composite_impl("_geglu_grad_composite")
def _geglu_grad(dy, x, dim, approximate, activate_left):
    return _composite.geglu_grad(dy, x, dim, approximate, activate_left)


@_composite_impl("_rotary_dx_composite")
def _rotary_dx(g, cos, sin, backward, like):
    return _composite.rotary_dx(g, cos, sin, backward, like)


@_composite_impl("_rotary_table_grads_composite")
def _rotary_table_grads(gs, xs, cos, sin, backward):
    """``(dcos, dsin)`` summed over the (gradient, input) pairs (q, and k)."""
    parts = [_composite.rotary_table_grads(g, x, cos, sin, backward) for g, x in zip(gs, xs)]
    return sum(p[0] for p in parts).to(cos.dtype), sum(p[1] for p in parts).to(sin.dtype)


@_composite_impl("_embedding_grad_of_grad_composite")
def _embedding_grad_of_grad(ggw, indices, vocab_start, padding_idx, scale_grad_by_freq, grad_dtype):
    return _composite.embedding_grad_of_grad(ggw, indices, vocab_start, padding_idx, scale_grad_by_freq, grad_dtype)
