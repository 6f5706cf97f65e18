"""What a new user meets (issue 58 item 6): a word when master_weights
cannot apply or float16 trains unscaled, and an out-of-range label named
where the user put it, with a range that reads as half-open."""

import warnings

import pytest
import torch

from npukern_torch.optim import AdamW


def test_master_weights_on_a_float32_model_says_so_once():
    with pytest.warns(UserWarning, match="changes nothing"):
        AdamW(torch.nn.Linear(3, 3).parameters(), master_weights=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdamW(torch.nn.Linear(3, 3).to(torch.bfloat16).parameters(), master_weights=True)
        AdamW(torch.nn.Linear(3, 3).parameters())


def test_float16_params_hear_of_loss_scaling():
    with pytest.warns(UserWarning, match="GradScaler"):
        AdamW(torch.nn.Linear(3, 3).to(torch.float16).parameters())


def test_an_out_of_range_label_is_named_where_the_user_put_it():
    pytest.importorskip("transformers")
    from hf_models import VOCAB, build, tokens
    from npukern_torch import hf

    model = build("llama", torch.float32)
    hf.patch(model)
    x = tokens()
    labels = x.clone()
    labels[1, 5] = VOCAB + 3  # the kernel sees it at shifted position (1, 4)
    with pytest.raises(IndexError, match=rf"labels\[1, 5\] = {VOCAB + 3} is out of range "
                                          rf"\(want 0 <= label < {VOCAB}, or -100 to ignore it\)"):
        model(x, labels=labels)


def test_the_kernels_own_range_reads_half_open():
    import npukern_torch

    with pytest.raises(IndexError, match=r"want 0 <= target < 10"):
        npukern_torch.cross_entropy(torch.randn(4, 10), torch.tensor([1, 2, 10, 3]))
