"""npukern's Attention through PyTorch: ``npukern::attention`` /
``attention_backward`` (SDPA without a mask or dropout, causal or not,
grouped-query heads) against the float64 reference, forward and the three
gradients, in float32, bfloat16 and float16; BNSD, BSND (the per-head
views of ``[B, S, H, D]`` projections, read in place, outputs of the same
strides) and other strided inputs, with the same bits; the same bits on 1,
2 and 3 threads; the softmax statistics; errors and the refused double
backward; ``functional.scaled_dot_product_attention``'s fallbacks to torch's
SDPA; the route's rule; ``torch.compile``; and ``hf.patch(attention=...)``
on tiny Llama, Qwen2 and Mistral models with grouped-query heads.

The reference: torch's SDPA math (softmax(scale q k^T, top-left causal
mask) v) in float64 on the same dtype-rounded inputs, k and v
repeat_interleave'd to q's heads, its gradients by float64 autograd. The
error of a result is normwise, ``||got - ref|| / ||ref||`` (absolute where
the reference is all zeros: a single key's dq and dk).

Bounds (measured worst on these shapes in brackets; the suite's summary
quotes them):
- float32: 2^-18 (3.8e-6) [~5.6e-7; ~7e-7 at 512 tokens]: every sum in
  float32, dk and dv summed over a group's heads and rows in one order.
- bfloat16: 2^-8 (3.9e-3, one ulp at 1) for out and dv [~2.1e-3];
  float16: 2^-11 (4.9e-4) [~2.7e-4]: about 0.9 of the dtype's unit
  roundoff, the output's own rounding (the inside is float32). dq and dk
  three times that, 1.2e-2 and 1.5e-3 [5.9e-3 and 5.3e-4, on 7 causal
  rows with scale 0.5]: the backward's ``D_i = sum(dout_i * out_i)``
  reads the out rounded to the dtype, and ``dP - D`` cancels where a
  row's softmax is peaked or sees few keys (torch's: 5.8e-3 and 5.5e-4
  there, the same).
- Against torch's own SDPA in the same dtype (CPU flash attention, with
  ``enable_gqa``): npukern's error at most 2x torch's in bfloat16 and
  float16 (measured 0.3-1.0x: torch rounds more inside, but for dq and
  dk on the peaked rows above, where both are the rounded out's), 3x in
  float32 (measured up to 1.8x, dk and dv of 200 rows and 4 heads a kv
  head: npukern sums them over the group's heads and rows in one order).
- Softmax statistics: ``softmax_max`` is the row's max of ``scale q k^T``
  within float32 accumulation's bound ``(D + 1) 2^-24 scale sum |q| |k|``;
  ``softmax_sum`` is ``sum_j exp(scale s_j - max)`` within 1e-5 relative.
- Hugging Face: the patched model's loss within 2^-8 relative of the stock
  and the attention=False one's in bfloat16 (measured ~6e-5), 1e-5 in
  float32 (measured 1e-7); gradients normwise within 5e-2 of the
  attention=False model's in bfloat16 (measured 1.1e-2: bfloat16 roundings
  flipped through two layers), 1e-5 in float32 (measured 7e-7)."""

import pickle

import pytest
import torch

import npukern_torch  # noqa: F401  (registers torch.ops.npukern)
from conftest import copied, record
from npukern_torch import functional as F
from npukern_torch import route

ops = torch.ops.npukern
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
BOUND = {torch.float32: 2.0**-18, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# dq and dk: three times the bound in bfloat16 and float16 (the rounded out in D, see above).
QK = {torch.float32: 1.0, torch.bfloat16: 3.0, torch.float16: 3.0}
TORCH_RATIO = {torch.float32: 3.0, torch.bfloat16: 2.0, torch.float16: 2.0}

# (batch, heads, kv heads, query rows, key rows, head_dim, causal, scale):
# grouped (2 and 4 heads a kv head) and plain heads; odd head_dims; 1 row,
# the forward's 84-row blocks and one past, 200 rows (three blocks); fewer
# and more queries than keys, causal (top-left) or not.
CASES = {
    "gqa2-s100-d20-causal": (2, 4, 2, 100, 100, 20, True, None),
    "mqa-s7-d33": (1, 4, 1, 7, 7, 33, False, None),
    "mqa-s7-d33-causal-scale": (2, 4, 1, 7, 7, 33, True, 0.5),
    "mha-sq7-skv50-d64": (1, 4, 4, 7, 50, 64, False, None),
    "mha-sq50-skv7-d16": (2, 4, 4, 50, 7, 16, False, None),
    "gqa2-sq9-skv13-d20-causal": (1, 4, 2, 9, 13, 20, True, None),
    "mha-sq13-skv9-d20-causal": (1, 4, 4, 13, 9, 20, True, 0.3),
    "gqa2-sq100-skv37-d24-causal": (1, 4, 2, 100, 37, 24, True, None),
    "mqa-sq37-skv100-d24-causal": (1, 4, 1, 37, 100, 24, True, None),
    "gqa2-s1-d16-causal": (1, 4, 2, 1, 1, 16, True, None),
    "gqa2-s85-d8": (1, 4, 2, 85, 85, 8, False, None),
    "mqa-s200-d33-causal": (1, 4, 1, 200, 200, 33, True, None),
}
LAYOUTS = ["bnsd", "bsnd", "strided"]


def _r(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _reference(q, k, v, causal, scale=None):
    """torch's SDPA math on float64 q [B, H, Sq, D], k, v [B, Hkv, Skv, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def _rel(got, want):
    """Normwise relative error of got against the float64 want (absolute where want is all zeros)."""
    err = (got.double() - want).norm().item()
    den = want.norm().item()
    return err / den if den > 0 else err


def _inputs(case, dtype):
    b, h, hkv, sq, skv, d, _, _ = case
    return (_r(b, h, sq, d, dtype=dtype, seed=1), _r(b, hkv, skv, d, dtype=dtype, seed=2),
            _r(b, hkv, skv, d, dtype=dtype, seed=3), _r(b, h, sq, d, dtype=dtype, seed=4))


def _leaf(t, layout):
    """(leaf requiring grad, the [B, H, S, D] view of it the op reads, its grad as BNSD)."""
    if layout == "bnsd":
        leaf = t.clone().requires_grad_()
        return leaf, leaf, lambda: leaf.grad
    if layout == "bsnd":  # x.view(B, S, H, D).transpose(1, 2): a projection's per-head view
        leaf = t.transpose(1, 2).contiguous().requires_grad_()
        return leaf, leaf.transpose(1, 2), lambda: leaf.grad.transpose(1, 2)
    # A row stride of D + 3: neither BNSD nor BSND (copied).
    leaf = torch.cat([t, t[..., :3]], -1).detach().requires_grad_()
    d = t.shape[-1]
    return leaf, leaf[..., :d], lambda: leaf.grad[..., :d]


def _run(q, k, v, dout, causal, scale, layout):
    """(out, softmax_max, softmax_sum, dq, dk, dv) of the op on inputs in `layout`, grads by autograd."""
    leaves = [_leaf(t, layout) for t in (q, k, v)]
    out, mx, sm = ops.attention(*(view for _, view, _ in leaves), causal, scale)
    if layout == "bsnd" and q.shape[2] > 1:
        assert out.transpose(1, 2).is_contiguous() and not out.is_contiguous(), out.stride()
    else:
        assert out.is_contiguous(), out.stride()
    out.backward(dout)
    if layout == "strided":
        assert all(bool((leaf.grad[..., q.shape[-1]:] == 0).all()) for leaf, _, _ in leaves)
    return (out.detach(), mx, sm) + tuple(grad() for _, _, grad in leaves)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_forward_and_gradients_against_float64(case, dtype):
    q, k, v, dout = _inputs(case, dtype)
    causal, scale = case[6], case[7]
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    out64 = _reference(*leaves64, causal, scale)
    out64.backward(dout.double())
    want = [out64.detach()] + [t.grad for t in leaves64]
    # torch's own SDPA in this dtype (grouped heads as enable_gqa).
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    gqa = {"enable_gqa": True} if case[1] != case[2] else {}
    out_t = torch.nn.functional.scaled_dot_product_attention(*theirs, is_causal=causal, scale=scale, **gqa)
    out_t.backward(dout)
    torch_err = [_rel(got, w) for got, w in zip([out_t.detach()] + [t.grad for t in theirs], want)]
    first = None
    for layout in LAYOUTS:
        got = _run(q, k, v, dout, causal, scale, layout)
        assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.float32
        assert got[1].shape == got[2].shape == q.shape[:3]
        for name, g, w, te in zip(("out", "dq", "dk", "dv"), got[:1] + got[3:], want, torch_err):
            assert g.dtype == dtype and g.shape == w.shape, (name, g.dtype, g.shape)
            err = _rel(g, w)
            record(f"attention {IDS[dtype]} {name} rel err vs float64", err)
            record(f"attention {IDS[dtype]} {name} rel err vs float64 (torch's SDPA)", te)
            if te > 0:
                record(f"attention {IDS[dtype]} {name} rel err / torch's", err / te)
            assert err <= BOUND[dtype] * (QK[dtype] if name in ("dq", "dk") else 1.0), (layout, name, err)
            assert err <= TORCH_RATIO[dtype] * te, (layout, name, err, te)
        # Every layout: the same sums, the same bits.
        if first is None:
            first = got
        else:
            assert all(torch.equal(a, b) for a, b in zip(got, first)), layout


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_bsnd_views_are_read_in_place_and_written_as_bsnd(dtype):
    # The backward op itself: dq, dk, dv in q's, k's and v's layout, with the
    # bits of the contiguous call; a mix of layouts is copied to BNSD.
    b, s, h, hkv, d = 2, 37, 4, 2, 20
    xq, xk, xv = (_r(b, s, n, d, dtype=dtype, seed=i) for i, n in enumerate((h, hkv, hkv)))
    views = [x.transpose(1, 2) for x in (xq, xk, xv)]
    flat = [t.contiguous() for t in views]
    dout = _r(b, h, s, d, dtype=dtype, seed=5)
    o, mx, sm = ops.attention(*views, True)
    oc, mxc, smc = ops.attention(*flat, True)
    assert o.shape == (b, h, s, d) and o.transpose(1, 2).is_contiguous() and oc.is_contiguous()
    assert torch.equal(o, oc) and torch.equal(mx, mxc) and torch.equal(sm, smc)
    grads = ops.attention_backward(dout, *views, o, mx, sm, True)
    grads_c = ops.attention_backward(dout, *flat, oc, mxc, smc, True)
    for g, gc, x in zip(grads, grads_c, views):
        assert g.shape == x.shape and g.transpose(1, 2).is_contiguous() and gc.is_contiguous()
        assert torch.equal(g, gc)
    # dout and out in either layout: the same bits.
    assert all(torch.equal(g, gc) for g, gc in zip(ops.attention_backward(dout.transpose(1, 2).contiguous()
                                                                          .transpose(1, 2), *views, oc, mx, sm,
                                                                          True), grads_c))
    mixed = ops.attention(views[0], *flat[1:], True)[0]
    assert mixed.is_contiguous() and torch.equal(mixed, oc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_same_bits_on_one_two_and_three_threads(dtype):
    # 200 rows: three of the forward's 84-row blocks; 2 kv heads for the backward.
    q, k, v, dout = _inputs((1, 4, 2, 200, 200, 24, True, None), dtype)
    before = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(_run(q, k, v, dout, True, None, "bsnd"))
    finally:
        torch.set_num_threads(before)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, runs[0]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_softmax_statistics(causal, scale):
    b, h, hkv, sq, skv, d = 2, 4, 2, 9, 13, 20
    q, k, v, _ = _inputs((b, h, hkv, sq, skv, d, causal, scale), torch.float32)
    out, mx, sm = ops.attention(q, k, v, causal, scale)
    assert mx.shape == sm.shape == (b, h, sq) and mx.dtype == sm.dtype == torch.float32
    sc = d**-0.5 if scale is None else scale
    q64, k64 = q.double(), k.double().repeat_interleave(h // hkv, 1)
    s = q64 @ k64.transpose(-1, -2) * sc
    seen = torch.ones(sq, skv, dtype=torch.bool).tril() if causal else torch.ones(sq, skv, dtype=torch.bool)
    s = s.masked_fill(~seen, float("-inf"))
    bound = (q64.abs() @ k64.abs().transpose(-1, -2) * sc).amax(-1) * ((d + 1) * 2.0**-24)
    assert bool(((mx.double() - s.amax(-1)).abs() <= bound).all())
    # The sum of the row's exponentials, shifted by the max the kernel kept.
    want = torch.exp(s - mx.double()[..., None]).sum(-1)
    rel = ((sm.double() - want).abs() / want).max().item()
    record("attention f32 softmax_sum rel err vs float64", rel)
    assert rel <= 1e-5, rel
    assert bool((sm >= 1).all())  # the max's own term is 1
    # Together they give the probabilities, and the output.
    p = torch.exp(s - mx.double()[..., None]) / sm.double()[..., None]
    assert _rel(out, p @ v.double().repeat_interleave(h // hkv, 1)) <= BOUND[torch.float32]
    # Not differentiable.
    o, mx, sm = ops.attention(q.requires_grad_(), k, v, causal, scale)
    assert o.requires_grad and not mx.requires_grad and not sm.requires_grad


def test_bad_input_is_refused():
    q, k, v = _r(1, 4, 7, 16), _r(1, 2, 7, 16, seed=1), _r(1, 2, 7, 16, seed=2)
    with pytest.raises(TypeError, match="dtype"):
        ops.attention(q, k.bfloat16(), v)
    with pytest.raises(TypeError, match="dtype"):
        ops.attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="not k's"):
        ops.attention(q, k, _r(1, 2, 6, 16))
    with pytest.raises(ValueError, match="not k's"):
        ops.attention(q, k, _r(1, 2, 7, 8))
    with pytest.raises(ValueError, match="do not divide"):
        ops.attention(q, _r(1, 3, 7, 16), _r(1, 3, 7, 16))
    with pytest.raises(ValueError, match="4-D"):
        ops.attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="batch and head_dim"):
        ops.attention(q, _r(2, 2, 7, 16), _r(2, 2, 7, 16))
    with pytest.raises(ValueError, match="batch and head_dim"):
        ops.attention(q, _r(1, 2, 7, 8), _r(1, 2, 7, 8))
    with pytest.raises(ValueError, match="head_dim is 0"):
        ops.attention(_r(1, 4, 7, 0), _r(1, 2, 7, 0), _r(1, 2, 7, 0))
    with pytest.raises(ValueError, match="no keys"):
        ops.attention(q, _r(1, 2, 0, 16), _r(1, 2, 0, 16))
    with pytest.raises(ValueError, match="finite"):
        ops.attention(q, k, v, False, float("inf"))
    out, mx, sm = ops.attention(q, k, v)
    with pytest.raises(ValueError, match="q's shape"):
        ops.attention_backward(out[:, :, :6], q, k, v, out, mx, sm)
    # No queries: empty outputs.
    assert [t.shape for t in ops.attention(_r(1, 4, 0, 16), k, v)] == [(1, 4, 0, 16), (1, 4, 0), (1, 4, 0)]


def test_no_double_backward_and_no_forward_ad():
    q, k, v, dout = (t.requires_grad_() for t in _inputs((1, 4, 2, 9, 9, 16, True, None), torch.float32))
    out = ops.attention(q, k, v, True)[0]
    # create_graph=True through the backward: it has no derivative of its own.
    with pytest.raises(RuntimeError, match="no derivative"):
        torch.autograd.grad((out * dout.detach()).sum(), (q, k, v), create_graph=True)
    # The backward op called with inputs requiring grad: a node that refuses.
    o, mx, sm = ops.attention(q.detach(), k.detach(), v.detach(), True)
    dq, _, _ = ops.attention_backward(dout, q, k, v, o, mx, sm, True)
    assert dq.requires_grad
    with pytest.raises(RuntimeError, match="no derivative"):
        dq.sum().backward()
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode"):
        ops.attention(fwAD.make_dual(q, torch.ones_like(q)), k, v)
    # Without create_graph: the gradients, only for what requires grad.
    q2 = q.detach().clone().requires_grad_()
    ops.attention(q2, k.detach(), v.detach(), True)[0].backward(dout.detach())
    assert q2.grad is not None and q2.grad.shape == q2.shape


def test_opcheck():
    q, k, v, dout = _inputs((2, 4, 2, 9, 9, 20, True, None), torch.float32)
    torch.library.opcheck(ops.attention, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), True))
    bsnd = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(ops.attention, (*bsnd, False, 0.3))
    o, mx, sm = ops.attention(q.detach(), k.detach(), v.detach())
    torch.library.opcheck(ops.attention_backward, (dout, q.detach(), k.detach(), v.detach(), o, mx, sm))


class _Calls:
    """functional's npukern attention with its calls counted."""

    def __init__(self, monkeypatch):
        self.n = 0
        op = F._attention_op

        def call(*args):
            self.n += 1
            return op(*args)

        monkeypatch.setattr(F, "_attention_op", call)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_functional_takes_the_call(monkeypatch, dtype):
    calls = _Calls(monkeypatch)
    q, k, v, _ = _inputs((2, 4, 2, 9, 9, 20, True, None), dtype)
    for causal, scale in ((False, None), (True, 0.3)):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        assert torch.equal(got, ops.attention(q, k, v, causal, scale)[0])
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    assert torch.equal(F.scaled_dot_product_attention(q, kk, vv), ops.attention(q, kk, vv)[0])
    assert calls.n == 3
    # BSND views in, a BSND view out.
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*views, is_causal=True, enable_gqa=True)
    assert out.transpose(1, 2).is_contiguous() and torch.equal(out, ops.attention(q, k, v, True)[0])
    assert calls.n == 4


def test_functional_falls_back_to_torch(monkeypatch):
    calls = _Calls(monkeypatch)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v, _ = _inputs((2, 4, 4, 9, 9, 20, False, None), torch.float32)
    mask = torch.rand(9, 9, generator=torch.Generator().manual_seed(6)) > 0.3
    mask.fill_diagonal_(True)
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), sdpa(q, k, v, attn_mask=mask))
    fmask = _r(9, 9, seed=7)
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, fmask), sdpa(q, k, v, fmask))
    # Dropout: torch's, with the same generator draws.
    torch.manual_seed(11)
    got = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(11)
    assert torch.equal(got, sdpa(q, k, v, dropout_p=0.5))
    # float64, 3-D, mixed dtypes (torch's own error): torch's.
    q64, k64, v64 = q.double(), k.double(), v.double()
    got = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    assert torch.equal(got, sdpa(q64, k64, v64, is_causal=True))
    assert torch.equal(F.scaled_dot_product_attention(q[0], k[0], v[0]), sdpa(q[0], k[0], v[0]))
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k.bfloat16(), v)
    # Fewer kv heads without enable_gqa: torch's refusal.
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k[:, :2], v[:, :2])
    # A tensor subclass: torch's.
    class Sub(torch.Tensor):
        pass

    sub = [t.as_subclass(Sub) for t in (q, k, v)]
    got = F.scaled_dot_product_attention(*sub, is_causal=True)
    assert type(got) is Sub and torch.equal(got.as_subclass(torch.Tensor), sdpa(q, k, v, is_causal=True))
    assert calls.n == 0


def test_functional_under_autocast(monkeypatch):
    calls = _Calls(monkeypatch)
    q, k, v, _ = _inputs((1, 4, 2, 9, 9, 16, True, None), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        # float64 is not cast: torch's float64 result.
        d = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    assert calls.n == 1
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ops.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), True)[0])
    assert d.dtype == torch.float64


def test_compile_fullgraph_matches_eager_bits():
    b, s, h, hkv, d = 2, 37, 4, 2, 20
    xs = [_r(b, s, n * d, seed=i).requires_grad_() for i, n in enumerate((h, hkv, hkv))]
    dy = _r(b, h, s, d, seed=9)

    def f(xq, xk, xv):
        # As an attention layer hands SDPA its projections: [B, S, H, D] viewed per head.
        q, k, v = (x.view(b, s, -1, d).transpose(1, 2) for x in (xq, xk, xv))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    eager = f(*xs)
    eager.backward(dy)
    want = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
    compiled = torch.compile(f, fullgraph=True)(*xs)
    compiled.backward(dy)
    assert compiled.stride() == eager.stride() and eager.transpose(1, 2).is_contiguous()
    assert torch.equal(compiled, eager)
    assert all(torch.equal(x.grad, g) for x, g in zip(xs, want))


def test_route_rule(monkeypatch):
    monkeypatch.delenv("NPK_TORCH_ATTENTION", raising=False)
    vendor, flags, _ = route._cpu()
    x86 = vendor in ("GenuineIntel", "AuthenticAMD") and {"avx2", "fma"} <= flags
    for dt in DTYPES:
        assert route.attention_route(dt) is (x86 and "amx_tile" not in flags)
    assert route.attention_route(torch.float64) is False
    for fake, takes in ((("AuthenticAMD", {"avx2", "fma"}, 25), True),
                        (("GenuineIntel", {"avx2", "fma", "amx_tile"}, 6), False),
                        (("GenuineIntel", {"avx2"}, 6), False), (("", set(), 0), False)):
        monkeypatch.setattr(route, "_cpu", lambda fake=fake: fake)
        assert route.attention_route(torch.bfloat16) is takes, fake
        monkeypatch.setenv("NPK_TORCH_ATTENTION", "npukern")
        assert route.attention_route(torch.bfloat16) is True and route.attention_route(torch.float64) is False
        monkeypatch.setenv("NPK_TORCH_ATTENTION", "torch")
        assert route.attention_route(torch.bfloat16) is False
        monkeypatch.delenv("NPK_TORCH_ATTENTION")


# Hugging Face: the attention layers' "sdpa" entry.

FAMILIES = ["llama", "qwen2", "mistral"]
ATTENTION_OPS = {"npukern::attention", "npukern::attention_backward"}


def _sdpa_model(family, dtype, seed=5):
    """hf_models' tiny model (4 heads, 2 kv heads, 2 layers) on transformers' "sdpa" attention."""
    pytest.importorskip("transformers")
    from hf_models import build

    model = build(family, dtype, seed=seed)
    model.set_attn_implementation("sdpa")
    return model


def _step(model, x, **kwargs):
    """(loss, grads, npukern attention ops run) of one forward and backward with labels."""
    model.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = model(x, labels=x, **kwargs).loss
        loss.backward()
    ran = {e.name for e in prof.events()} & ATTENTION_OPS
    return loss.detach(), [p.grad.clone() for p in model.parameters()], ran


def _grad_rel(ga, gb):
    return max(((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item() for a, b in zip(ga, gb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_runs_npukern_attention(monkeypatch, family, dtype):
    from hf_models import tokens, twin
    from npukern_torch import hf

    monkeypatch.setenv("NPK_TORCH_ATTENTION", "npukern")
    stock = _sdpa_model(family, dtype)
    ours, kept = twin(stock), twin(stock)
    counts = hf.patch(ours, attention=True)
    assert counts["attention"] == 2 and hf.patch(kept, attention=False)["attention"] == 0
    x = tokens(seed=4)
    (ls, gs, rs), (lo, go, ro), (lk, gk, rk) = (_step(m, x) for m in (stock, ours, kept))
    assert ro == ATTENTION_OPS and rs == rk == set()
    loss_bound, grad_bound = (1e-5, 1e-5) if dtype == torch.float32 else (2.0**-8, 5e-2)
    for other in (ls, lk):
        rel = abs(lo.item() - other.item()) / abs(other.item())
        record(f"hf attention {IDS[dtype]} loss rel diff ({family})", rel)
        assert rel <= loss_bound, rel
    rel = _grad_rel(go, gk)
    record(f"hf attention {IDS[dtype]} grads rel diff vs attention=False ({family})", rel)
    assert rel <= grad_bound, rel
    # A padding mask: transformers' own SDPA (the mask), the bits of the model patched without attention.
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    (lo, go, ro), (lk, gk, rk) = (_step(m, x, attention_mask=mask) for m in (ours, kept))
    assert ro == rk == set()
    assert torch.equal(lo, lk) and all(torch.equal(a, b) for a, b in zip(go, gk))
    # unpatch: the counts, then the stock forward.
    assert hf.unpatch(ours) == counts
    assert all("forward" not in vars(m) for m in ours.modules())
    loss, _, ran = _step(ours, x)
    assert ran == set() and torch.equal(loss, ls)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_the_same_bits(monkeypatch, reentrant):
    # Checkpointed layers run the attention again in the backward (the
    # forward's outputs and statistics recomputed, saved tensors hooked):
    # the loss and every gradient are the bits of the model without it.
    from hf_models import tokens, twin
    from npukern_torch import hf

    monkeypatch.setenv("NPK_TORCH_ATTENTION", "npukern")
    plain = _sdpa_model("llama", torch.bfloat16)
    ckpt = twin(plain)
    assert hf.patch(plain)["attention"] == hf.patch(ckpt)["attention"] == 2
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    plain.train()
    ckpt.train()
    x = tokens(seed=6)
    (lp, gp, rp), (lc, gc, rc) = (_step(m, x) for m in (plain, ckpt))
    assert rp == rc == ATTENTION_OPS
    assert torch.equal(lp, lc) and all(torch.equal(a, b) for a, b in zip(gp, gc))


def test_patch_follows_the_route_and_eager_models_keep_their_attention(monkeypatch):
    from hf_models import build, tokens, twin
    from npukern_torch import hf

    stock = _sdpa_model("llama", torch.bfloat16)
    auto, forced, kept = twin(stock), twin(stock), twin(stock)
    hf.patch(auto)  # attention=True, the default: the route's rule
    hf.patch(forced, attention="npukern")
    hf.patch(kept, attention=False)
    x = tokens(seed=4)
    monkeypatch.setenv("NPK_TORCH_ATTENTION", "torch")
    (la, ga, ra), (lf, _, rf), (lk, gk, _) = (_step(m, x) for m in (auto, forced, kept))
    assert ra == set() and rf == ATTENTION_OPS
    assert torch.equal(la, lk) and all(torch.equal(a, b) for a, b in zip(ga, gk))
    monkeypatch.setenv("NPK_TORCH_ATTENTION", "npukern")
    assert _step(auto, x)[2] == ATTENTION_OPS
    with pytest.raises(ValueError, match="attention"):
        hf.patch(twin(stock), attention="yes")
    # An eager-attention model: its layers are patched (counted) but run transformers' eager attention.
    eager = build("llama", torch.bfloat16, seed=5)
    assert hf.patch(eager)["attention"] == 2
    assert _step(eager, x)[2] == set()


@pytest.mark.parametrize("door", ["deepcopy", "pickle", "torch.save"])
def test_patched_model_copies_keep_the_attention_route(monkeypatch, door):
    from hf_models import tokens
    from npukern_torch import hf

    monkeypatch.setenv("NPK_TORCH_ATTENTION", "npukern")
    model = _sdpa_model("qwen2", torch.bfloat16)
    if door != "deepcopy":
        try:
            copied(model, door)
        except (AttributeError, pickle.PicklingError) as e:
            # transformers with the `kernels` package wraps functions in local classes.
            pytest.skip(f"the stock model does not pickle here: {e}")
    counts = hf.patch(model)
    x = tokens(seed=4)
    loss, grads, ran = _step(model, x)
    assert ran == ATTENTION_OPS
    other = copied(model, door)
    got, other_grads, other_ran = _step(other, x)
    assert other_ran == ATTENTION_OPS
    assert torch.equal(got, loss) and all(torch.equal(a, b) for a, b in zip(other_grads, grads))
    assert hf.unpatch(other) == counts  # the copy's swaps are its own
    assert _step(model, x)[2] == ATTENTION_OPS


def test_generate_matches_the_unpatched_attention(monkeypatch):
    # Prefill (causal, keys as many as queries) and one-token decode steps
    # against the cache (not causal) on npukern's attention.
    from hf_models import tokens, twin
    from npukern_torch import hf

    monkeypatch.setenv("NPK_TORCH_ATTENTION", "npukern")
    stock = _sdpa_model("llama", torch.float32)
    ours = twin(stock)
    hf.patch(ours, attention="npukern")
    x = tokens(batch=1, seq=8, seed=4)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = ours.generate(x, max_new_tokens=6, do_sample=False)
    assert "npukern::attention" in {e.name for e in prof.events()}
    with torch.no_grad():
        want = stock.generate(x, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
