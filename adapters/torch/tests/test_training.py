"""The tiny LLaMA-like model (tiny_llama.py) trained 300 steps with Adam and
clip_grad_norm_(1.0): with npukern_torch's modules and clip against
pure PyTorch float32 (and float64, the judge of both).

Tolerance, and why: the two float32 runs compute the same functions with
different but equally valid roundings (npukern rounds y once from f32 and
sums embedding rows in position order; torch's composite rounds after each
op), so their curves may drift apart only as far as float32 rounding noise
carries a training run. That noise is measured here: the same torch run
started from weights moved by 1 ulp, and torch float32 against float64.
Bars: (a) every step's loss within 1e-5 relative of torch float32 (30x the
3e-7 measured); (b) npukern's largest distance to the float64 curve at most
twice the larger of the two noise measures, plus 1e-6 -- npukern's curve is
as close to the exact one as PyTorch's own float32 is."""

import torch

import npukern_torch
from conftest import record
from tiny_llama import batches, initial_state, loss_fn, npukern_model, torch_model

STEPS = 300


def train(model, clip):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for tokens, targets in batches(STEPS):
        opt.zero_grad()
        loss = loss_fn(model, tokens, targets)
        loss.backward()
        clip(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def test_loss_curve_matches_pytorch():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one GEMM summation order for every run
    try:
        state = initial_state()
        runs = {}
        for name, make, clip in [
            ("npukern", npukern_model, npukern_torch.clip_grad_norm_),
            ("torch32", torch_model, torch.nn.utils.clip_grad_norm_),
            ("torch64", lambda: torch_model(torch.float64), torch.nn.utils.clip_grad_norm_),
            ("torch32+1ulp", torch_model, torch.nn.utils.clip_grad_norm_),
        ]:
            model = make()
            model.load_state_dict(state)
            if name.endswith("1ulp"):
                with torch.no_grad():
                    for p in model.parameters():
                        p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
            runs[name] = train(model, clip)
    finally:
        torch.set_num_threads(threads)

    npk, t32, t64, t32p = runs["npukern"], runs["torch32"], runs["torch64"], runs["torch32+1ulp"]
    assert t32[-1] < 0.1 * t32[0], "the task was not learned; the comparison would be vacuous"
    rel = ((npk - t32).abs() / t32).max().item()
    to64 = (npk - t64).abs().max().item()
    noise = max((t32 - t64).abs().max().item(), (t32p - t32).abs().max().item())
    record("loss curve: max |npukern - torch f32| / loss", rel)
    record("loss curve: max |npukern - float64|", to64)
    record("loss curve: max |torch f32 - float64| or 1-ulp-start drift", noise)
    record("loss curve: first loss", t32[0])
    record("loss curve: last loss (npukern)", npk[-1])
    assert rel <= 1e-5, rel
    assert to64 <= 2 * noise + 1e-6, (to64, noise)
