"""Hugging Face transformers models on npukern, in one call.

``patch(model)`` swaps, in place, every RMSNorm of the Llama, Mistral,
Qwen2, Qwen3 (q/k norms included), Gemma, Gemma2 and Gemma3 families and the
input embedding (``nn.Embedding``, Gemma's scaled embedding with its scale)
for npukern's modules, the MLPs' ``act_fn(gate_proj(x)) * up_proj(x)`` (SiLU
families) for npukern's SwiGLU, and the family's ``apply_rotary_pos_emb``
for npukern's RoPE (q and k in one call, the composite's exact bits), each with its family's numerics (``casting="llama"``
or ``"gemma"``), keeping the very same Parameter objects: weight tying,
optimizer state and ``state_dict`` are unchanged. ``unpatch(model)``
restores the original modules. ``apply_to_transformers()`` is the
class-level form (Liger's ``apply_liger_kernel_to_llama()``): models built
after it get npukern's RMSNorm. ``KERNEL_REPO`` is a local `kernels`
repository for transformers' own route (``KernelConfig`` / ``kernelize``):
its layers take their weights from the module they replace.
"""

import importlib
import types
import warnings
from pathlib import Path

import torch

from . import functional as _F
from .modules import Embedding, RMSNorm

# family -> (transformers module, RMSNorm class, casting, scaled embedding class or None)
FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "llama", None),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm", "llama", None),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm", "llama", None),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm", "llama", None),
    "gemma": ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", "gemma", "GemmaTextScaledWordEmbedding"),
    "gemma2": ("transformers.models.gemma2.modeling_gemma2", "Gemma2RMSNorm", "gemma",
               "Gemma2TextScaledWordEmbedding"),
    "gemma3": ("transformers.models.gemma3.modeling_gemma3", "Gemma3RMSNorm", "gemma",
               "Gemma3TextScaledWordEmbedding"),
}

#: A local `kernels` repository (``build/torch-universal``) whose layers are
#: npukern's: ``KernelConfig({"RMSNorm": f"{KERNEL_REPO}:LlamaRMSNorm"}, use_local_kernel=True)``.
KERNEL_REPO = Path(__file__).resolve().parent / "hf_kernel"


def _family_classes():
    """{class: (family, casting)} and {scaled embedding class: family} of the
    families whose transformers module imports."""
    norms, embeddings = {}, {}
    for family, (module, norm, casting, scaled) in FAMILIES.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for cls in {getattr(mod, norm, None), _ORIGINAL_CLASSES.get((module, norm))} - {None}:
            norms[cls] = (family, casting)
        for cls in {getattr(mod, scaled or "", None), _ORIGINAL_CLASSES.get((module, scaled))} - {None}:
            embeddings[cls] = family
    return norms, embeddings


def _eps(module):
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return 1e-6 if eps is None else float(eps)


class HFRMSNorm(RMSNorm):
    """npukern's RMSNorm standing in for a Hugging Face RMSNorm: the same
    ``weight`` Parameter and eps, the family's numerics, and
    ``variance_epsilon`` as the Llama classes name eps. Built with
    ``(hidden_size, eps=1e-6)`` like them (weights ones for "llama", zeros for
    the zero-centred "gemma")."""

    def __init__(self, hidden_size, eps=1e-6, *, casting="llama", device=None, dtype=None):
        super().__init__(hidden_size, eps, device=device, dtype=dtype, casting=casting)
        if casting == "gemma":
            with torch.no_grad():
                self.weight.zero_()

    @property
    def variance_epsilon(self):
        """Llama's name for eps."""
        return self.eps

    @classmethod
    def replacing(cls, module, casting):
        """A module sharing `module`'s weight Parameter (no copy)."""
        new = cls(tuple(module.weight.shape), _eps(module), casting=casting, device="meta")
        new.weight = module.weight
        return new


class HFScaledEmbedding(Embedding):
    """npukern's Embedding with Gemma's ``embed_scale`` (the output times the
    scale in the weight's dtype, as ``GemmaTextScaledWordEmbedding``)."""

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


def _embedding_replacing(module, scaled):
    cls = HFScaledEmbedding if scaled else Embedding
    new = cls(module.num_embeddings, module.embedding_dim, module.padding_idx,
              scale_grad_by_freq=module.scale_grad_by_freq, device="meta")
    new.weight = module.weight
    if scaled:
        new.register_buffer("embed_scale", module.embed_scale, persistent=False)
        new.scalar_embed_scale = getattr(module, "scalar_embed_scale", None)
    return new


def _swap(parent, name, old, new):
    # Kept outside the module tree (no state_dict entry, no parameters of its own).
    object.__setattr__(new, "_npukern_original", old)
    setattr(parent, name, new)


def _swiglu_mlp_forward(self, x):
    """An MLP's forward with ``act_fn(gate) * up`` as npukern's SwiGLU in eager
    numerics (silu rounded to the dtype, then the product, as stock)."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.device.type != "cpu" or gate.dtype != up.dtype:
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(_F.silu_mul(gate, up, eager=True))


def _is_silu(act):
    # torch's nn.SiLU, or transformers' SiLUActivation (F.silu, kernels-hub decorated).
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _is_swiglu_mlp(m):
    return all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj")) and _is_silu(getattr(m, "act_fn", None))


# family module -> its own apply_rotary_pos_emb, while npukern's stands in.
_ORIGINAL_ROPE = {}


def _rope_for(original):
    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        if (q.device.type != "cpu" or k.dtype != q.dtype or cos.dtype not in (q.dtype, torch.float32)
                or sin.dtype != cos.dtype or q.shape[-1] % 2):
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return _F.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, eager=True)

    apply_rotary_pos_emb.__doc__ = "npukern's RoPE standing in for transformers' apply_rotary_pos_emb."
    return apply_rotary_pos_emb


def _patch_rope(model):
    """Swaps the rotary function of every family module whose attention layers
    the model has; returns how many attention layers now use npukern's."""
    modules = {mod for mod, *_ in FAMILIES.values()}
    count = 0
    for m in model.modules():
        name = type(m).__module__
        if name in modules and type(m).__name__.endswith("Attention"):
            mod = importlib.import_module(name)
            if name not in _ORIGINAL_ROPE and hasattr(mod, "apply_rotary_pos_emb"):
                _ORIGINAL_ROPE[name] = mod.apply_rotary_pos_emb
                mod.apply_rotary_pos_emb = _rope_for(_ORIGINAL_ROPE[name])
            if name in _ORIGINAL_ROPE and not getattr(m, "_npukern_rope", False):
                object.__setattr__(m, "_npukern_rope", True)
                count += 1
    return count


def unpatch_rope() -> None:
    """Restores every family module's own ``apply_rotary_pos_emb``."""
    for name, fn in list(_ORIGINAL_ROPE.items()):
        importlib.import_module(name).apply_rotary_pos_emb = fn
        del _ORIGINAL_ROPE[name]


def patch(model: torch.nn.Module, *, rms_norm: bool = True, embedding: bool = True, mlp: bool = True,
          rope: bool = True) -> dict:
    """Swaps, in place, the model's RMSNorm modules of the supported families
    and its input embeddings for npukern's, its SiLU-gated MLPs' activation
    for npukern's SwiGLU (``mlp``) and its families' rotary embedding for
    npukern's RoPE (``rope``: a swap of the family module's function, shared
    by every model of that family in the process; the composite's exact
    bits); returns the counts, e.g. ``{"rms_norm": 5, "embedding": 1,
    "mlp": 2, "rope": 2}``. Modules already patched are left
    alone (a second call counts 0). An RMSNorm class it does not know is left
    alone and named in a warning. Embeddings with ``max_norm`` or
    ``sparse=True`` (which npukern does not take) are left alone."""
    norms, scaled_embeddings = _family_classes()
    counts = {"rms_norm": 0, "embedding": 0, "mlp": 0, "rope": _patch_rope(model) if rope else 0}
    for m in model.modules():
        if mlp and _is_swiglu_mlp(m) and "forward" not in vars(m):
            m.forward = types.MethodType(_swiglu_mlp_forward, m)
            counts["mlp"] += 1
    unknown = set()
    input_embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (RMSNorm, Embedding)):
                continue  # npukern's already (patched, or built after apply_to_transformers)
            kind = type(child)
            if rms_norm and kind in norms:
                _swap(parent, name, child, HFRMSNorm.replacing(child, norms[kind][1]))
                counts["rms_norm"] += 1
            elif rms_norm and kind.__name__.endswith("RMSNorm") and not isinstance(child, RMSNorm):
                unknown.add(f"{kind.__module__}.{kind.__qualname__}")
            elif embedding and (kind is torch.nn.Embedding or kind in scaled_embeddings) and (
                input_embeddings is None or child is input_embeddings
            ):
                if child.max_norm is not None or child.sparse:
                    continue
                _swap(parent, name, child, _embedding_replacing(child, kind in scaled_embeddings))
                counts["embedding"] += 1
    if unknown:
        warnings.warn(
            "npukern_torch.hf.patch left these RMSNorm classes alone (their numerics are not known to it): "
            + ", ".join(sorted(unknown)),
            stacklevel=2,
        )
    return counts


def unpatch(model: torch.nn.Module) -> dict:
    """Puts back the original modules :func:`patch` replaced (they share the
    same Parameters, so training since the patch is kept), the MLPs' forward,
    and the family modules' rotary function; returns the counts."""
    counts = {"rms_norm": 0, "embedding": 0, "mlp": 0, "rope": 0}
    for m in model.modules():
        fwd = vars(m).get("forward")
        if getattr(fwd, "__func__", None) is _swiglu_mlp_forward:
            del m.forward
            counts["mlp"] += 1
        if vars(m).pop("_npukern_rope", False):
            counts["rope"] += 1
    unpatch_rope()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            original = getattr(child, "_npukern_original", None)
            if original is None:
                continue
            original.weight = child.weight
            setattr(parent, name, original)
            counts["rms_norm" if isinstance(child, RMSNorm) else "embedding"] += 1
    return counts


# (module, class name) -> the transformers class apply_to_transformers replaced.
_ORIGINAL_CLASSES = {}


def _stand_in(family, casting, original):
    """A class with the transformers class's constructor that builds npukern's module."""

    class StandIn(HFRMSNorm):
        def __init__(self, hidden_size, eps=1e-6, **kwargs):
            super().__init__(hidden_size, eps, casting=casting, **kwargs)

    StandIn.__name__ = StandIn.__qualname__ = original.__name__
    StandIn.__doc__ = f"npukern's RMSNorm standing in for transformers' {original.__name__} ({family})."
    return StandIn


def apply_to_transformers(families=None) -> list:
    """The class-level form: replaces the RMSNorm classes of `families`
    (default: all of :data:`FAMILIES`) in their transformers modules, so that
    models built afterwards hold npukern's RMSNorm with the family's numerics
    (call :func:`patch` on such a model for the input embedding, which is
    torch's own ``nn.Embedding`` class). Returns the families applied;
    :func:`revert_transformers` undoes it."""
    applied = []
    for family in families or FAMILIES:
        module, norm, casting, _scaled = FAMILIES[family]
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if (module, norm) not in _ORIGINAL_CLASSES:
            _ORIGINAL_CLASSES[(module, norm)] = getattr(mod, norm)
            setattr(mod, norm, _stand_in(family, casting, _ORIGINAL_CLASSES[(module, norm)]))
        applied.append(family)
    return applied


def revert_transformers() -> None:
    """Restores the transformers classes :func:`apply_to_transformers` replaced."""
    for (module, norm), cls in list(_ORIGINAL_CLASSES.items()):
        setattr(importlib.import_module(module), norm, cls)
        del _ORIGINAL_CLASSES[(module, norm)]
