"""Hugging Face's Trainer on a patched model: the real client's training
and evaluation loops (dataset columns kept by the forward's signature,
num_items_in_batch passed under gradient accumulation, logits for
compute_metrics in evaluation; needs `accelerate`, Trainer's own
dependency, which scripts/torch_test.sh installs), generate, gradient
checkpointing and save_pretrained."""

import inspect

import pytest
import torch

from hf_models import FAMILIES, build, tokens, twin
from npukern_torch import hf


def test_patched_forwards_keep_the_stock_signature():
    for family in FAMILIES:
        stock = build(family)
        patched = twin(stock)
        hf.patch(patched)
        for (name, a), b in zip(stock.named_modules(), patched.modules()):
            if "forward" in vars(b):
                assert inspect.signature(b.forward) == inspect.signature(a.forward), (family, name)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.x = torch.cat([tokens(batch=1, seed=seed + i) for i in range(n)])

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _accuracy(p):
    logits = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
    return {"acc": float((logits.argmax(-1)[:, :-1] == p.label_ids[:, 1:]).mean())}


def _run(model, out_dir):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             max_steps=4, gradient_accumulation_steps=2, learning_rate=1e-3, report_to=[],
                             use_cpu=True, save_strategy="no", seed=0, data_seed=0, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(32, 100), eval_dataset=_Tokens(8, 200),
                      compute_metrics=_accuracy)
    return trainer.train().training_loss, trainer.evaluate()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_trainer_trains_and_evaluates_a_patched_model(family, tmp_path):
    pytest.importorskip("accelerate")
    stock = build(family, seed=3)
    patched = twin(stock)
    assert hf.patch(patched)["loss"] == 1
    calls = []
    real = hf._loss.linear_cross_entropy

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    hf._loss.linear_cross_entropy = counted
    try:
        train_s, eval_s = _run(stock, tmp_path / "stock")
        train_p, eval_p = _run(patched, tmp_path / "patched")
    finally:
        hf._loss.linear_cross_entropy = real
    assert len(calls) == 8  # 4 steps x 2 accumulated micro-batches, fused; evaluation stock
    assert abs(train_p - train_s) <= 1e-5 * abs(train_s), (train_s, train_p)
    assert abs(eval_p["eval_loss"] - eval_s["eval_loss"]) <= 1e-5 * abs(eval_s["eval_loss"])
    assert eval_p["eval_acc"] == eval_s["eval_acc"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_checkpointing_and_save_of_a_patched_model(family, tmp_path):
    # More of transformers' own machinery over a patched model: greedy
    # generate (KV cache, one-token RoPE and norms), gradient checkpointing
    # (the patched forwards recomputed in backward) and save_pretrained
    # (stock parameter names: a stock class loads it).
    stock = build(family, seed=3)
    patched = twin(stock)
    hf.patch(patched)
    x = tokens(seed=5)
    stock.eval()
    patched.eval()
    with torch.no_grad():
        want = stock.generate(x[:, :5], max_new_tokens=8, do_sample=False)
        got = patched.generate(x[:, :5], max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    patched.train()
    ckpt = twin(patched)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    a, b = patched(x, labels=x).loss, ckpt(x, labels=x).loss
    a.backward()
    b.backward()
    assert torch.equal(a, b)
    for p, q in zip(patched.parameters(), ckpt.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad))
    patched.save_pretrained(tmp_path)
    loaded = type(stock).from_pretrained(tmp_path)
    assert set(loaded.state_dict()) == set(stock.state_dict())
    for k, v in patched.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_trainer_with_npukern_adamw_master_weights(tmp_path):
    # The recipe of docs/huggingface.md: the model held in bf16, patched, and
    # stepped by npukern's AdamW with float32 masters and the clip inside the
    # step (Trainer's own clip off: max_grad_norm=0), no autocast; beside
    # stock Trainer's recipe (float32 params, bf16=True autocast, its clip and
    # torch's AdamW). Both learn; the bf16 + masters run's loss tracks stock's.
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from npukern_torch.optim import AdamW

    stock = build("llama", seed=3)
    patched = twin(stock).to(torch.bfloat16)
    hf.patch(patched)
    common = dict(per_device_train_batch_size=4, max_steps=12, learning_rate=3e-3, report_to=[], use_cpu=True,
                  save_strategy="no", seed=0, data_seed=0, logging_steps=1, lr_scheduler_type="constant")
    data = _Tokens(4, 100)
    data.x = data.x.repeat(12, 1)  # four sequences to learn
    ts = Trainer(model=stock, args=TrainingArguments(output_dir=str(tmp_path / "s"), bf16=True, **common),
                 train_dataset=data)
    ts.train()
    opt = AdamW(patched.parameters(), lr=3e-3, weight_decay=0.0, master_weights=True, max_grad_norm=1.0)
    tp = Trainer(model=patched, args=TrainingArguments(output_dir=str(tmp_path / "p"), max_grad_norm=0.0, **common),
                 train_dataset=data, optimizers=(opt, None))
    tp.train()
    ls = [h["loss"] for h in ts.state.log_history if "loss" in h]
    lp = [h["loss"] for h in tp.state.log_history if "loss" in h]
    assert len(ls) == len(lp) == 12
    assert lp[-1] < 0.8 * lp[0] and ls[-1] < 0.8 * ls[0], (ls, lp)
    assert abs(lp[-1] - ls[-1]) < 0.1 * ls[-1], (ls, lp)
    assert opt.grad_norm is not None and torch.isfinite(opt.grad_norm)
    for p in patched.parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, opt.state[p]["master"].bfloat16())
