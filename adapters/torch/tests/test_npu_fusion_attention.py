"""``npukern_torch.npu.npu_fusion_attention`` (torch_npu's
FlashAttentionScore call): every input layout (BSH, SBH, BSND, BNSD) with
grouped key/value heads, the causal forms (``sparse_mode`` 2, 3, and 0 with
the triangular ``atten_mask`` or ``next_tockens=0``) on npukern's kernel,
other masks, bands, ``pse`` and bottom-right causal on the float32
composite, each against a float64 evaluation of FlashAttentionScore's
formula (normwise: 2^-18 in float32, 2^-7 in bfloat16); the outputs'
shapes (``softmax_max`` / ``softmax_sum`` ``[B, N, Sq, 8]``), gradients,
and what is refused."""

import pytest
import torch

import npukern_torch  # noqa: F401  (registers the ops)
import npukern_torch.npu as torch_npu

TOL = {torch.float32: 2.0**-18, torch.bfloat16: 2.0**-7}


def _layout(t, layout):
    """A BNSD tensor stored in ``layout``."""
    b, n, s, d = t.shape
    if layout == "BNSD":
        return t.clone()
    if layout == "BSND":
        return t.transpose(1, 2).contiguous()
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d).contiguous()
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d).contiguous()


def _reference(q, k, v, mask, scale, pse=None):
    """FlashAttentionScore's formula in float64 (BNSD; mask True = masked)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.double() @ k.transpose(-1, -2)
    if pse is not None:
        s = s + pse.double()
    s = s * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    return (e / e.sum(-1, keepdim=True)) @ v, m.squeeze(-1), e.sum(-1)


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def _inputs(dtype, b=2, n=4, nkv=2, sq=37, skv=37, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype) for shape in ((b, n, sq, d), (b, nkv, skv, d), (b, nkv, skv, d))]


def _called(monkeypatch):
    """Counts calls of the kernel op."""
    calls = []
    op = torch.ops.npukern.attention

    class Spy:
        def __call__(self, *a):
            calls.append(a)
            return op(*a)

    monkeypatch.setattr(torch.ops.npukern, "attention", Spy())
    return calls


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("form", ["mask", "sparse2", "sparse3", "next0", "none"])
def test_layouts_and_causal_forms_run_the_kernel(layout, dtype, form, monkeypatch):
    q4, k4, v4 = _inputs(dtype)
    sq = skv = q4.shape[2]
    tri = torch.ones(sq, skv, dtype=torch.bool).triu(1)
    kw = {"mask": {"atten_mask": tri}, "sparse2": {"atten_mask": tri, "sparse_mode": 2},
          "sparse3": {"atten_mask": tri, "sparse_mode": 3}, "next0": {"next_tockens": 0},
          "none": {}}[form]
    q, k, v = (_layout(t, layout).requires_grad_() for t in (q4, k4, v4))
    calls = _called(monkeypatch)
    out, mx, sm, so, seed, offset, numels = torch_npu.npu_fusion_attention(q, k, v, 4, layout, scale=0.25, **kw)
    assert len(calls) == 1, "the kernel takes every causal form and no mask"
    assert out.shape == q.shape and out.dtype == dtype
    assert mx.shape == sm.shape == (2, 4, sq, 8) and mx.dtype == torch.float32
    assert so.numel() == 0 and (seed, offset, numels) == (0, 0, 0)
    want, wm, ws = _reference(q4, k4, v4, None if form == "none" else tri, 0.25)
    assert _rel(out, _layout(want, layout)) <= TOL[dtype]
    assert torch.equal(mx[..., 0], mx[..., 7])
    assert _rel(mx[..., 0], wm) <= 2.0**-18 and _rel(sm[..., 0], ws) <= 2.0**-18
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


@pytest.mark.parametrize("case", ["random_mask", "band", "pse", "bottom_right"])
def test_other_masks_run_the_composite(case, monkeypatch):
    q, k, v = _inputs(torch.float32, sq=20, skv=29 if case == "bottom_right" else 20)
    sq, skv = q.shape[2], k.shape[2]
    g = torch.Generator().manual_seed(1)
    kw, mask, pse = {}, None, None
    if case == "random_mask":
        mask = torch.rand(sq, skv, generator=g) > 0.7
        mask[:, 0] = False
        kw = {"atten_mask": mask}
    elif case == "band":
        kw = {"pre_tockens": 3, "next_tockens": 0}
        i, j = torch.arange(sq).unsqueeze(1), torch.arange(skv).unsqueeze(0)
        mask = (j > i) | (j < i - 3)
    elif case == "pse":
        pse = torch.randn(1, 4, sq, skv, generator=g)
        kw = {"pse": pse}
    else:
        kw = {"sparse_mode": 3}
        mask = torch.ones(sq, skv, dtype=torch.bool).triu(1 + skv - sq)
    calls = _called(monkeypatch)
    out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.25, **kw)[0]
    assert not calls
    assert _rel(out, _reference(q, k, v, mask, 0.25, pse)[0]) <= 2.0**-18


def test_refused_forms():
    q, k, v = _inputs(torch.float32)
    with pytest.raises(NotImplementedError, match="TND"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "TND")
    with pytest.raises(NotImplementedError, match="sparse_mode"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", sparse_mode=7)
    with pytest.raises(ValueError, match="head_num"):
        torch_npu.npu_fusion_attention(q, k, v, 8, "BNSD")
