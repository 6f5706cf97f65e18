"""TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, which TRL's
trainers put on the model in place of hf.patch's loss route) on npukern's
kernels for heads hf.patch swapped: log-probabilities, entropy, the top-1
flag and both gradients against float64 and against TRL's own function,
the calls npukern leaves to TRL's, and SFTTrainer end to end."""

import pytest
import torch

trl_utils = pytest.importorskip("trl.trainer.utils")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from npukern_torch import _trl, hf, route  # noqa: E402
from npukern_torch import loss as npk_loss  # noqa: E402

OUTS = ("log_probs", "entropy", "is_top1")


def _model(dtype=torch.float32, vocab=300):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(dtype)


def _original():
    f = trl_utils._ChunkedLogProbFunction
    return getattr(f, "original", f)


def _head(dtype, n=37, hidden=48, vocab=1000, seed=1):
    """A registered head weight, hidden states and labels (random, with a
    few large logits so the top-1 flag is not always false)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(vocab, hidden, generator=g) * 0.2).to(dtype).requires_grad_()
    x = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g)
    with torch.no_grad():  # every third label the row's argmax
        t[::3] = (x[::3].float() @ w.float().t()).argmax(1)
    _trl.register(w, "auto")
    return x, w, t


def _reference(x, w, t, g_lp, g_ent, dtype, temperature=1.0, softcap=None, scale=1.0):
    """float64 of the same rounded inputs, the logits rounded to the compute
    dtype as both implementations round them, then TRL's transform."""
    x64 = x.detach().to(dtype).double().requires_grad_()
    w64 = w.detach().to(dtype).double().requires_grad_()
    z = x64 @ w64.t()
    z = z + (z.detach().to(dtype).double() - z.detach())  # the rounded logits, gradient as z's
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp = torch.log_softmax(z, 1)
    lp = logp.gather(1, t.unsqueeze(1)).squeeze(1)
    ent = -(logp.exp() * logp).sum(1)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    return lp.detach(), ent.detach(), z.detach().argmax(1) == t, x64.grad, w64.grad


def _run(fn, x, w, t, g_lp, g_ent, outputs=OUTS, autocast=False, matmul="auto", transform=(1.0, None, 1.0)):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    if fn is not _original():
        _trl.register(w, matmul)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        temperature, softcap, scale = transform
        lp, ent, _, _, top = fn.apply(x, w, None, t, temperature, 4096, softcap, scale, outputs)
    # Without an entropy gradient the entropy stays out of the graph: the
    # backward takes the kernel's path (a zero gradient would not).
    (lp * g_lp + (ent * g_ent if g_ent.any() else 0)).sum().backward()
    return lp.detach(), None if ent is None else ent.detach(), top, x.grad, w.grad


def _err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


@pytest.fixture(autouse=True)
def _installed():
    assert _trl.install()
    yield


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float32, True)])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("matmul", ["npukern", "torch"])  # the head's products on either, whatever this CPU's route
def test_against_float64_and_trl(monkeypatch, dtype, autocast, entropy_grad, chunks, matmul):
    x, w, t = _head(dtype)
    if chunks > 1:  # several token chunks: the weight gradient's float32 sums
        monkeypatch.setattr(npk_loss, "CHUNK_BYTES", (x.shape[0] // chunks) * w.shape[0] * x.element_size())
    g = torch.Generator().manual_seed(5)
    g_lp = torch.randn(x.shape[0], generator=g)
    g_lp[::4] = 0.0  # masked positions
    g_ent = torch.randn(x.shape[0], generator=g) if entropy_grad else torch.zeros(x.shape[0])
    compute = torch.bfloat16 if autocast else dtype
    ref = _reference(x, w, t, g_lp, g_ent, compute)
    ours = _run(trl_utils._ChunkedLogProbFunction, x, w, t, g_lp, g_ent, autocast=autocast, matmul=matmul)
    theirs = _run(_original(), x, w, t, g_lp, g_ent, autocast=autocast)
    assert ours[3].dtype == x.dtype and ours[4].dtype == w.dtype
    assert torch.equal(ours[2], ref[2]) and ref[2].any()
    tol = 2e-6 if compute == torch.float32 else 4e-3
    for k in (0, 1, 3, 4):  # log-probs, entropy, d hidden, d weight
        e_ours, e_theirs = _err(ours[k], ref[k]), _err(theirs[k], ref[k])
        assert e_ours <= max(tol, 1.5 * e_theirs), (k, e_ours, e_theirs)


@pytest.mark.parametrize("transform", [(0.7, None, 1.0), (1.0, 3.0, 1.0), (1.0, None, 0.25), (0.9, 2.0, 1.5)],
                         ids=["temperature", "softcap", "scale", "all"])
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float32, True)])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_transformed_logits_against_float64_and_trl(monkeypatch, transform, dtype, autocast, entropy_grad):
    """GRPO's and RLOO's sampling temperature, Gemma 2's soft-cap, Granite's
    and Cohere's logit scale: TRL's logits, in float32 from the rounded
    products, on npukern too (three chunks of tokens)."""
    x, w, t = _head(dtype)
    extra = 4 if transform[1] is None else 8  # the float32 transform beside the logits, its tanh under a cap
    monkeypatch.setattr(npk_loss, "CHUNK_BYTES", (x.shape[0] // 3) * w.shape[0] * (x.element_size() + extra))
    g = torch.Generator().manual_seed(6)
    g_lp = torch.randn(x.shape[0], generator=g)
    g_ent = torch.randn(x.shape[0], generator=g) if entropy_grad else torch.zeros(x.shape[0])
    compute = torch.bfloat16 if autocast else dtype
    ref = _reference(x, w, t, g_lp, g_ent, compute, *transform)
    ours = _run(trl_utils._ChunkedLogProbFunction, x, w, t, g_lp, g_ent, autocast=autocast, matmul="npukern",
                transform=transform)
    theirs = _run(_original(), x, w, t, g_lp, g_ent, autocast=autocast, transform=transform)
    assert ours[3].dtype == x.dtype and ours[4].dtype == w.dtype
    assert torch.equal(ours[2], theirs[2])
    tol = 2e-6 if compute == torch.float32 else 4e-3
    for k in (0, 1, 3, 4):
        e_ours, e_theirs = _err(ours[k], ref[k]), _err(theirs[k], ref[k])
        assert e_ours <= max(tol, 1.5 * e_theirs), (k, e_ours, e_theirs)


@pytest.mark.parametrize("transform", [(1.0, None, 1.0), (0.8, 3.0, 1.0)], ids=["plain", "temperature_cap"])
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float32, True)])
def test_one_upstream_value_skips_the_second_product(monkeypatch, transform, dtype, autocast):
    """SFT's upstream gradient, ``-1 / tokens`` on the tokens with a label
    and 0 on the masked ones: one chunk on npukern's matmul keeps ``p -
    onehot`` from the forward, the backward makes no logits again, and both
    gradients are as accurate as TRL's (a random gradient takes the
    recomputing path: the other tests)."""
    x, w, t = _head(dtype)
    g_lp = torch.full((x.shape[0],), -1.0 / 29)
    g_lp[::4] = 0.0  # masked positions
    zero = torch.zeros(x.shape[0])
    compute = torch.bfloat16 if autocast else dtype
    ref = _reference(x, w, t, g_lp, zero, compute, *transform)
    products = []
    logits = _trl._logits
    monkeypatch.setattr(_trl, "_logits", lambda *a: products.append(1) or logits(*a))
    ours = _run(trl_utils._ChunkedLogProbFunction, x, w, t, g_lp, zero, autocast=autocast, matmul="npukern",
                transform=transform)
    assert len(products) == 1
    theirs = _run(_original(), x, w, t, g_lp, zero, autocast=autocast, transform=transform)
    assert ours[3].dtype == x.dtype and ours[4].dtype == w.dtype
    assert torch.equal(ours[3][::4], torch.zeros_like(ours[3][::4]))  # masked tokens: no gradient
    tol = 2e-6 if compute == torch.float32 else 4e-3
    for k in (0, 1, 3, 4):
        e_ours, e_theirs = _err(ours[k], ref[k]), _err(theirs[k], ref[k])
        assert e_ours <= max(tol, 1.5 * e_theirs), (k, e_ours, e_theirs)


def test_what_the_forward_keeps_follows_the_last_backward(monkeypatch):
    """A per-token upstream gradient (DPO's, GRPO's) leaves the kept
    ``softmax - onehot`` unused: after one, the next forward of that head
    keeps nothing (and its backward makes the logits again), and after a
    uniform one it keeps again; the gradients are the same either way."""
    x, w, t = _head(torch.bfloat16)
    w = w.detach().requires_grad_()
    _trl.register(w, "npukern")
    products = []
    logits = _trl._logits
    monkeypatch.setattr(_trl, "_logits", lambda *a: products.append(1) or logits(*a))
    uniform = torch.full((x.shape[0],), -0.03)
    per_token = torch.randn(x.shape[0], generator=torch.Generator().manual_seed(9))

    def step(g):
        products.clear()
        xi = x.detach().clone().requires_grad_()
        lp, *_ = trl_utils._ChunkedLogProbFunction.apply(xi, w, None, t, 1.0, 4096, None, 1.0, ("log_probs",))
        (lp * g).sum().backward()
        grads = (xi.grad, w.grad.clone())
        w.grad = None
        return len(products), grads

    kept, first = step(uniform)
    assert kept == 1
    assert step(per_token)[0] == 2
    made_again, again = step(uniform)  # nothing kept: the logits made twice
    assert made_again == 2
    assert step(uniform)[0] == 1
    for a, b in zip(first, again):
        assert _err(a, b) <= 4e-3


@pytest.mark.parametrize("matmul", ["npukern", "torch"])
def test_metrics_against_float64_and_trl(matmul):
    """TRL's non-differentiable metrics (DPO's and KTO's): ``log sum_v p_v^2``
    and the mean logit, in float32 and bf16, with the log-probabilities'
    gradient unchanged by asking for them."""
    outs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 4e-3)):
        x, w, t = _head(dtype)
        x64, w64 = x.detach().double(), w.detach().double()
        z = (x64 @ w64.t()).to(dtype).double()  # the logits rounded to the compute dtype, as both round them
        logp = torch.log_softmax(z, 1)
        want_sq, want_mean = torch.logsumexp(2 * logp, 1), z.mean(1)
        got = {}
        for name, fn in (("ours", trl_utils._ChunkedLogProbFunction), ("theirs", _original())):
            xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            if name == "ours":
                _trl.register(wi, matmul)
            lp, ent, sq, mean, top = fn.apply(xi, wi, None, t, 1.0, 4096, None, 1.0, outs)
            assert not sq.requires_grad and not mean.requires_grad and sq.dtype == mean.dtype == torch.float32
            lp.sum().backward()
            got[name] = (sq.detach(), mean.detach(), xi.grad)
        for k, want in ((0, want_sq), (1, want_mean)):
            e_ours, e_theirs = _err(got["ours"][k], want), _err(got["theirs"][k], want)
            assert e_ours <= max(tol, 1.5 * e_theirs), (dtype, k, e_ours, e_theirs)
        x_only = _run(trl_utils._ChunkedLogProbFunction, x, w, t, torch.ones(x.shape[0]), torch.zeros(x.shape[0]),
                      matmul=matmul)[3]
        assert torch.equal(got["ours"][2], x_only)  # the metrics do not move the gradient


@pytest.mark.parametrize("matmul", ["npukern", "torch"])
def test_float32_states_on_a_bf16_head(matmul):
    """TRL's ``cast_lm_head_to_fp32`` (GRPO's option): float32 hidden states
    against a bf16 head outside autocast, computed in float32; the weight's
    gradient comes back in bf16."""
    x, w, t = _head(torch.bfloat16)
    x = x.detach().float().requires_grad_()
    g_lp = torch.randn(x.shape[0], generator=torch.Generator().manual_seed(8))
    zero = torch.zeros(x.shape[0])
    ref = _reference(x, w.float(), t, g_lp, zero, torch.float32)
    ours = _run(trl_utils._ChunkedLogProbFunction, x, w, t, g_lp, zero, matmul=matmul)
    theirs = _run(_original(), x, w, t, g_lp, zero)
    assert ours[3].dtype == torch.float32 and ours[4].dtype == torch.bfloat16
    for k in (0, 1, 3):
        assert _err(ours[k], ref[k]) <= max(2e-6, 1.5 * _err(theirs[k], ref[k])), k
    # The weight's gradient: float32 sums rounded once to bf16.
    assert _err(ours[4], ref[4]) <= max(4e-3, 1.5 * _err(theirs[4], ref[4]))


def test_calls_npukern_does_not_compute_run_trls(monkeypatch):
    x, w, t = _head(torch.float32)
    calls = []
    monkeypatch.setattr(_trl._LogProbs, "apply", lambda *a: calls.append(1))
    shim, orig = trl_utils._ChunkedLogProbFunction, _original()
    bias = torch.zeros(w.shape[0])
    other = w.detach().clone()  # not a patched model's head
    half = w.detach().half()
    _trl.register(half, "auto")
    for args in [(x, w, bias, t, 1.0, 4096, None, 1.0, OUTS),  # a bias
                 (x.detach().half(), half, None, t, 1.0, 4096, None, 1.0, OUTS),  # float16
                 (x, w, None, t, float("inf"), 4096, None, 1.0, OUTS),  # a temperature with no 1 / T
                 (x, other, None, t, 1.0, 4096, None, 1.0, OUTS)]:
        got, want = shim.apply(*args), orig.apply(*args)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)
    assert not calls


def test_another_trl_signature_is_left_alone(monkeypatch):
    """A TRL whose function takes other parameters keeps its own."""

    class Other(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, softcap, scale, outputs, extra):
            return hidden

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Other)
    assert not _trl.install()
    assert trl_utils._ChunkedLogProbFunction is Other


def test_patch_registers_and_unpatch_forgets():
    m = _model()
    hf.patch(m)
    w = m.get_output_embeddings().weight
    assert _trl._matmul_of(w) == "auto"
    hf.unpatch(m)
    assert _trl._matmul_of(w) is None


@pytest.mark.parametrize("late", [False, True], ids=["patch_then_trainer", "trainer_then_patch"])
@pytest.mark.parametrize("bf16", [False, True])
def test_sft_trainer_matches_stock(tmp_path, bf16, late):
    """``late``: the trainer built on the stock model and ``trainer.model``
    patched after (``SFTTrainer(model="name")`` builds the model itself):
    TRL's forward stays, its head runs on npukern, unpatch hands it back."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>")),
        pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    g = torch.Generator().manual_seed(3)
    rows = [{"input_ids": torch.randint(3, 300, (int(n),), generator=g).tolist()}
            for n in torch.randint(8, 40, (16,), generator=g)]
    logs = {}
    for name in ("stock", "patched"):
        model = _model()
        calls = []
        if name == "patched":
            if not late:
                hf.patch(model)
            orig = _trl._LogProbs.forward
            _trl._LogProbs.forward = staticmethod(lambda *a: calls.append(1) or orig(*a))
        try:
            args = trl.SFTConfig(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=4,
                                 logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", bf16=bf16,
                                 learning_rate=1e-3, seed=0, data_seed=0)
            trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                     processing_class=tok)
            if name == "patched" and late:
                assert hf.patch(trainer.model)["loss"] == 1
                assert hf.patch(trainer.model)["loss"] == 0  # once
            trainer.train()
        finally:
            if name == "patched":
                _trl._LogProbs.forward = staticmethod(orig)
        logs[name] = [h for h in trainer.state.log_history if "loss" in h]
        if name == "patched":
            assert len(calls) == 3
            head = trainer.model.get_output_embeddings().weight
            assert _trl.is_registered(head)
            assert hf.unpatch(trainer.model)["loss"] == 1
            assert not _trl.is_registered(head)
    tol = 2e-3 if bf16 else 1e-5
    for a, b in zip(logs["patched"], logs["stock"], strict=True):
        for k in ("loss", "entropy", "mean_token_accuracy"):
            assert a[k] == pytest.approx(b[k], rel=tol, abs=tol), (k, a, b)


def _words():
    """A word-level tokenizer over ``w0`` .. ``w296`` (ids 3 ..; pad, eos,
    unk 0-2, the tiny model's vocabulary of 300) and a maker of random texts
    of ``n`` words from one seeded generator, for the trainers that take
    text (DPO, GRPO)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(297)}}
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    g = torch.Generator().manual_seed(3)

    def text(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 297, (n,), generator=g))

    return tok, text


def test_dpo_trainer_matches_stock(tmp_path):
    """DPOTrainer (its metrics ask for ``mean_logits``) with the reference
    model patched after the trainer is built: both heads on npukern, the
    losses, log-probabilities, mean logits and rewards as stock's."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tok, text = _words()
    rows = [{"prompt": text(6), "chosen": text(5), "rejected": text(7)} for _ in range(16)]
    logs, calls = {}, []
    orig = _trl._LogProbs.forward
    _trl._LogProbs.forward = staticmethod(lambda ctx, x, w, *a: calls.append(id(w)) or orig(ctx, x, w, *a))
    try:
        for name in ("stock", "patched"):
            model, ref = _model(), _model()
            if name == "patched":
                hf.patch(model)
            args = trl.DPOConfig(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=4,
                                 logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                 learning_rate=1e-3, seed=0, data_seed=0)
            trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                                     processing_class=tok)
            if name == "patched":
                assert hf.patch(trainer.ref_model)["loss"] == 1
            trainer.train()
            logs[name] = [h for h in trainer.state.log_history if "loss" in h]
    finally:
        _trl._LogProbs.forward = staticmethod(orig)
    heads = {id(m.get_output_embeddings().weight) for m in (model, ref)}
    assert set(calls) == heads and len(calls) == 6
    keys = ("loss", "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy",
            "rewards/margins")
    for step, (a, b) in enumerate(zip(logs["patched"], logs["stock"], strict=True)):
        tol = 1e-5 if step == 0 else 2e-3  # later steps: Adam's sign-of-tiny-gradients spread
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=tol, abs=tol), (k, a, b)


def test_grpo_trainer_temperature(tmp_path, monkeypatch):
    """GRPOTrainer with a sampling temperature of 0.7 (TRL's logits over it
    in the head), a patched model: the same run on npukern's head and on
    TRL's own (the generations are the patched model's either way) logs the
    same gradient norm and entropy."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tok, text = _words()
    rows = [{"prompt": text(6)} for _ in range(8)]

    def reward(completions, **kw):
        return [len(c) / 10 for c in completions]

    logs, calls, takes = {}, [], _trl._takes
    orig = _trl._LogProbs.forward
    monkeypatch.setattr(_trl._LogProbs, "forward", staticmethod(lambda *a: calls.append(a[-1]) or orig(*a)))
    for name in ("trl", "npukern"):
        monkeypatch.setattr(_trl, "_takes", takes if name == "npukern" else (lambda *a: False))
        model = _model()
        hf.patch(model)
        args = trl.GRPOConfig(output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=4,
                              num_generations=4, max_completion_length=8, temperature=0.7, logging_steps=1,
                              report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3, seed=0, data_seed=0)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                                  processing_class=tok)
        trainer.train()
        logs[name] = [h for h in trainer.state.log_history if "loss" in h]
    assert len(calls) == 2 and all(c is not None and c.inv_t == 1 / 0.7 for c in calls)
    # GRPOConfig's bf16=True: the heads' products are bf16. Where npukern's
    # matmul takes them (the route), both heads sum them alike and the first
    # step agrees to 1e-5; where torch's does (AMD Zen 4, AMX: oneDNN), each
    # head's chunks are other matmul calls, whose bf16 logits can round
    # apart (Zen 4: 1.7e-4 in the first gradient norm), so 1e-3 throughout.
    same_products = route.matmul_route(torch.bfloat16)
    for step, (a, b) in enumerate(zip(logs["npukern"], logs["trl"], strict=True)):
        tol = 1e-5 if step == 0 and same_products else 1e-3
        for k in ("grad_norm", "entropy", "reward"):
            assert a[k] == pytest.approx(b[k], rel=tol, abs=tol), (k, a, b)


def test_trl_imported_after_patch(tmp_path):
    """hf.patch before TRL's import: the shim goes in when TRL's utilities
    are imported (a fresh interpreter: this one imported TRL already)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from npukern_torch import hf\n"
        "m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
        "    num_attention_heads=2, num_key_value_heads=1, vocab_size=64))\n"
        "hf.patch(m)\n"
        "assert 'trl.trainer.utils' not in sys.modules\n"
        "import trl.trainer.utils as u\n"
        "print(getattr(u._ChunkedLogProbFunction, '_npukern', False))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_top1_is_the_first_argmax():
    """Ties at the maximum (common among 16-bit logits): only the first
    counts, as torch's argmax and TRL's kernel say."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randint(0, 4, (200, 24), generator=g).to(torch.bfloat16)
    t = torch.randint(0, 24, (200,), generator=g)
    t[::2] = logits[::2].float().argmax(1)  # half the labels on a (first) maximum
    t[1::4] = 23 - logits[1::4].float().flip(1).argmax(1)  # a quarter on the last maximum
    out = torch.empty(200, dtype=torch.bool)
    _trl._top1(logits, t, out)
    want = logits.float().argmax(1) == t
    assert torch.equal(out, want) and want.any() and (~want).any()
