"""PyTorch's own inputs and error inputs for its AdamW and Adam
(``torch.testing._internal.common_optimizers.optim_db``: each
OptimizerInfo's ``optim_inputs_func`` and ``optim_error_inputs_func``), run
against npukern_torch.optim's classes: every CPU input steps within
float32's reach of torch's optimizer over 5 steps (float64: torch's own
step, equal), and every error input raises what torch's raises, but for
the differences listed in ``DIFFERENCES`` with their reasons."""

import copy

import pytest
import torch

from npukern_torch.optim import Adam, AdamW

import torch.testing._internal.common_optimizers as common  # noqa: E402 (expecttest: scripts/torch_test.sh installs it)

OURS = {torch.optim.Adam: Adam, torch.optim.AdamW: AdamW}
INFOS = [info for info in common.optim_db if info.optim_cls in OURS]

# Error inputs whose torch error npukern's optimizer does not raise, and why.
DIFFERENCES = {
    "lr as Tensor doesn't work with foreach & not capturable":
        "foreach is accepted and ignored: the step is always one fused pass, which takes a tensor lr",
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True":
        "foreach is accepted and ignored (as above): tensor betas are read as floats",
}


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in ((3, 4), (5,), (2, 3, 2))]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _inputs():
    for info in INFOS:
        for dtype in (torch.float32, torch.float64):
            for inp in info.optim_inputs_func("cpu", dtype):
                yield pytest.param(info.optim_cls, dtype, inp.kwargs,
                                   id=f"{info.optim_cls.__name__}-{str(dtype)[6:]}-{inp.desc}")


@pytest.mark.parametrize("cls,dtype,kwargs", list(_inputs()))
def test_torch_inputs_step_as_torch_does(cls, dtype, kwargs):
    theirs_p, ours_p = _params(dtype), _params(dtype)
    theirs = cls(theirs_p, **copy.deepcopy(kwargs))
    ours = OURS[cls](ours_p, **copy.deepcopy(kwargs))
    for step in range(5):
        _grads(theirs_p, step)
        _grads(ours_p, step)
        theirs.step()
        ours.step()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for a, b in zip(ours_p, theirs_p):
        torch.testing.assert_close(a, b, **tol)
    # The state dict loads into torch's optimizer and back.
    again = OURS[cls](_params(dtype), **copy.deepcopy(kwargs))
    again.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())


def _error_inputs():
    for info in INFOS:
        for err in info.optim_error_inputs_func("cpu", torch.float32):
            inp = err.optimizer_error_input
            yield pytest.param(info.optim_cls, err, id=f"{info.optim_cls.__name__}-{inp.desc}")


@pytest.mark.parametrize("cls,err", list(_error_inputs()))
def test_torch_error_inputs_raise_what_torch_raises(cls, err):
    inp = err.optimizer_error_input
    params = inp.params if inp.params is not None else _params(torch.float32)
    ours = OURS[cls]

    def run():
        opt = ours(params, **inp.kwargs)
        if err.error_on == common.OptimizerErrorEnum.STEP_ERROR:
            opt.step()

    if inp.desc in DIFFERENCES:
        run()  # npukern takes it (the reason is in DIFFERENCES)
        return
    if issubclass(err.error_type, Warning):
        with pytest.warns(err.error_type, match=err.error_regex):
            run()
    else:
        with pytest.raises(err.error_type, match=err.error_regex):
            run()


def test_the_differences_are_still_torch_errors():
    # Each listed difference is an error input torch still ships (none stale).
    descs = {e.optimizer_error_input.desc for info in INFOS for e in info.optim_error_inputs_func("cpu", torch.float32)}
    assert set(DIFFERENCES) <= descs
