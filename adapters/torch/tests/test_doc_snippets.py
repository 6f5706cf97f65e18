"""The documents' Python snippets run as written: each ```python block is
read from the document itself (README.md, docs/pytorch.md,
docs/huggingface.md) and executed, so an edit to a document is what is
tested. Where a snippet names something only a user has (a Hub checkpoint),
the test swaps in the smallest stand-in and says so."""

import re
from pathlib import Path

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[3]


def python_blocks(doc):
    """The ```python blocks of `doc` (relative to the repository root), in
    order, dedented when indented inside a list item."""
    text = (ROOT / doc).read_text()
    blocks = []
    for indent, body in re.findall(r"^( *)```python\n(.*?)^\1```$", text, flags=re.S | re.M):
        blocks.append("\n".join(line[len(indent):] for line in body.splitlines()))
    assert blocks, f"no ```python block in {doc}"
    return blocks


def run(code, namespace=None):
    """Executes `code` as a module would (its own globals) and returns them."""
    namespace = {"__name__": "__snippet__"} if namespace is None else namespace
    exec(compile(code, "<snippet>", "exec"), namespace)
    return namespace


def tiny_llama_config():
    """A 2-layer Llama, the model the documents' counts are given for."""
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def test_readme_python_snippet_runs():
    (code,) = python_blocks("README.md")
    ns = run(code)
    # What its comments promise: the in-place sum, the fused loss equal to the model's.
    assert ns["residual"].dtype == torch.bfloat16 and ns["y"].shape == (8, 4096)
    assert ns["norm"].weight.grad is not None
    assert torch.isfinite(ns["loss"]) and ns["model"].lm_head.weight.grad is not None
    model, ids = ns["model"], ns["input_ids"]
    with torch.no_grad():
        assert torch.allclose(ns["loss"], model(ids, labels=ids).loss, rtol=1e-5)


def test_pytorch_md_snippet_runs():
    (code,) = python_blocks("docs/pytorch.md")
    ns = run(code)
    assert torch.isfinite(ns["total"])
    assert ns["x_sum"].shape == ns["x1"].shape


def test_huggingface_md_snippets_run(capsys):
    """The patch call (a tiny 2-layer Llama in place of the Hub checkpoint),
    its printed counts equal to the ones the page shows, and the `kernels`
    route where that package is installed."""
    blocks = python_blocks("docs/huggingface.md")
    patched = [b for b in blocks if "from_pretrained(" in b]
    assert patched, "docs/huggingface.md: no from_pretrained snippet"
    for code in patched:
        shown = re.search(r"^# (\{.*\})", code, flags=re.M).group(1)
        counts = eval(shown.split("}")[0] + "}")  # the dict the page prints (a literal)
        code = re.sub(r"from_pretrained\([^)]*\)", "from_config(_config)", code)
        ns = run(code, {"__name__": "__snippet__", "_config": tiny_llama_config()})
        got = eval(capsys.readouterr().out.strip().splitlines()[-1])
        assert got == counts, f"the page shows {counts}, patch gave {got}"
    for kernels_code in (b for b in blocks if "kernelize(" in b):
        pytest.importorskip("kernels")
        run(kernels_code, ns)  # on the model the last snippet patched
        ns["model"](torch.randint(0, 128, (1, 8)))

