"""Forward-mode AD: no npukern op has a jvp formula, so a tangent on any
input is refused with NotImplementedError -- also when the primal does not
require grad (``torch.func.jvp``'s inputs, ``make_dual`` of a plain
tensor), where the op used to run below autograd and return outputs
without tangents, which ``jvp`` reads as zeros."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import npukern_torch
from npukern_torch import functional as F

ops = torch.ops.npukern


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


def samples():
    """(name, op, args, the index of a float tensor argument to make dual)."""
    idx = torch.tensor([[0, 3, 3], [5, 1, 3]])
    cos, sin = _r(1, 5, 8), _r(1, 5, 8)
    q, k, v = _r(1, 2, 5, 8), _r(1, 2, 5, 8), _r(1, 2, 5, 8)
    out, mx, sm = ops.attention(q, k, v, True)
    return [
        ("rms_norm", ops.rms_norm, (_r(4, 8), _r(8), 1e-6), 0),
        ("rms_norm gamma", ops.rms_norm, (_r(4, 8), _r(8), 1e-6), 1),
        ("add_rms_norm", ops.add_rms_norm, (_r(4, 8), _r(4, 8), _r(8)), 1),
        ("add_rms_norm_", ops.add_rms_norm_, (_r(4, 8), _r(4, 8), _r(8)), 2),
        ("embedding", ops.embedding, (_r(6, 5), idx), 0),
        ("embedding_shard", ops.embedding_shard, (_r(3, 5), idx, 6, 2), 0),
        ("embedding_dense_backward", ops.embedding_dense_backward, (_r(2, 3, 7), idx, 6, -1, False), 0),
        ("embedding_dense_backward_shard", ops.embedding_dense_backward_shard,
         (_r(2, 3, 7), idx, 4, 2, -1, False), 0),
        ("rms_norm_backward", ops.rms_norm_backward, (_r(4, 8), _r(4, 8), _r(8), _r(4, 1).abs()), 0),
        ("add_rms_norm_backward", ops.add_rms_norm_backward,
         (_r(4, 8), _r(4, 8), _r(8), _r(4, 1).abs(), _r(4, 8)), 4),
        ("swiglu", ops.swiglu, (_r(3, 8),), 0),
        ("swiglu_backward", ops.swiglu_backward, (_r(3, 4), _r(3, 8)), 1),
        ("silu_mul", ops.silu_mul, (_r(3, 4), _r(3, 4)), 1),
        ("silu_mul_backward", ops.silu_mul_backward, (_r(3, 4), _r(3, 4), _r(3, 4)), 0),
        ("geglu", ops.geglu, (_r(3, 8),), 0),
        ("geglu_backward", ops.geglu_backward, (_r(3, 4), _r(3, 8)), 0),
        ("gelu_mul", ops.gelu_mul, (_r(3, 4), _r(3, 4)), 0),
        ("gelu_mul_backward", ops.gelu_mul_backward, (_r(3, 4), _r(3, 4), _r(3, 4)), 2),
        ("rotary_mul", ops.rotary_mul, (_r(1, 5, 2, 8), cos.unsqueeze(2), sin.unsqueeze(2)), 0),
        ("rotary_mul cos", ops.rotary_mul, (_r(1, 5, 2, 8), cos.unsqueeze(2), sin.unsqueeze(2)), 1),
        ("rope_qk", ops.rope_qk, (_r(1, 2, 5, 8), _r(1, 2, 5, 8), cos.unsqueeze(1), sin.unsqueeze(1)), 1),
        ("cross_entropy", ops.cross_entropy, (_r(3, 7), torch.tensor([0, 6, 2])), 0),
        ("matmul", ops.matmul, (_r(5, 7), _r(7, 3)), 1),
        ("linear", ops.linear, (_r(2, 8), _r(5, 8), _r(5)), 2),
        ("attention", ops.attention, (q, k, v, True), 2),
        ("attention_backward", ops.attention_backward, (_r(1, 2, 5, 8), q, k, v, out, mx, sm, True), 0),
    ]


NAMES = [s[0] for s in samples()]


def _dual_call(op, args, i, requires_grad):
    args = list(args)
    primal = args[i].clone().requires_grad_(requires_grad)
    with fwAD.dual_level():
        args[i] = fwAD.make_dual(primal, torch.ones_like(primal))
        return op(*args)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_tangent_is_refused(name, requires_grad):
    _, op, args, i = samples()[NAMES.index(name)]
    if name == "add_rms_norm_" and requires_grad:
        # In place on a leaf requiring grad: torch's own rule refuses first.
        args = list(args)
        args[0] = args[0].clone()
    with pytest.raises(NotImplementedError, match="forward-mode"):
        _dual_call(op, args, i, requires_grad)


def test_without_a_tangent_the_ops_run_under_a_dual_level():
    # A dual level alone (no dual input) changes nothing.
    x, g = _r(4, 8), _r(8)
    with fwAD.dual_level():
        y = ops.rms_norm(x, g, 1e-6)[0]
    torch.testing.assert_close(y, ops.rms_norm(x, g, 1e-6)[0], rtol=0, atol=0)


def test_func_jvp_is_refused_not_zero():
    # torch.func.jvp's inputs do not require grad: it read the missing
    # tangents as zeros.
    x, g = _r(4, 8), _r(8)
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda t: F.rms_norm(t, g), (x,), (torch.ones_like(x),))
    w = _r(5, 8)
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda t: F.linear(t, w), (x,), (torch.ones_like(x),))
    # A module's parameters as the tangent's primals (torch.func.functional_call).
    norm = npukern_torch.RMSNorm(8)
    params = dict(norm.named_parameters())
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda p: torch.func.functional_call(norm, p, (x,)), (params,),
                       ({k: torch.ones_like(t) for k, t in params.items()},))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_the_fused_linear_loss_refuses_a_tangent(requires_grad):
    # A Python autograd.Function without jvp: torch refuses for it (and
    # torch.func's transforms refuse it for want of setup_context).
    h, w, t = _r(4, 8), _r(11, 8), torch.tensor([1, 0, 10, 3])
    with pytest.raises(NotImplementedError, match="jvp"):
        _dual_call(lambda x: npukern_torch.linear_cross_entropy(x, w, t), (h,), 0, requires_grad)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.jvp(lambda x: npukern_torch.linear_cross_entropy(x, w, t), (h,), (torch.ones_like(h),))
