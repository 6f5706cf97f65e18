"""The per-call paths of the adapter (issue 32 item 3): the C++ autograd
kernels' no-grad fast path, the auxiliary outputs, the workspace each thread
keeps (and the two-phase fallback when a call outgrows it), and small calls
on the calling thread. None may change a bit or a flag."""

import threading

import pytest
import torch

from conftest import backward_compiled_and_eager, rand, same_bits

ops = torch.ops.npukern


def _norm_all(x, gamma, dy):
    """rms_norm's outputs and both gradients, as plain tensors."""
    xx, gg = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    y, rstd = ops.rms_norm(xx, gg, 1e-6)
    y.backward(dy)
    return [y.detach(), rstd, xx.grad, gg.grad]


# Rows of 4096: one block; under and at torch's grain (32768 elements: the
# calling thread, then the thread pool); a workspace past the thread's 1 MiB
# buffer (the RmsNormGrad partials of 256 rows of 4096).
ROWS = [1, 7, 8, 64, 256]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_thread_workspace_never_changes_a_bit(dtype, gen):
    """Whatever the thread's buffer held before (grown, larger than the call
    needs, or too small: the two phases), every call gives the bits of the
    same call made first."""
    gamma = rand((4096,), dtype, 0.5, 1.5, gen=gen)
    data = {n: (rand((n, 4096), dtype, gen=gen), rand((n, 4096), dtype, -1, 1, gen=gen)) for n in ROWS}
    first = {n: _norm_all(x, gamma, dy) for n, (x, dy) in data.items()}
    for order in (ROWS[::-1], ROWS[1::2] + ROWS[::2]):
        for n in order:
            again = _norm_all(*data[n][:1], gamma, data[n][1])
            assert all(same_bits(a, b) for a, b in zip(again, first[n])), n


def test_threads_each_use_their_own_workspace(gen):
    """Calls running at once on several threads (the op releases the GIL)."""
    gamma = rand((4096,), torch.bfloat16, 0.5, 1.5, gen=gen)
    xs = [rand((r, 4096), torch.bfloat16, gen=gen) for r in (1, 3, 8, 64)]
    want = [ops.rms_norm(x, gamma, 1e-6) for x in xs]
    bad = []

    def work():
        for _ in range(200):
            for x, (y, rstd) in zip(xs, want):
                got = ops.rms_norm(x, gamma, 1e-6)
                if not (same_bits(got[0], y) and same_bits(got[1], rstd)):
                    bad.append(x.shape)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_no_grad_path_and_auxiliary_outputs(gen):
    """Nothing requiring grad (or grad mode off): no graph node. Recording:
    y has one, rstd / lse never require grad."""
    x = rand((3, 16), torch.float32, gen=gen)
    gamma = rand((16,), torch.float32, 0.5, 1.5, gen=gen)
    for y, rstd in (ops.rms_norm(x, gamma), ops.rms_norm(x.requires_grad_(), gamma)):
        assert not rstd.requires_grad and rstd.grad_fn is None
    assert y.requires_grad and y.grad_fn is not None
    with torch.no_grad():
        y, rstd = ops.rms_norm(x, gamma)
    assert not y.requires_grad and y.grad_fn is None
    y, rstd, s = ops.add_rms_norm(x, x, gamma)
    assert y.requires_grad and s.requires_grad and not rstd.requires_grad
    loss, lse = ops.cross_entropy(x, torch.tensor([0, 3, 15]))
    assert loss.requires_grad and not lse.requires_grad
    x.requires_grad_(False)
    y, _ = ops.rms_norm(x, gamma)
    assert not y.requires_grad and y.grad_fn is None


def test_compiled_autograd_runs_the_backward_nodes(gen):
    """The C++ autograd Functions under compiled autograd (which refuses a
    C++ Function's mark_non_differentiable: rstd and lse are returned beside
    the Function, not through it)."""
    x = rand((4, 16), torch.float32, gen=gen)
    x2 = rand((4, 16), torch.float32, gen=gen)
    gamma = rand((16,), torch.float32, 0.5, 1.5, gen=gen)
    target = torch.tensor([0, 5, 7, 1])

    def grads(backward):
        xx, gg = x.clone().requires_grad_(), gamma.clone().requires_grad_()
        y, _ = ops.rms_norm(xx, gg, 1e-6)
        a, _, s = ops.add_rms_norm(y, x2, gg, 1e-6)
        backward(ops.cross_entropy(a + s, target)[0])
        return xx.grad, gg.grad

    for a, b in zip(*backward_compiled_and_eager(grads)):
        assert same_bits(a, b)
