"""npukern_torch.cross_entropy and linear_cross_entropy against torch's
F.cross_entropy on float64 (the reference) and on the same dtype.

Bars: the loss within 1e-5 relative of float64 (float32 arithmetic over
rows of up to 1000 classes); dlogits within 1 ulp of the dtype plus 1e-6 of
the largest gradient; the fused linear form's loss and gradients within
2e-6 relative of the unfused float32 composite."""

import sys

import pytest
import torch
import torch.nn.functional as TF

from npukern_torch import loss as L

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def _data(n, c, dtype, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, c, generator=g, dtype=torch.float64) * 3).to(dtype)
    t = torch.randint(0, c, (n,), generator=g)
    if ignore and n > 2:
        t[1] = -100
    return x, t


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1}, {"weight": True}, {"z_loss": 1e-3},
                                  {"softcap": 5.0}], ids=["plain", "smooth", "weight", "zloss", "softcap"])
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 1000)])
def test_cross_entropy_matches_float64(dtype, reduction, opts, shape):
    n, c = shape
    x, t = _data(n, c, dtype)
    weight = torch.rand(c, generator=torch.Generator().manual_seed(5)) + 0.5 if opts.get("weight") else None
    ls, z, cap = opts.get("label_smoothing", 0.0), opts.get("z_loss", 0.0), opts.get("softcap")
    xr = x.double().requires_grad_()
    ref = L._composite(xr, t, None if weight is None else weight.double(), -100, reduction, ls, z, cap or 0.0)
    xo = x.clone().requires_grad_()
    got = L.cross_entropy(xo, t, weight, reduction=reduction, label_smoothing=ls, z_loss=z, softcap=cap)
    assert got.dtype == dtype and got.shape == ref.shape
    got32 = L.cross_entropy(x.float(), t, weight, reduction=reduction, label_smoothing=ls, z_loss=z, softcap=cap)
    scale = ref.detach().abs().max().clamp(min=1.0)
    assert ((got32.double() - ref.detach()).abs() <= 1e-5 * scale).all()
    g = torch.rand(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    (gr,) = torch.autograd.grad(ref, xr, g)
    (go,) = torch.autograd.grad(got, xo, g.to(dtype))
    mant = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    tol = gr.abs() * 2.0 ** -mant + 1e-6 * gr.abs().max() + 2.0 ** -24
    assert ((go.double() - gr).abs() <= tol * 2).all(), (go.double() - gr).abs().max()


def test_cross_entropy_shapes_and_edges():
    x, t = _data(6, 5, torch.float32)
    # (N, C, d): classes in dim 1, as F.cross_entropy.
    x3 = x.reshape(2, 3, 5).transpose(1, 2)
    t3 = t.reshape(2, 3).clamp(min=0)
    torch.testing.assert_close(L.cross_entropy(x3, t3, reduction="none"), TF.cross_entropy(x3, t3, reduction="none"))
    # unbatched
    torch.testing.assert_close(L.cross_entropy(x[0], t[0]), TF.cross_entropy(x[0], t[0]))
    # all ignored: torch's NaN mean and 0 sum; N = 0
    ti = torch.full((6,), -100)
    assert L.cross_entropy(x, ti).isnan() and L.cross_entropy(x, ti, reduction="sum") == 0
    assert L.cross_entropy(x[:0], t[:0], reduction="sum") == 0 and L.cross_entropy(x[:0], t[:0]).isnan()
    # out of range: a clear error naming the row and value
    bad = t.clone()
    bad[3] = 5
    with pytest.raises(IndexError, match="5"):
        L.cross_entropy(x, bad)
    # float64 falls back to torch's
    assert L.cross_entropy(x.double(), t).dtype == torch.float64
    # uint8 / int8 / int16 class indices, as torch takes them
    tc = t.clamp(min=0)
    for d in (torch.uint8, torch.int8, torch.int16):
        assert torch.equal(L.cross_entropy(x, tc.to(d)), L.cross_entropy(x, tc)), d


@pytest.mark.parametrize("blocks", [False, True], ids=["one_block", "vocab_blocks"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1, "z_loss": 1e-4}, {"softcap": 30.0}],
                         ids=["plain", "smooth_z", "softcap"])
def test_linear_cross_entropy_matches_unfused(wdtype, bias, opts, blocks, monkeypatch):
    if blocks:  # the weight gradient summed in float32 blocks of 64 vocabulary rows (and an odd last one)
        monkeypatch.setattr(L, "_VOCAB_BLOCK", 64)
    g = torch.Generator().manual_seed(3)
    n, h, v = 37, 16, 300
    x = torch.randn(n, h, generator=g).to(wdtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.3).to(wdtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).to(wdtype).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    loss = L.linear_cross_entropy(x, w, t, b, chunk_bytes=7 * v * x.element_size(), **opts)
    assert loss.dtype == torch.float32
    grads = torch.autograd.grad(loss, [p for p in (x, w, b) if p is not None])
    logits = x @ w.t() if b is None else torch.addmm(b, x, w.t())
    ref = L.cross_entropy(logits.float(), t, **opts)
    ref_grads = torch.autograd.grad(ref, [p for p in (x, w, b) if p is not None])
    torch.testing.assert_close(loss, ref, rtol=2e-6, atol=2e-6)
    for a, r in zip(grads, ref_grads):
        assert a.dtype == r.dtype
        tol = (2e-6 if wdtype == torch.float32 else 2**-7) * r.abs().max().item()
        assert (a.double() - r.double()).abs().max().item() <= tol + 1e-7


def test_npu_cross_entropy_loss_four_outputs():
    from npukern_torch import npu

    x, t = _data(9, 40, torch.bfloat16)
    loss, log_prob, zloss, lse = npu.npu_cross_entropy_loss(x, t, lse_square_scale_for_zloss=1e-3, return_zloss=True)
    xf = x.float()
    ref_lse = torch.logsumexp(xf, -1)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(log_prob, xf - ref_lse[:, None], rtol=1e-6, atol=1e-5)
    keep = t != -100
    z = (1e-3 * ref_lse.square())[keep].mean()
    torch.testing.assert_close(zloss, z, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss, TF.cross_entropy(xf, t) + z, rtol=1e-5, atol=1e-6)
    assert loss.dtype == torch.float32 and log_prob.shape == x.shape


def test_opcheck_and_compile():
    x, t = _data(5, 12, torch.float32)
    w = torch.rand(12) + 0.5
    samples = [(x, t, None, 2, -100, 0.0, 0.0, 0.0), (x, t, w, 0, -100, 0.1, 1e-3, 4.0)]
    for args in samples:
        torch.library.opcheck(torch.ops.npukern.cross_entropy, (x.clone().requires_grad_(),) + args[1:])

    def f(x, t):
        return L.cross_entropy(x, t, label_smoothing=0.1)

    compiled = torch.compile(f, fullgraph=True)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = compiled(xa, t), f(xb, t)
    torch.testing.assert_close(a, b)
    a.backward()
    b.backward()
    torch.testing.assert_close(xa.grad, xb.grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 6.0}, {"weight": True}],
                         ids=["plain", "smooth-z-cap", "weight"])
def test_training_forward_keeps_the_bits(dtype, reduction, opts):
    """With the logits requiring grad the forward also writes dlogits
    (cross_entropy_train): the loss has the bits of the no-grad call, and
    the gradient those of the backward op, for an upstream gradient of 1
    (handed over) and of 0.37 (the backward op run)."""
    x, t = _data(37, 203, dtype)
    t[5] = -100
    opts = dict(opts)
    w = torch.rand(203, generator=torch.Generator().manual_seed(3)) + 0.5 if opts.pop("weight", False) else None
    ls, z, cap = opts.get("label_smoothing", 0.0), opts.get("z_loss", 0.0), opts.get("softcap", 0.0)
    red = {"sum": 1, "mean": 2}[reduction]
    ops = torch.ops.npukern
    with torch.no_grad():
        want, lse = ops.cross_entropy(x, t, w, red, -100, ls, z, cap)
    # 1 (handed over), 0.37 (the backward op; the next forward then skips
    # the dlogits), 1 again (seen: the one after that writes them again).
    for g in (1.0, 0.37, 1.0, 1.0):
        xa = x.clone().requires_grad_()
        got, got_lse = ops.cross_entropy(xa, t, w, red, -100, ls, z, cap)
        assert got.view(torch.int32).item() == want.view(torch.int32).item()
        assert torch.equal(got_lse, lse)
        (got * g).backward() if g != 1.0 else got.backward()
        d = ops.cross_entropy_backward(torch.tensor(g), x, t, w, lse, red, -100, ls, z, cap)
        assert torch.equal(xa.grad.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           d.view(torch.int16 if dtype != torch.float32 else torch.int32))
    # And against float64: the reduction the adapter does (float64 sum over
    # the denominator, one rounding).
    ref = TF.cross_entropy(x.double(), t, weight=None if w is None else w.double(), reduction=reduction)
    if not ls and not z and not cap:
        assert abs(want.double() - ref) <= 1e-6 * max(1.0, abs(ref.item()))


def test_training_forward_op():
    """cross_entropy_train alone: opcheck, and refusing an unreduced loss."""
    x, t = _data(6, 17, torch.float32)
    torch.library.opcheck(torch.ops.npukern.cross_entropy_train, (x, t, None, 2, -100, 0.1, 1e-3, 0.0))
    with pytest.raises(ValueError, match="reduction 0"):
        torch.ops.npukern.cross_entropy_train(x, t, None, 0)


def test_training_forward_retain_graph():
    """The forward's dlogits are handed over once: a second backward through
    a retained graph runs the backward op (the same bits), and the first
    gradient is not touched by it."""
    x, t = _data(11, 70, torch.bfloat16)
    xa = x.clone().requires_grad_()
    loss = L.cross_entropy(xa, t)
    loss.backward(retain_graph=True)
    first = xa.grad.clone()
    g1 = xa.grad
    xa.grad = None
    loss.backward()
    assert torch.equal(xa.grad.view(torch.int16), first.view(torch.int16))
    assert torch.equal(g1.view(torch.int16), first.view(torch.int16))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_and_plain_share_the_reduction(reduction):
    """One chunk: linear_cross_entropy's logits are cross_entropy's, and the
    two reduce the per-row losses alike (float64, one rounding): the same
    loss bits."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(45, 32, generator=g), torch.randn(300, 32, generator=g)
    t = torch.randint(0, 300, (45,), generator=g)
    t[3] = -100
    a = L.linear_cross_entropy(x, w, t, reduction=reduction)
    b = L.cross_entropy(x @ w.t(), t, reduction=reduction)
    assert a.view(torch.int32).item() == b.view(torch.int32).item()


def test_far_from_zero_logits_keep_the_loss():
    # lse rounds to the max at this scale: the loss comes from (m - x_t) + log s.
    for v in (-1e10, 1e10, -1e30):
        x = torch.full((3, 4), v)
        t = torch.tensor([1, 0, 3])
        assert L.cross_entropy(x, t).item() == pytest.approx(torch.log(torch.tensor(4.0)).item(), rel=1e-6)
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) + 1e4
    t = torch.randint(0, 50, (6,), generator=torch.Generator().manual_seed(4))
    want = TF.cross_entropy(x.double(), t, reduction="none")
    assert (L.cross_entropy(x, t, reduction="none").double() - want).abs().max() <= 1e-5


def test_target_shape_and_weight_grad_are_checked():
    x = torch.randn(2, 7, 3)
    t = torch.randint(0, 7, (2, 3))
    assert L.cross_entropy(x, t).item() == pytest.approx(TF.cross_entropy(x, t).item(), rel=1e-6)
    for bad in (t.t().contiguous(), t.reshape(-1), t.reshape(2, 3, 1)):
        with pytest.raises(ValueError, match="expected target of shape"):
            L.cross_entropy(x, bad)
    w = torch.rand(7, requires_grad=True)
    with pytest.raises(RuntimeError, match="not differentiable with respect to 'weight'"):
        L.cross_entropy(x, t, weight=w)
    with torch.no_grad():
        L.cross_entropy(x, t, weight=w)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_weighted_z_loss_is_the_same_on_the_kernel_and_the_composite(reduction):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 11, generator=g) * 3
    t = torch.randint(0, 11, (8,), generator=g)
    t[2] = -100
    w = torch.rand(11, generator=g) + 0.2
    kern = L.cross_entropy(x, t, weight=w, z_loss=1e-2, reduction=reduction)
    comp = L.cross_entropy(x.double(), t, weight=w.double(), z_loss=1e-2, reduction=reduction)
    assert kern.double().item() == pytest.approx(comp.item(), rel=1e-6)


def test_linear_cross_entropy_compiles_fullgraph_with_grad():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(12, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (12,), generator=g)
    torch.compile(lambda a, b, c: L.linear_cross_entropy(a, b, c), fullgraph=True)(x, w, t).backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    TF.cross_entropy(xr @ wr.t(), t).backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the recycled block is Linux's mmap")
def test_large_dlogits_reuse_the_last_block_and_overwrite_it():
    """dlogits of 8 MiB or more come from the block the last one left when
    it died (the adapter's pool of large outputs: its pages mapped, no page
    faults, no zeroing; issue 58 item 8), and every element is written
    again: over a block holding another call's gradient, the training
    forward and the backward op give the bits of a fresh call (other logits,
    targets and ignored rows). A gradient still alive is never handed out."""
    n, c = 1024, 4096  # bf16: 8 MiB
    ops = torch.ops.npukern

    def case(seed):
        x, t = _data(n, c, torch.bfloat16, seed=seed)
        t[seed * 7:seed * 7 + 5] = -100
        with torch.no_grad():
            _, lse = ops.cross_entropy(x, t, None, 2, -100, 0.0, 0.0, 0.0)
        return x, t, lse

    def train_grad(x, t):
        xa = x.clone().requires_grad_()
        L.cross_entropy(xa, t).backward()
        return xa.grad

    x0, t0, _ = case(0)
    first = train_grad(x0, t0)
    p = first.data_ptr()
    x1, t1, lse1 = case(1)
    want = ops.cross_entropy_backward(torch.tensor(1.0), x1, t1, None, lse1, 2, -100, 0.0, 0.0, 0.0)
    assert want.data_ptr() != p  # first is alive
    del first  # its block into the pool
    got = train_grad(x1, t1)
    assert got.data_ptr() == p  # the training forward over case 0's gradient
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    x2, t2, lse2 = case(2)
    fresh = train_grad(x2, t2)  # got and want alive: another block
    assert fresh.data_ptr() not in (p, want.data_ptr())
    del got  # p into the pool, the last given back
    again = ops.cross_entropy_backward(torch.tensor(1.0), x2, t2, None, lse2, 2, -100, 0.0, 0.0, 0.0)
    assert again.data_ptr() == p  # the backward op over case 1's gradient
    assert torch.equal(again.view(torch.int16), fresh.view(torch.int16))
