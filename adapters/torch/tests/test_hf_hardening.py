"""The Hugging Face door, hardened (issue 30): each defect a test that failed
before its fix. Tiny configs of every family (hf_models.py), no download."""

import copy
import inspect
import io
import pickle

import pytest
import torch

import npukern_torch
from conftest import record
from hf_models import FAMILIES, NORMS, build, tokens, twin
from npukern_torch import functional as F
from npukern_torch import hf

SILU_FAMILIES = [f for f in FAMILIES if not f.startswith("gemma")]


def _npukern_ops(model, *args, **kwargs):
    """The npukern ops one forward of `model` runs (torch profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.no_grad():
            model(*args, **kwargs)
    return {e.name for e in prof.events() if e.name.startswith("npukern::")}


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits


def _family_module(family):
    return type(build(family).model.layers[0].self_attn).__module__


# 1. One model's patch changes that model alone.


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_patch_changes_that_model_alone(family):
    import importlib

    modeling = importlib.import_module(_family_module(family))
    original = modeling.apply_rotary_pos_emb
    m1 = build(family, torch.bfloat16)
    m2, m3 = twin(m1), twin(m1)
    x = tokens()
    ref = _logits(m3, x)
    assert hf.patch(m1)["rope"] == 2
    # The family module is untouched; a model never patched runs no npukern
    # op and keeps its bits.
    assert modeling.apply_rotary_pos_emb is original
    assert _npukern_ops(m3, x) == set()
    assert torch.equal(_logits(m3, x), ref)
    assert "npukern::rope_qk" in _npukern_ops(m1, x)
    # The counts say what this model now runs.
    assert hf.patch(m2)["rope"] == 2
    # unpatch(m1) touches m1 alone.
    assert hf.unpatch(m1)["rope"] == 2
    assert "npukern::rope_qk" in _npukern_ops(m2, x)
    assert _npukern_ops(m1, x) == set()
    assert torch.equal(_logits(m1, x), ref)


# 2. The stand-in keeps the signature of what it stands in for.


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rope_stand_in_keeps_transformers_signature(family):
    import importlib

    original = importlib.import_module(_family_module(family)).apply_rotary_pos_emb
    stand_in = hf._rope_for(original)
    # With `kernels`, transformers wraps the function in a module whose forward carries its signature.
    target = original.forward if isinstance(original, torch.nn.Module) else original
    assert inspect.signature(stand_in) == inspect.signature(target)
    assert inspect.signature(F.apply_rotary_pos_emb).parameters.keys() >= {"unsqueeze_dim"}
    # A positional unsqueeze_dim of 2: q/k [b, s, h, d], cos/sin [b, s, d].
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 5, 4, 16, generator=g), torch.randn(2, 5, 2, 16, generator=g)
    cos, sin = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    want = original(q, k, cos, sin, 2)
    for fn in (stand_in, F.apply_rotary_pos_emb):
        got = fn(q, k, cos, sin, 2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_old_rope_signature_is_kept():
    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        raise AssertionError("not reached: the kernel takes these")

    stand_in = hf._rope_for(apply_rotary_pos_emb)
    assert inspect.signature(stand_in) == inspect.signature(apply_rotary_pos_emb)
    assert hf._rope_for(lambda q, k, cos, sin, dim=1: None) is None  # unknown: nothing swapped


# 3. and 4. Torch's type promotion, autocast and float64 on every swapped path.


def _module_inputs(model, x, kind, autocast):
    """(module name, args, kwargs) of every attention / MLP call in one forward."""
    calls = []

    def grab(module, args, kwargs, name):
        calls.append((name, args, kwargs))

    hooks = [m.register_forward_pre_hook(lambda m, a, kw, n=n: grab(m, a, kw, n), with_kwargs=True)
             for n, m in model.named_modules() if type(m).__name__.endswith(kind)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(x, use_cache=False)  # no cache: each captured call can run again
    for h in hooks:
        h.remove()
    return calls


# Bars: RoPE is exact (multiplies and adds in the dtype torch promotes to),
# so an attention layer without q/k norms gives the stock bits. SwiGLU's exp
# is npukern's (within ~1 float32 ulp of torch's), and norms sum in a fixed
# order: there the bar is the stock dtype and a few ulps.
_CLOSE = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float64: 1e-12}


def _rel(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["f32", "bf16", "f64"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_swapped_modules_give_stock_dtype_and_bits(family, dtype, autocast):
    if autocast and dtype != torch.float32:
        pytest.skip("autocast on a float32 model")
    stock = build(family, dtype)
    patched = twin(stock)
    hf.patch(patched)
    x = tokens()
    ours, theirs = dict(patched.named_modules()), dict(stock.named_modules())
    checked = 0
    for kind in ("Attention", "MLP"):
        for name, args, kwargs in _module_inputs(stock, x, kind, autocast):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                want = theirs[name](*args, **kwargs)
                got = ours[name](*args, **kwargs)
            want, got = (w[0] if isinstance(w, tuple) else w for w in (want, got))
            assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
            exact = kind == "Attention" and not any(isinstance(m, hf.HFRMSNorm) for m in ours[name].modules())
            if exact or dtype == torch.float64:
                assert torch.equal(got, want), name
            else:
                # Under autocast the layer's bf16 matmuls carry the 1-ulp differences.
                assert _rel(got, want) <= (2**-6 if autocast else _CLOSE[dtype]), name
            checked += 1
    assert checked >= 2
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want, got = _logits(stock, x), _logits(patched, x)
    assert got.dtype == want.dtype
    assert _rel(got, want) <= (2**-6 if autocast else _CLOSE[dtype])


def test_rope_under_autocast_promotes_like_stock():
    import transformers.models.llama.modeling_llama as modeling

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 9, 4, 32, generator=g).to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 9, 2, 32, generator=g).to(torch.bfloat16).transpose(1, 2)
    cos, sin = torch.randn(2, 9, 32, generator=g), torch.randn(2, 9, 32, generator=g)
    want = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    got = hf._rope_for(modeling.apply_rotary_pos_emb)(q, k, cos, sin)
    assert got[0].dtype == torch.float32 and all(torch.equal(a, b) for a, b in zip(got, want))


# 5. The class-level form builds every family with the class's own constructor.


@pytest.mark.parametrize("family", list(FAMILIES))
def test_class_level_form_builds_every_family(family):
    stock = build(family, torch.bfloat16)
    try:
        assert hf.apply_to_transformers([family]) == [family]
        model = build(family, torch.bfloat16)
    finally:
        hf.revert_transformers()
    norms = [m for m in model.modules() if isinstance(m, npukern_torch.RMSNorm)]
    assert len(norms) == NORMS[family]
    model.load_state_dict(stock.state_dict())
    x = tokens()
    rel = ((_logits(model, x).double() - _logits(stock, x).double()).abs().max()
           / _logits(stock, x).double().abs().max()).item()
    assert rel <= 2**-6, rel
    # Built after apply_to_transformers, it pickles and loads with transformers' classes back.
    try:
        _saved(stock)
    except (AttributeError, pickle.PicklingError):
        return  # transformers with `kernels`: the stock model does not pickle either
    loaded = torch.load(io.BytesIO(_saved(model)), weights_only=False)
    assert torch.equal(_logits(loaded, x), _logits(model, x))


def test_class_level_stand_in_takes_the_keywords_and_refuses_others():
    try:
        hf.apply_to_transformers(["gemma3", "llama"])
        import transformers.models.gemma3.modeling_gemma3 as g3
        import transformers.models.llama.modeling_llama as ll

        # Positional: the newest transformers renamed Gemma3RMSNorm's `dim`
        # to `hidden_size` (the stand-in binds whichever stock signature).
        norm = g3.Gemma3RMSNorm(16, eps=1e-5)
        assert norm.weight.shape == (16,) and norm.eps == 1e-5 and norm.casting == "gemma"
        assert ll.LlamaRMSNorm(hidden_size=8).variance_epsilon == 1e-6
        with pytest.raises(TypeError):
            g3.Gemma3RMSNorm(16, bias=True)
    finally:
        hf.revert_transformers()


# 6. Pickling, deepcopy and reloading a patched model.


def _saved(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    return buf.getvalue()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_patched_model_pickles_deepcopies_and_reloads(family):
    model = build(family, torch.bfloat16)
    try:
        _saved(model)
    except (AttributeError, pickle.PicklingError) as e:
        # transformers with the `kernels` package wraps functions in local classes.
        pytest.skip(f"the stock model does not pickle here: {e}")
    counts = hf.patch(model)
    x = tokens()
    ref = _logits(model, x)
    for copy_of in (lambda m: torch.load(io.BytesIO(_saved(m)), weights_only=False),
                    copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
        other = copy_of(model)
        assert torch.equal(_logits(other, x), ref)
        assert _npukern_ops(other, x) == _npukern_ops(model, x)
        assert hf.unpatch(other) == counts  # the copy's swaps are its own


# 7. Double backward through SwiGLU and RoPE (tables included).


def _hvp(fn, inputs, probe_shape, gen):
    """d/d(inputs) of |d(sum(fn(inputs) * probe))/d(inputs)|^2: a second derivative."""
    probe = torch.randn(probe_shape, generator=gen, dtype=torch.float64).to(inputs[0].dtype)
    y = fn(*inputs)
    grads = torch.autograd.grad((y * probe).sum(), inputs, create_graph=True)
    return torch.autograd.grad(sum(g.square().sum() for g in grads), inputs)


def _check_second_derivative(ours, theirs, shapes, probe_shape):
    gen = torch.Generator().manual_seed(7)
    base = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    got = _hvp(ours, [b.float().requires_grad_() for b in base], probe_shape, torch.Generator().manual_seed(8))
    want = _hvp(theirs, [b.clone().requires_grad_() for b in base], probe_shape, torch.Generator().manual_seed(8))
    for g, w in zip(got, want):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g.double(), w, rtol=2e-4, atol=2e-4 * w.abs().max().item())


def test_silu_mul_and_swiglu_double_backward():
    def silu_mul(g, u):
        return torch.nn.functional.silu(g) * u

    _check_second_derivative(F.silu_mul, silu_mul, [(3, 10), (3, 10)], (3, 10))
    _check_second_derivative(lambda x: F.swiglu(x, 0), lambda x: silu_mul(*x.chunk(2, 0)), [(6, 5)], (3, 5))


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def test_rope_double_backward_with_table_gradients():
    def composite(x, cos, sin):
        return x * cos + _rotate_half(x) * sin

    _check_second_derivative(F.rotary_mul, composite, [(2, 3, 5, 8), (1, 1, 5, 8), (1, 1, 5, 8)], (2, 3, 5, 8))

    def qk_ours(q, k, cos, sin):
        qo, ko = F.apply_rotary_pos_emb(q, k, cos, sin)
        return torch.cat((qo, ko), 1)

    def qk_theirs(q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat((composite(q, cos, sin), composite(k, cos, sin)), 1)

    _check_second_derivative(qk_ours, qk_theirs, [(2, 4, 5, 8), (2, 2, 5, 8), (2, 5, 8), (2, 5, 8)], (2, 6, 5, 8))


def test_rotary_mul_errors_name_x():
    with pytest.raises(ValueError, match="'x'") as e:
        torch.ops.npukern.rotary_mul(torch.randn(2, 7), torch.randn(3, 8), torch.randn(3, 8), False, False)
    assert "'q'" not in str(e.value)


# 8. The install asks cargo for its target directory and keys objects to the torch.


def test_setup_finds_the_library_where_cargo_puts_it(tmp_path, monkeypatch):
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    monkeypatch.setenv("CARGO_TARGET_DIR", str(tmp_path / "elsewhere"))
    setup_py = (root / "adapters/torch/setup.py").read_text()
    assert "cargo\", \"metadata\"" in setup_py and "target_directory" in setup_py
    meta = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=root, check=True,
                          capture_output=True, text=True)
    assert Path(json.loads(meta.stdout)["target_directory"]) == tmp_path / "elsewhere"


# Found in the hunt: torch_npu's drop-in functions crashed on float64.


def test_npu_drop_ins_fall_back_for_float64():
    from npukern_torch import npu

    g = torch.Generator().manual_seed(4)
    x, r = torch.randn(3, 8, generator=g, dtype=torch.float64), torch.randn(3, 8, generator=g, dtype=torch.float64)
    w = torch.rand(8, generator=g, dtype=torch.float64) + 0.5
    y, rstd = npu.npu_rms_norm(x, w)
    want = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w
    assert y.dtype == torch.float64 and torch.allclose(y, want) and rstd.shape == (3, 1)
    y2, _, s = npu.npu_add_rms_norm(x, r, w)
    assert torch.equal(s, x + r) and y2.dtype == torch.float64
    a, b = x.chunk(2, -1)
    assert torch.equal(npu.npu_swiglu(x), torch.nn.functional.silu(a) * b)
    x1, x2 = x.chunk(2, -1)
    assert torch.equal(npu.npu_rotary_mul(x, r, r), x * r + torch.cat((-x2, x1), -1) * r)


# Issue 31: the causal LM's loss through the fused linear cross-entropy.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_route_matches_stock_loss_and_gradients(family, dtype):
    stock = build(family, dtype, seed=4)
    if family == "gemma2":
        stock.config.final_logit_softcapping = 3.0  # bite: logits of a tiny model are small
    patched = twin(stock)
    assert hf.patch(patched, rms_norm=False, embedding=False, mlp=False, rope=False)["loss"] == 1
    x = tokens(seed=7)
    labels = x.clone()
    labels[0, :3] = -100
    out_s, out_p = stock(x, labels=labels), patched(x, labels=labels)
    assert out_p.logits is None and out_p.loss.dtype == out_s.loss.dtype == torch.float32
    rel = abs(out_p.loss.item() - out_s.loss.item()) / abs(out_s.loss.item())
    assert rel <= (2e-6 if dtype == torch.float32 else 2e-2), rel
    out_s.loss.backward()
    out_p.loss.backward()
    worst = 0.0
    for (n, a), b in zip(stock.named_parameters(), patched.parameters()):
        if a.grad is None:
            continue
        worst = max(worst, ((b.grad.double() - a.grad.double()).abs().max() / a.grad.double().abs().max()).item())
    record(f"hf {dtype} loss-route grads max rel diff ({family})", worst)
    assert worst <= (2e-6 if dtype == torch.float32 else 2**-5), worst
    with torch.no_grad():  # without labels the logits come back as before
        assert torch.equal(patched(x).logits, stock(x).logits)
    # num_items_in_batch: a sum over that count, as transformers' loss.
    with torch.no_grad():
        n = torch.tensor(11)
        a, b = stock(x, labels=labels, num_items_in_batch=n).loss, patched(x, labels=labels, num_items_in_batch=n).loss
    assert abs(a.item() - b.item()) <= (2e-6 if dtype == torch.float32 else 2e-2) * abs(a.item())


# Issue 32: the residual add before the post-attention norm fused into AddRmsNorm.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["f32", "bf16", "f64"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoder_layers_fuse_the_residual_add_with_stock_bits(family, dtype):
    stock = build(family, dtype, seed=5)
    fused, unfused = twin(stock), twin(stock)
    counts = hf.patch(fused)
    hf.patch(unfused, add_rms_norm=False)
    x = tokens(seed=8)
    layers = 0 if family in ("gemma2", "gemma3") else 2
    assert counts["add_rms_norm"] == layers
    with torch.no_grad():
        assert torch.equal(fused(x).logits, unfused(x).logits)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # promoted pairs take the stock add
            assert torch.equal(fused(x).logits, unfused(x).logits)
    if dtype != torch.float64 and layers:
        assert "npukern::add_rms_norm" in _npukern_ops(fused, x)
    # Training: the same loss; the gradients within one rounding of the unfused ones.
    labels = x.clone()
    lf, lu = fused(x, labels=labels).loss, unfused(x, labels=labels).loss
    assert torch.equal(lf, lu)
    lf.backward()
    lu.backward()
    for a, b in zip(fused.parameters(), unfused.parameters()):
        if b.grad is not None:
            rel = ((a.grad.double() - b.grad.double()).abs().max() / b.grad.double().abs().max()).item()
            assert rel <= (2**-5 if dtype == torch.bfloat16 else 1e-6), rel
    assert hf.unpatch(fused)["add_rms_norm"] == layers
    with torch.no_grad():
        assert torch.equal(fused(x).logits, stock(x).logits)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_loss_route_falls_back_for_float64_and_engages_under_autocast(family):
    # float64 models: Hugging Face's own composite, its bits. Autocast: the
    # fused route with the chunks' logits as autocast computes them (bf16
    # matmuls), within 1e-4 of stock's loss (Gemma2's soft cap: stock rounds
    # the capped logits to bf16, the kernel caps in float32; Llama's equal).
    for dtype, autocast in ((torch.float64, False), (torch.float32, True)):
        stock = build(family, dtype, seed=6)
        if family == "gemma2":
            stock.config.final_logit_softcapping = 3.0
        patched = twin(stock)
        assert hf.patch(patched)["loss"] == 1
        x = tokens(seed=9)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ls, lp = stock(x, labels=x).loss, patched(x, labels=x).loss
        assert lp.dtype == ls.dtype == torch.float32
        if autocast:
            assert abs(lp.item() - ls.item()) <= 1e-4 * abs(ls.item())
        else:
            assert torch.equal(lp, ls)
        lp.backward()
        assert all(p.grad is not None for p in patched.parameters() if p.requires_grad)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_loss_route_takes_shift_labels_and_ignore_index(family):
    # transformers' ForCausalLMLoss reads both from the forward's kwargs.
    stock = build(family, seed=8)
    patched = twin(stock)
    hf.patch(patched, rms_norm=False, embedding=False, mlp=False, rope=False)
    x = tokens(seed=9)
    g = torch.Generator().manual_seed(10)
    shift = torch.randint(0, 96, x.shape, generator=g)  # not labels shifted: the kwarg must win
    shift[:, -2:] = -100
    a = stock(x, labels=x, shift_labels=shift).loss
    b = patched(x, labels=x, shift_labels=shift).loss
    assert patched(x, labels=x, shift_labels=shift).logits is None
    assert abs(a.item() - b.item()) <= 2e-6 * abs(a.item()), (a, b)
    labels = x.clone()
    labels[:, ::3] = -1
    a = stock(x, labels=labels, ignore_index=-1).loss
    b = patched(x, labels=labels, ignore_index=-1).loss
    assert abs(a.item() - b.item()) <= 2e-6 * abs(a.item()), (a, b)


def test_loss_route_evaluation_returns_logits():
    # Trainer's evaluation loop: model.eval() under no_grad, labels given,
    # logits wanted for the metrics: the stock forward, bit for bit.
    stock = build("llama", seed=11)
    patched = twin(stock)
    hf.patch(patched, rms_norm=False, embedding=False, mlp=False, rope=False)
    stock.eval()
    patched.eval()
    x = tokens(seed=12)
    with torch.no_grad():
        s, p = stock(x, labels=x), patched(x, labels=x)
    assert p.logits is not None and torch.equal(p.logits, s.logits)
    assert torch.equal(p.loss, s.loss)
    # Evaluation with grad on (or training mode) still takes the fused route.
    assert patched(x, labels=x).logits is None
    patched.train()
    with torch.no_grad():
        assert patched(x, labels=x).logits is None


class _LoraHead(torch.nn.Module):
    """What PEFT's LoRA makes of an LM head: the Linear plus a low-rank delta."""

    def __init__(self, base, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.base = base
        self.a = torch.nn.Parameter(torch.randn(4, base.in_features, generator=g) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, 4, generator=g) * 0.1)

    @property
    def weight(self):  # as PEFT's wrapper, it still shows the base weight
        return self.base.weight

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def test_loss_route_leaves_a_wrapped_or_hooked_head_to_the_stock_forward():
    # A head wrapped after the patch (LoRA, quantization) or hooked must keep
    # its own forward: the fused loss reads only weight and bias, so before,
    # a LoRA head's delta was left out of the loss and its parameters got no
    # gradient.
    stock = build("llama", seed=13)
    patched = twin(stock)
    hf.patch(patched, rms_norm=False, embedding=False, mlp=False, rope=False)
    for m in (stock, patched):
        m.lm_head = _LoraHead(m.lm_head, seed=14)
    x = tokens(seed=15)
    a, b = stock(x, labels=x).loss, patched(x, labels=x).loss
    assert torch.equal(a, b)
    a.backward()
    b.backward()
    assert patched.lm_head.a.grad is not None and torch.equal(patched.lm_head.a.grad, stock.lm_head.a.grad)
    stock = build("llama", seed=16)
    patched = twin(stock)
    hf.patch(patched, rms_norm=False, embedding=False, mlp=False, rope=False)
    for m in (stock, patched):
        m.lm_head.register_forward_hook(lambda mod, inp, out: out * 0.5)
    assert torch.equal(stock(x, labels=x).loss, patched(x, labels=x).loss)


def test_loss_route_output_forms():
    # out[0] is the loss (a ModelOutput's order is its fields'), and
    # return_dict=False gives the tuple form, the loss first, as stock's.
    stock = build("llama", seed=17)
    patched = twin(stock)
    hf.patch(patched, rms_norm=False, embedding=False, mlp=False, rope=False)
    x = tokens(seed=18)
    out = patched(x, labels=x)
    assert out[0] is out.loss and out.logits is None and "logits" not in out
    t, s = patched(x, labels=x, return_dict=False), stock(x, labels=x, return_dict=False)
    assert isinstance(t, tuple) and abs(t[0].item() - s[0].item()) <= 2e-6 * abs(s[0].item())
