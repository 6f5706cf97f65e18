"""Bad input raises the Python exception PyTorch users expect, with npukern's
detail in the message, and never crashes the interpreter."""

import subprocess
import sys

import pytest
import torch

import npukern_torch

ops = torch.ops.npukern


def test_index_out_of_range_names_position_and_value():
    grad = torch.ones(2, 3, 4)
    indices = torch.tensor([[0, 1, 2], [3, 9, -1]])
    with pytest.raises(IndexError, match=r"position 4, value 9"):
        ops.embedding_dense_backward(grad, indices, 5, -1, False)
    with pytest.raises(IndexError, match=r"position 2, value -7"):
        ops.embedding_dense_backward(torch.ones(3, 4), torch.tensor([1, 2, -7], dtype=torch.int32), 5, -1, False)
    emb = npukern_torch.Embedding(5, 4)
    with pytest.raises(IndexError, match=r"indices\[4\] = 9 .*position 4, value 9"):
        emb(indices)
    # The padding id itself is skipped, never an error (aten's rule).
    ops.embedding_dense_backward(torch.ones(2, 4), torch.tensor([0, 7]), 5, 7, False)


@pytest.mark.parametrize(
    "call",
    [
        lambda: ops.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4), 1e-6),
        lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(4, dtype=torch.int32), 1e-6),
        lambda: ops.rms_norm(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.float16), 1e-6),
        lambda: ops.add_rms_norm(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4), 1e-6),
        lambda: ops.rms_norm_backward(
            torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(2, 4), torch.ones(4), torch.ones(2, 1)
        ),
        lambda: ops.embedding_dense_backward(torch.ones(3, 4), torch.tensor([0.0, 1.0, 2.0]), 5, -1, False),
        lambda: ops.embedding_dense_backward(torch.ones(3, 4, dtype=torch.float64), torch.tensor([0, 1, 2]), 5, -1, False),
        lambda: ops.clip_grad_norm_([torch.ones(3), torch.ones(3, dtype=torch.int64)], 1.0),
        lambda: ops.embedding(torch.ones(4, 2), torch.tensor([1.5])),
    ],
    ids=["x f64", "gamma int", "gamma f16 with bf16 x", "x1/x2 dtypes", "dy dtype", "float indices", "grad f64",
         "int grad", "float indices fwd"],
)
def test_bad_dtypes_raise_type_error(call):
    with pytest.raises(TypeError):
        call()


@pytest.mark.parametrize(
    "call",
    [
        lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6),
        lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(2, 2, 4), 1e-6),
        lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(4), -1.0),
        lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(4), float("nan")),
        lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e300),
        lambda: ops.rms_norm(torch.ones([1] * 9 + [4]), torch.ones(4), 1e-6),
        lambda: ops.add_rms_norm(torch.ones(2, 4), torch.ones(3, 4), torch.ones(4), 1e-6),
        lambda: ops.rms_norm_backward(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4), torch.ones(3, 1)),
        lambda: ops.rms_norm_backward(torch.ones(2, 5), torch.ones(2, 4), torch.ones(4), torch.ones(2, 1)),
        lambda: ops.embedding_dense_backward(torch.ones(3, 4), torch.tensor([0, 1]), 5, -1, False),
        lambda: ops.embedding_dense_backward(torch.ones(3, 4), torch.tensor([0, 1, 2]), -5, -1, False),
        lambda: ops.embedding_dense_backward_shard(torch.ones(3, 4), torch.tensor([0, 1, 2]), 5, -2, -1, False),
        lambda: ops.embedding_shard(torch.ones(3, 4), torch.tensor([0]), 4, 2),
        lambda: ops.clip_grad_norm_([torch.ones(3)], -1.0),
    ],
    ids=["gamma shape", "gamma rank", "eps<0", "eps nan", "eps not f32", "rank 10", "x1/x2 shapes", "rstd shape",
         "dy shape", "indices count", "num_weights<0", "vocab_start<0", "shard past vocab", "max_norm<0"],
)
def test_bad_params_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_nonfinite_clip_is_runtime_error_like_torch():
    with pytest.raises(RuntimeError, match="NaN or Inf"):
        ops.clip_grad_norm_([torch.tensor([1.0, float("inf")])], 1.0, True)


def test_messages_carry_the_library_detail():
    with pytest.raises(ValueError, match=r"npukern::rms_norm: gamma: .*argument 'gamma'"):
        ops.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6)


def test_random_bad_calls_never_crash():
    """Hundreds of random malformed calls in a child interpreter: each returns
    or raises a Python exception; the child must exit normally."""
    code = r"""
import random, torch, npukern_torch
ops = torch.ops.npukern
rng = random.Random(5)
dts = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64]
def t():
    shape = [rng.choice([0, 1, 2, 3, 5, 17]) for _ in range(rng.randint(0, 4))]
    dt = rng.choice(dts)
    return (torch.randn(shape) * 3).to(dt) if dt.is_floating_point else torch.randint(-2, 6, shape, dtype=dt)
calls = [
    lambda: ops.rms_norm(t(), t(), rng.choice([1e-6, -1.0, 0.0])),
    lambda: ops.add_rms_norm(t(), t(), t(), 1e-6),
    lambda: ops.rms_norm_backward(t(), t(), t(), t()),
    lambda: ops.add_rms_norm_backward(t(), t(), t(), t(), t()),
    lambda: ops.embedding(t(), t(), rng.randint(-2, 4)),
    lambda: ops.embedding_shard(t(), t(), rng.randint(-1, 9), rng.randint(-1, 5)),
    lambda: ops.embedding_dense_backward(t(), t(), rng.randint(-1, 9), rng.randint(-2, 4), rng.random() < 0.5),
    lambda: ops.embedding_dense_backward_shard(t(), t(), rng.randint(-1, 9), rng.randint(-1, 5), -1, False),
    lambda: ops.grad_stats([t() for _ in range(rng.randint(0, 3))]),
    lambda: ops.clip_grad_norm_([t() for _ in range(rng.randint(0, 3))], rng.choice([1.0, -1.0, 0.0])),
]
ok = bad = 0
for _ in range(1500):
    try:
        rng.choice(calls)()
        ok += 1
    except (IndexError, TypeError, ValueError, RuntimeError):
        bad += 1
print(ok, bad)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ok, bad = map(int, out.stdout.split())
    assert ok > 50 and bad > 500, (ok, bad)
