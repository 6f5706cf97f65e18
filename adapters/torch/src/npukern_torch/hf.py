"""Hugging Face transformers models on npukern, in one call.

``patch(model)`` swaps, in place and in that model alone, every RMSNorm of
the Llama, Mistral, Qwen2, Qwen3 (q/k norms included), Gemma, Gemma2 and
Gemma3 families and the input embedding (``nn.Embedding``, Gemma's scaled
embedding with its scale) for npukern's modules, the MLPs'
``act_fn(gate_proj(x)) * up_proj(x)`` for npukern's SwiGLU (SiLU families)
or GeGLU (Gemma's ``gelu_pytorch_tanh``),
and the attention layers' ``apply_rotary_pos_emb`` for npukern's RoPE (q and
k in one call, the composite's exact bits; the layer's own forward reads it,
the transformers module is untouched), each with its family's numerics
(``casting="llama"`` or ``"gemma"``), keeping the very same Parameter
objects: weight tying, optimizer state and ``state_dict`` are unchanged.
Nothing process-wide changes: a model that was never patched runs no
npukern op. ``unpatch(model)`` restores that model's original modules. ``apply_to_transformers()`` is the
class-level form (Liger's ``apply_liger_kernel_to_llama()``): models built
after it get npukern's RMSNorm. ``KERNEL_REPO`` is a local `kernels`
repository for transformers' own route (``KernelConfig`` / ``kernelize``):
its layers take their weights from the module they replace.
"""

import ast
import importlib
import inspect
import itertools
import sys
import textwrap
import types
import warnings
from pathlib import Path

import torch

from . import _trl
from . import functional as _F
from . import loss as _loss
from . import route as _route
from ._dtypes import KERNEL_DTYPES, on_kernels
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

    def _torch_norm(self, x):
        """The family's own forward, for inputs the kernels do not take
        (float64, other devices): transformers computes in float32 whatever
        x's dtype, then Llama rounds the normalized x to x's dtype and
        multiplies by the weight, Gemma multiplies by ``1 + weight`` in
        float32 and rounds once."""
        xf = x.float()
        normalized = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cast_before_gamma:
            return self.weight * normalized.to(x.dtype)
        return (normalized * (self.offset + self.weight.float())).type_as(x)

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


def _gated_mlp_forward(module, x):
    """An MLP's forward with ``act_fn(gate) * up`` as npukern's SwiGLU (SiLU
    families) or GeGLU (GELU families: Gemma, Gemma2, Gemma3), in eager
    numerics (the activation rounded to the dtype, then the product, as
    stock). What the kernel does not take (another device, float64, two
    dtypes that torch would promote) runs the stock composite, with the
    stock result."""
    gate, up = module.gate_proj(x), module.up_proj(x)
    if not on_kernels(gate, up) or gate.dtype != up.dtype or gate.shape != up.shape:
        return module.down_proj(module.act_fn(gate) * up)
    act = module.act_fn
    if _is_silu(act):
        return module.down_proj(_F.silu_mul(gate, up, eager=True))
    return module.down_proj(_F.gelu_mul(gate, up, _gelu_form(act), eager=True))


def _is_silu(act):
    # torch's nn.SiLU, or transformers' SiLUActivation (F.silu, kernels-hub decorated).
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _gelu_form(act):
    """"tanh" or "none" when `act` is ``F.gelu`` with that approximation
    (torch's nn.GELU; transformers' GELUTanh, Gemma's ``gelu_pytorch_tanh``,
    and GELUActivation, unless they run their Python formulas, whose bits
    differ); else None."""
    if isinstance(act, torch.nn.GELU):
        return act.approximate if act.approximate in ("tanh", "none") else None
    name, fn = type(act).__name__, getattr(act, "act", None)
    if name == "GELUTanh" and getattr(fn, "func", None) is torch.nn.functional.gelu \
            and getattr(fn, "keywords", None) == {"approximate": "tanh"} and not getattr(fn, "args", ()):
        return "tanh"
    if name == "GELUActivation" and fn is torch.nn.functional.gelu:
        return "none"
    return None


def _has_gated_mlp_parts(m):
    """gate_proj, up_proj, down_proj and an act_fn npukern computes."""
    if not all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj")):
        return False
    act = getattr(m, "act_fn", None)
    return _is_silu(act) or _gelu_form(act) is not None


def _is_gated_mlp(m):
    """An MLP whose forward is the one :func:`_gated_mlp_forward` computes.
    The parts alone do not say so: transformers has MLPs with the same
    attributes whose forward also clamps (DeepSeek-V4, GLM-5), scales
    (Falcon-H1), sparsifies (Gemma-3n), applies dropout (Seed-OSS, T5Gemma)
    or projects first (GLM-4V's patch merger); swapped, they would silently
    compute another function."""
    return _has_gated_mlp_parts(m) and _forward_is_gated_mlp(type(m))


# class -> whether its forward is exactly the gated MLP's (read once).
_GATED_MLP_FORMS = {}


def _forward_is_gated_mlp(cls):
    """Whether `cls.forward`'s source is ``down_proj(act_fn(gate_proj(x)) *
    up_proj(x))`` (the product either way round), returned directly or
    through locals each read once, and nothing else: the statement
    transformers' Llama and Gemma MLPs (and ~150 others) are. A forward
    whose source cannot be read is not known to be it."""
    known = _GATED_MLP_FORMS.get(cls)
    if known is None:
        found = _source_def(getattr(cls, "forward", None))
        known = _GATED_MLP_FORMS[cls] = found is not None and _is_gated_mlp_def(*found)
    return known


def _source_def(fn):
    """The function definition in `fn`'s source (decorators followed to
    the innermost) and its body without a docstring; None when the source
    cannot be read."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return node, body


def _is_gated_mlp_def(fn, body):
    if fn.decorator_list:
        return False
    a = fn.args
    if a.posonlyargs or a.vararg or a.kwonlyargs or a.kwarg or a.defaults or len(a.args) != 2:
        return False
    me, x = a.args[0].arg, a.args[1].arg

    def call(node, attr, arg):  # self.<attr>(<arg>), one positional argument
        return (isinstance(node, ast.Call) and not node.keywords and len(node.args) == 1
                and isinstance(node.func, ast.Attribute) and node.func.attr == attr
                and isinstance(node.func.value, ast.Name) and node.func.value.id == me and arg(node.args[0]))

    def is_x(node):
        return isinstance(node, ast.Name) and node.id == x

    def product(node):
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
            return False
        act = lambda t: call(t, "act_fn", lambda g: call(g, "gate_proj", is_x))  # noqa: E731
        up = lambda t: call(t, "up_proj", is_x)  # noqa: E731
        return act(node.left) and up(node.right) or up(node.left) and act(node.right)

    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return False
    # Locals assigned once (to a name other than x) and read once, put in
    # place of their reads: the statement the forward returns.
    env = {}
    for st in body[:-1]:
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)):
            return False
        name = st.targets[0].id
        if name in env or name in (me, x):
            return False
        env[name] = _substituted(st.value, env)
    out = _substituted(body[-1].value, env)
    return not env and call(out, "down_proj", product)


def _substituted(node, env):
    """`node` with each name of `env` replaced by its expression, taken out
    of `env` (a second read then finds the bare name, which matches no
    part: the forward is not the gated MLP's)."""
    class Sub(ast.NodeTransformer):
        def visit_Name(self, n):
            return env.pop(n.id, n)

    return Sub().visit(node)


def _rope(original, q, k, cos, sin, unsqueeze_dim):
    """transformers' ``apply_rotary_pos_emb`` on npukern, with its result
    dtype and bits: q (k) and the tables are first promoted as torch's
    ``q * cos`` would promote them (autocast's bfloat16 q with float32 cos
    gives float32), then rotated in eager numerics. What the kernel does not
    take runs `original`."""
    one_dtype = q.dtype == k.dtype == cos.dtype == sin.dtype  # the usual case: no promotion to work out
    if one_dtype:
        rq = rk = q.dtype
    else:
        rq = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)
        rk = torch.promote_types(torch.promote_types(k.dtype, cos.dtype), sin.dtype)
    if (rq != rk or rq not in KERNEL_DTYPES or q.shape[-1] % 2 or cos.dim() == 0 or sin.dim() == 0
            or not (q.is_cpu and k.is_cpu and cos.is_cpu and sin.is_cpu)):
        return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    if not one_dtype:
        q, k, cos, sin = (t if t.dtype == rq else t.to(rq) for t in (q, k, cos, sin))
    return _F.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, eager=True)


# The signatures transformers' apply_rotary_pos_emb has had; the stand-in
# keeps the one it replaces (a positional unsqueeze_dim must land there).
_ROPE_SIGNATURES = {
    ("q", "k", "cos", "sin", "unsqueeze_dim"): "new",
    ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"): "old",
}


def _rope_for(original):
    """npukern's RoPE with `original`'s exact signature, or None for a
    signature this adapter does not know (then nothing is swapped). With the
    `kernels` package, transformers wraps the function in a module
    (``use_kernelized_func``) whose forward carries that signature."""
    target = original.forward if isinstance(original, torch.nn.Module) else original
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return None
    form = _ROPE_SIGNATURES.get(tuple(params))
    if form is None or params["unsqueeze_dim"].default != 1:
        return None
    if form == "new":
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            return _rope(original, q, k, cos, sin, unsqueeze_dim)
    else:
        def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            return _rope(original, q, k, cos, sin, unsqueeze_dim)
    apply_rotary_pos_emb.__module__ = getattr(target, "__module__", __name__)
    apply_rotary_pos_emb.__doc__ = "npukern's RoPE standing in for transformers' apply_rotary_pos_emb."
    return apply_rotary_pos_emb


def _copy_wrapper(fn, old, new):
    """A copy of the wrapper `fn` (a decorator's closure) whose cell holding
    `old` holds `new`, with ``__wrapped__`` set to `new`; and whether such a
    cell was found."""
    cells, replaced = [], False
    for cell in fn.__closure__ or ():
        try:
            hit = cell.cell_contents is old
        except ValueError:  # an empty cell
            hit = False
        cells.append(types.CellType(new) if hit else cell)
        replaced |= hit
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              tuple(cells) if fn.__closure__ else None)
    copy.__kwdefaults__, copy.__wrapped__ = fn.__kwdefaults__, new
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return copy, replaced


_GLOBALS_MADE = itertools.count()


def _globals_module(globals_):
    """A copy of a module's globals as the ``__dict__`` of a module of its
    own, registered in ``sys.modules`` under a name of its own. torch.compile
    finds a traced function's globals by importing its ``__name__`` (torch
    2.8's dynamo does, for an inlined function whose globals are not the
    frame's): under the original module's name it guarded on the original
    module's ``ALL_ATTENTION_FUNCTIONS`` and raised (``'AttentionInterface'
    object has no attribute '_table'``)."""
    mod = types.ModuleType(f"npukern_torch._patched_globals_{next(_GLOBALS_MADE)}")
    name = mod.__name__
    mod.__dict__.update(globals_)
    mod.__dict__["__name__"] = name
    sys.modules[name] = mod
    return mod.__dict__


def _with_global(fn, name, value):
    """A copy of `fn` whose global `name` reads `value`, for this copy alone
    (the module's own function is untouched). A wrapper (a decorator's
    closure with ``__wrapped__``) is copied with the copy of what it wraps.
    None when `fn` does not read `name` anywhere along that chain."""
    if not isinstance(fn, types.FunctionType):
        return None
    if name in fn.__code__.co_names and name in fn.__globals__:
        g = _globals_module(fn.__globals__)
        g[name] = value
        new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
        return new
    inner = getattr(fn, "__wrapped__", None)
    copied = _with_global(inner, name, value) if inner is not None else None
    if copied is None or not fn.__closure__:
        return None
    new, replaced = _copy_wrapper(fn, inner, copied)
    return new if replaced else None


def _rope_forward_of(cls):
    """`cls.forward` with npukern's RoPE in place of its family module's
    ``apply_rotary_pos_emb``, or None (not a family attention class, or its
    function or signature is not the one this adapter knows)."""
    mod = sys.modules.get(cls.__module__)
    original = getattr(mod, "apply_rotary_pos_emb", None)
    stand_in = _rope_for(original) if original is not None else None
    return _with_global(cls.forward, "apply_rotary_pos_emb", stand_in) if stand_in else None


def _sdpa(original, route, module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
          **kwargs):
    """transformers' ``sdpa_attention_forward`` (`original`) on npukern's
    attention where it takes the call: no mask (transformers passes None
    for a causal batch without padding), no dropout, no softcap, position
    bias or sinks, keys as many as queries when causal, and (``route`` None:
    "auto") :func:`npukern_torch.route.attention_route` taking the dtype.
    The causal flag is transformers' own rule; grouped-query heads are read
    without ``repeat_kv``. Returns what `original` does: ``[B, S, H, D]``,
    no weights."""
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    takes = (attention_mask is None and not dropout and kwargs.get("softcap") is None
             and kwargs.get("position_bias") is None and kwargs.get("s_aux") is None
             and kwargs.get("sinks") is None and not kwargs.get("output_attentions", False)
             and (not causal or key.shape[2] == q_len)
             and _F._attention_takes(query, key, value, None, 0.0, True)
             and (route == "npukern" or _route.attention_route(query.dtype)))
    if not takes:
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
    out = _F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


class _AttentionFunctions:
    """Stands in for transformers' ``ALL_ATTENTION_FUNCTIONS`` in a patched
    attention layer's forward (that layer alone): its ``"sdpa"`` entry runs
    :func:`_sdpa`, every other entry and attribute is the table's own."""

    def __init__(self, table, route):
        self._table, self._route, self._made = table, route, {}

    def _wrap(self, name, fn):
        if name != "sdpa" or fn is None:
            return fn
        made = self._made.get(id(fn))
        if made is None or made[0] is not fn:
            def sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
                return _sdpa(fn, self._route, module, query, key, value, attention_mask, *args, **kwargs)
            made = self._made[id(fn)] = (fn, sdpa_attention_forward)
        return made[1]

    def get_interface(self, name, default=None):
        return self._wrap(name, self._table.get_interface(name, default))

    def __getitem__(self, name):
        return self._wrap(name, self._table[name])

    def get(self, name, default=None):
        return self._wrap(name, self._table.get(name, default))

    def __contains__(self, name):
        return name in self._table

    def __getattr__(self, name):
        return getattr(self._table, name)


# (cls, rope, attention and the ids of what the copy replaces) -> (forward,
# parts, the replaced objects, which keep those ids theirs).
_ATTENTION_FORWARDS = {}


def _attention_layer_forward_of(cls, rope, attention):
    """`cls.forward` with npukern's RoPE (`rope`) and npukern's SDPA
    (`attention`: "auto" by the route's rule, "npukern" always, None not)
    standing in for its module's ``apply_rotary_pos_emb`` and
    ``ALL_ATTENTION_FUNCTIONS``'s ``"sdpa"``; and which of the two it took
    (a function or signature this adapter does not know is left alone).
    Made once for every layer of a class (and again only when the forward
    or what it replaces changed): each copy's globals are a module kept in
    ``sys.modules`` (`_globals_module`), which a copy per layer and per
    patch would pile up."""
    mod = sys.modules.get(cls.__module__)
    replaced = (cls.forward, getattr(mod, "apply_rotary_pos_emb", None), getattr(mod, "ALL_ATTENTION_FUNCTIONS", None))
    key = (cls, bool(rope), attention) + tuple(id(o) for o in replaced)
    made = _ATTENTION_FORWARDS.get(key)
    if made is None:
        made = _ATTENTION_FORWARDS[key] = _attention_layer_forward_made(cls, rope, attention) + (replaced,)
    return made[0], list(made[1])


def _attention_layer_forward_made(cls, rope, attention):
    """`_attention_layer_forward_of`'s forward and parts, made anew."""
    fn, parts = cls.forward, []
    if rope:
        r = _rope_forward_of(cls)
        if r is not None:
            fn, parts = r, ["rope"]
    if attention:
        table = getattr(sys.modules.get(cls.__module__), "ALL_ATTENTION_FUNCTIONS", None)
        a = _with_global(fn, "ALL_ATTENTION_FUNCTIONS", _AttentionFunctions(table, attention)) \
            if table is not None and hasattr(table, "get_interface") else None
        if a is not None:
            fn, parts = a, parts + ["attention"]
    return (fn if parts else None), parts


def _with_inner(fn, inner):
    """A copy of the decorator chain of `fn` (wrappers with ``__wrapped__``)
    around `inner` in place of the function it ends in: the decorators'
    argument handling (transformers' ``deprecate_kwarg``) is kept."""
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is None or not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return inner
    return _copy_wrapper(fn, wrapped, _with_inner(wrapped, inner))[0]


def _innermost(fn):
    while getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return fn


# The decoder layer this adapter fuses (Llama, Mistral, Qwen2, Qwen3, Gemma):
# {call} passes every parameter of the forward but hidden_states by name.
_DECODER_BODY = """
residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
hidden_states, _ = self.self_attn(hidden_states=hidden_states, {call})
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states
"""


def _decoder_params(cls):
    """The parameter names (after hidden_states) and ``**kwargs`` name of
    `cls`'s forward when its body is exactly :data:`_DECODER_BODY`, else
    None: any other layer (Gemma2/3's four norms, a future change) keeps its
    forward."""
    fn = _innermost(getattr(cls, "forward", None))
    found = _source_def(fn)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if found is None:
        return None
    names = list(sig.parameters)
    if names[:2] != ["self", "hidden_states"]:
        return None
    named, var_kw = [], None
    for p in list(sig.parameters.values())[2:]:
        if p.kind == p.VAR_KEYWORD:
            var_kw = p.name
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            named.append(p.name)
        else:
            return None
    call = ", ".join([f"{n}={n}" for n in named] + ([f"**{var_kw}"] if var_kw else []))
    body = found[1]
    expected = ast.parse(_DECODER_BODY.format(call=call)).body
    if [ast.dump(b) for b in body] != [ast.dump(b) for b in expected]:
        return None
    return named, var_kw


def _residual_norm(norm, residual, h):
    """``(norm(residual + h), residual + h)``: npukern's AddRmsNorm (the sum
    rounded once, as torch's add, and the norm of that sum: stock bits) when
    the norm is npukern's and the pair is one the kernel takes; else the
    stock add and norm."""
    if (isinstance(norm, RMSNorm) and residual.shape == h.shape and residual.dtype == h.dtype
            and on_kernels(residual, h)):
        # add_rms_norm with the module's casting, resolved in its __init__.
        y, _rstd, s = _F._add_rms_norm(residual, h, norm._gamma(residual), norm._eps(residual), norm.offset,
                                       norm.cast_before_gamma)
        return y, s
    s = residual + h
    return norm(s), s


def _binder(owner, sig):
    """``sig.bind(self, *args, **kwargs)`` with defaults applied, as plain
    dicts read at patch time: ``(arguments, extra keywords)``, the same
    TypeErrors. Under torch.compile ``Signature.bind`` reads a mappingproxy,
    which dynamo refuses once the trace has mutated a dict (the loss route's
    head swap does): a graph break in every layer."""
    params = list(sig.parameters.values())
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD][1:]  # after self
    keyword = {p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    required = [p.name for p in params[1:] if p.default is p.empty and p.kind != p.VAR_KEYWORD]
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)

    def bind(args, kwargs):
        if len(args) > len(positional):
            raise TypeError(f"{owner}.forward() takes {len(positional) + 1} positional arguments but "
                            f"{len(args) + 1} were given")
        a = dict(defaults)
        a.update(zip(positional, args))
        extra = {}
        for k, v in kwargs.items():
            if k in keyword:
                if k in positional[:len(args)]:
                    raise TypeError(f"{owner}.forward() got multiple values for argument '{k}'")
                a[k] = v
            elif var_kw:
                extra[k] = v
            else:
                raise TypeError(f"{owner}.forward() got an unexpected keyword argument '{k}'")
        for n in required:
            if n not in a:
                raise TypeError(f"{owner}.forward() missing a required argument: '{n}'")
        return a, extra

    return bind


def _decoder_forward_of(cls):
    """`cls.forward` (its decorators kept) with the residual add before the
    post-attention norm fused into npukern's AddRmsNorm, or None when the
    layer is not the one :data:`_DECODER_BODY` describes."""
    found = _decoder_params(cls)
    if found is None:
        return None
    named, _ = found  # the **kwargs the layer takes: collected by `bind`
    bind = _binder(cls.__name__, inspect.signature(_innermost(cls.forward)))

    def forward(self, *args, **kwargs):
        a, extra = bind(args, kwargs)
        rest = {n: a[n] for n in named}
        rest.update(extra)
        residual = a["hidden_states"]
        h, _ = self.self_attn(hidden_states=self.input_layernorm(residual), **rest)
        y, residual = _residual_norm(self.post_attention_layernorm, residual, h)
        return residual + self.mlp(y)

    forward.__name__, forward.__qualname__ = "forward", f"{cls.__qualname__}.forward"
    forward.__doc__ = "npukern's decoder layer forward: the residual add fused into the post-attention norm."
    return _with_inner(cls.forward, forward)


class _Forward:
    """One patched module's own forward, kept in that module's ``__dict__``
    so the swap belongs to that module alone (never to its class or its
    transformers module). Picklable and deep-copyable: it holds only the
    module and its kind, and rebuilds its function on load."""

    def __init__(self, module, kind, matmul="torch", rope=True, attention=None):
        # matmul: whose matmul the linear and loss kinds run ("auto": the route's rule).
        # rope, attention: what an attention layer's forward ("attention_layer") swaps.
        self.module, self.kind, self.matmul = module, kind, matmul
        self.rope, self.attention = rope, attention
        self._build()

    def _build(self):
        self.parts = [self.kind]
        if self.kind == "attention_layer":
            self.fn, self.parts = _attention_layer_forward_of(type(self.module), self.rope, self.attention)
        elif self.kind == "add_rms_norm":
            self.fn = _decoder_forward_of(type(self.module))
        else:
            self.fn = None

    @property
    def __signature__(self):
        # The stock forward's: callers read it (Trainer keeps only the dataset
        # columns the forward names, and passes num_items_in_batch when it
        # takes **kwargs), and a bare (*args, **kwargs) dropped input_ids.
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __call__(self, *args, **kwargs):
        if self.kind == "mlp":
            return _gated_mlp_forward(self.module, *args, **kwargs)
        if self.kind == "loss":
            return _causal_lm_forward(self.module, *args, matmul=self.matmul, **kwargs)
        if self.kind == "linear":
            m = self.module
            # "auto" and "npukern" both sum as the route's math says (the
            # bf16 pair dot where VDPBF16PS is fast, NPK_TORCH_MATMUL_MATH).
            return _F.linear(*args, m.weight, m.bias, route=self.matmul == "auto", math="auto", **kwargs)
        return self.fn(self.module, *args, **kwargs)

    def __getstate__(self):
        return {"module": self.module, "kind": self.kind, "matmul": self.matmul, "rope": self.rope,
                "attention": self.attention}

    def __setstate__(self, state):
        self.module, self.kind, self.matmul = state["module"], state["kind"], state.get("matmul", "torch")
        self.rope, self.attention = state.get("rope", True), state.get("attention")
        if self.kind == "rope":  # pickled before the attention option
            self.kind = "attention_layer"
        self._build()


class _Capture(torch.nn.Module):
    """Stands in for the LM head during one forward with labels: keeps the
    hidden states and returns no logits (``[..., 0]``: the softcapping that
    follows in the stock forward costs nothing)."""

    def __init__(self):
        super().__init__()
        self.hidden = None

    def forward(self, hidden):
        self.hidden = hidden
        return hidden.new_empty(*hidden.shape[:-1], 0)


def _evaluating(model):
    """An evaluation forward (``model.eval()`` under ``torch.no_grad()``, as
    Trainer's evaluation loop runs it): its caller wants the logits (metrics,
    predictions), and nothing will be backpropagated."""
    return not model.training and not torch.is_grad_enabled()


def _plain_linear(m):
    """Whether the fused loss may read the LM head through its weight and
    bias: torch's own Linear forward, a floating weight, no hooks. A head
    wrapped later (PEFT's LoRA, a quantized Linear subclass, a forward hook)
    keeps the stock forward, whose head call includes what the wrapper adds."""
    return (isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward
            and m.weight.dtype.is_floating_point and not (m._forward_hooks or m._forward_pre_hooks))


def _causal_lm_forward(model, *args, labels=None, matmul="torch", **kwargs):
    """A causal LM's forward whose loss, when labels are given, is the fused
    linear cross-entropy (Hugging Face's ``ForCausalLMLoss``: labels shifted
    left, the last position ignored, or ``shift_labels`` as given; float32
    loss; ``num_items_in_batch`` makes it a sum over that count;
    ``ignore_index`` as passed; Gemma2/3's ``final_logit_softcapping``
    applied inside the kernel): the ``[tokens, vocab]`` logits never exist,
    and the output's ``logits`` is None (``out[0]`` the loss; the tuple form
    under ``return_dict=False``). Without labels, in an evaluation forward
    (``_evaluating``), or with a head the model does not hold directly or
    that is not a plain Linear (``_plain_linear``), the stock forward:
    logits and stock loss."""
    cls_forward = type(model).forward
    head = model.get_output_embeddings()
    # The head is swapped for the capture where the model holds it: a direct
    # child. (A loop: torch 2.8's dynamo cannot trace next() on a generator.)
    name = None
    for n, m in model.named_children():
        if m is head:
            name = n
            break
    if labels is None or _evaluating(model) or name is None or not _plain_linear(head):
        return cls_forward(model, *args, labels=labels, **kwargs)
    # transformers' rule for the result's form (`can_return_tuple`): the
    # call's return_dict, else the config's. The body runs with a dict.
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    capture = _Capture()
    setattr(model, name, capture)
    try:
        out = cls_forward(model, *args, return_dict=True, **kwargs)
    finally:
        setattr(model, name, head)
    hidden = capture.hidden
    ignore = kwargs.get("ignore_index", -100)
    shifted = kwargs.get("shift_labels")
    if shifted is None:
        shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]
    shifted = shifted.to(hidden.device)
    num_items = kwargs.get("num_items_in_batch")
    cap = getattr(model.config, "final_logit_softcapping", None)
    try:
        loss = _loss.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, shifted.reshape(-1),
                                          getattr(head, "bias", None), ignore,
                                          "sum" if num_items is not None else "mean", softcap=cap or None,
                                          matmul=matmul)
    except IndexError as e:
        raise _label_error(e, labels, shifted, kwargs.get("shift_labels") is None, head.weight.shape[0],
                           ignore) from e
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    # Rebuilt, not assigned: a ModelOutput's order is its fields' (loss
    # first, so out[0] and the tuple form lead with the loss, as stock's).
    out = type(out)(loss=loss, **{k: v for k, v in out.items() if k not in ("loss", "logits")})
    return out if return_dict else out.to_tuple()


def _label_error(e, labels, shifted, shifted_here, vocab, ignore):
    """The kernel's out-of-range target (a flat position in the shifted
    labels) as the user's own label: its index in ``labels`` (one place to
    the right of the shifted one) and the valid range."""
    import re

    found = re.search(r"flat position (\d+)", str(e))
    if found is None:
        return e
    flat = int(found.group(1))
    at = list(divmod(flat, shifted.shape[-1])) if shifted.dim() > 1 else [flat]
    if shifted_here:
        at[-1] += 1  # shifted[..., j] is labels[..., j + 1]
    src = labels if shifted_here else shifted
    value = int(src[tuple(at)]) if src.dim() == len(at) else int(shifted.reshape(-1)[flat])
    name = "labels" if shifted_here else "shift_labels"
    return IndexError(f"{name}[{', '.join(map(str, at))}] = {value} is out of range (want 0 <= label < {vocab}, "
                      f"or {ignore} to ignore it)")


def _is_causal_lm(m):
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    return (isinstance(head, torch.nn.Linear) and type(m).__name__.endswith("ForCausalLM")
            and type(m).__module__ in _FAMILY_MODULES and any(c is head for c in m.children()))


def _patched_parts(m):
    """What the patched forward of `m` swapped (count names), or ()."""
    fwd = vars(m).get("forward")
    return fwd.parts if isinstance(fwd, _Forward) else ()


# What patch / unpatch count.
_NO_COUNTS = {"rms_norm": 0, "add_rms_norm": 0, "embedding": 0, "mlp": 0, "rope": 0, "attention": 0, "loss": 0,
              "linear": 0}


def _is_family_attention(m):
    return type(m).__module__ in _FAMILY_MODULES and type(m).__name__.endswith("Attention")


_FAMILY_MODULES = {mod for mod, *_ in FAMILIES.values()}


def _is_family_decoder(m):
    return type(m).__module__ in _FAMILY_MODULES and type(m).__name__.endswith("DecoderLayer")


def patch(model: torch.nn.Module, *, rms_norm: bool = True, embedding: bool = True, mlp: bool = True,
          rope: bool = True, loss: bool = True, add_rms_norm: bool = True, linear=True, attention=True) -> dict:
    """Swaps, in place and in this model alone, its RMSNorm modules of the
    supported families and its input embedding for npukern's, its gated
    MLPs' activation for npukern's SwiGLU (SiLU) or GeGLU (GELU, Gemma's)
    (``mlp``: an MLP whose forward is exactly ``down_proj(act_fn(gate_proj(x))
    * up_proj(x))``; one that also drops out, clamps or scales is left alone
    and named in a warning) and its attention
    layers' rotary embedding for npukern's RoPE (``rope``: the layer's own
    forward reads npukern's ``apply_rotary_pos_emb``; the transformers
    module and every other model are untouched); returns the counts of what
    this call swapped, e.g. ``{"rms_norm": 5, "add_rms_norm": 2, "embedding": 1,
    "mlp": 2, "rope": 2, "attention": 2, "loss": 1, "linear": 14}``; ``add_rms_norm``: decoder
    layers of the Llama shape (Llama, Mistral, Qwen2, Qwen3, Gemma) add the
    attention output to the residual and normalize the sum in one AddRmsNorm
    (stock forward bits; needs ``rms_norm``); ``loss``: a causal LM given ``labels`` computes
    its loss with the fused linear cross-entropy and returns ``logits=None``
    (without labels, or evaluating: ``model.eval()`` under ``torch.no_grad()``,
    the logits and loss as before; TRL's trainers replace this forward by
    their own fused LM head, which then runs on npukern's kernels for this
    model, and a model a TRL trainer holds already, ``trainer.model``, keeps
    TRL's forward and gets that head on npukern, counted under ``loss``:
    docs/huggingface.md, "Training with TRL"); ``linear``: the decoder layers' projections
    (attention and MLP ``nn.Linear``) and the fused loss's LM head run their
    forward and both backward products on npukern's matmul where
    :func:`npukern_torch.route.matmul_route` says it is faster than torch's on
    this CPU for the dtype they run in (True, the default: by that rule;
    ``"npukern"``: always; False: torch's matmuls and the stock bits
    everywhere), summed as :func:`npukern_torch.route.matmul_math` says (the
    bf16 pair dot on AMD Zen 4 and later, the FMA chain otherwise);
    ``attention``: the attention layers' SDPA (transformers' ``"sdpa"``
    implementation, the default) runs on npukern's attention where it takes
    the call (no mask: a causal batch without padding; no dropout) and
    :func:`npukern_torch.route.attention_route` says so (True, by that rule:
    x86 without AMX; ``"npukern"``: always; False: torch's SDPA). Modules already patched are left alone (a second call
    counts 0). An RMSNorm class it does not know is left alone and named in a
    warning. Embeddings with ``max_norm`` or ``sparse=True`` (which npukern
    does not take) are left alone. Every swapped path gives the stock
    result dtype (torch's type promotion, autocast included) and falls back
    to the stock composite for what the kernels do not take (float64,
    non-CPU tensors)."""
    norms, scaled_embeddings = _family_classes()
    if linear not in (True, False, "npukern"):
        raise ValueError(f"hf.patch: linear must be True, False or 'npukern', not {linear!r}")
    if attention not in (True, False, "npukern"):
        raise ValueError(f"hf.patch: attention must be True, False or 'npukern', not {attention!r}")
    matmul = {True: "auto", False: "torch", "npukern": "npukern"}[linear]
    attention = {True: "auto", False: None, "npukern": "npukern"}[attention]
    counts = dict(_NO_COUNTS)
    other_mlps = set()
    projections = {id(p) for d in model.modules() if _is_family_decoder(d) for p in d.modules()
                   if _plain_linear(p)} if linear else set()
    for m in model.modules():
        if "forward" in vars(m):
            # Patched already, or someone else's forward: not ours to replace. A TRL
            # trainer's fused head (the trainer built first) runs on npukern from here.
            if loss and _is_causal_lm(m) and _trl.is_fused_forward(vars(m)["forward"]):
                head = m.get_output_embeddings()
                if _plain_linear(head) and not _trl.is_registered(head.weight):
                    _trl.register(head.weight, matmul)
                    counts["loss"] += 1
            continue
        if id(m) in projections:
            m.forward = _Forward(m, "linear", matmul)
            counts["linear"] += 1
        elif loss and _is_causal_lm(m):
            m.forward = _Forward(m, "loss", matmul)
            counts["loss"] += 1
            head = m.get_output_embeddings()
            if _plain_linear(head):
                # TRL's trainers replace this forward by their fused head: theirs on npukern too.
                _trl.register(head.weight, matmul)
        elif mlp and _is_gated_mlp(m):
            m.forward = _Forward(m, "mlp")
            counts["mlp"] += 1
        elif mlp and _has_gated_mlp_parts(m):
            other_mlps.add(f"{type(m).__module__}.{type(m).__qualname__}")
        elif (rope or attention) and _is_family_attention(m):
            fwd = _Forward(m, "attention_layer", rope=rope, attention=attention)
            if fwd.fn is not None:  # None: not a forward or signature this adapter knows
                m.forward = fwd
                for part in fwd.parts:
                    counts[part] += 1
        elif add_rms_norm and rms_norm and _is_family_decoder(m):
            fwd = _Forward(m, "add_rms_norm")
            if fwd.fn is not None:  # None: not the decoder layer this adapter knows
                m.forward = fwd
                counts["add_rms_norm"] += 1
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
    if counts["loss"]:
        _trl.install()
    if unknown:
        warnings.warn(
            "npukern_torch.hf.patch left these RMSNorm classes alone (their numerics are not known to it): "
            + ", ".join(sorted(unknown)),
            stacklevel=2,
        )
    if other_mlps:
        warnings.warn(
            "npukern_torch.hf.patch left these MLP classes alone (their forward is not "
            "down_proj(act_fn(gate_proj(x)) * up_proj(x))): " + ", ".join(sorted(other_mlps)),
            stacklevel=2,
        )
    return counts


def unpatch(model: torch.nn.Module) -> dict:
    """Puts back, in this model alone, the original modules :func:`patch`
    replaced (they share the same Parameters, so training since the patch is
    kept) and the MLPs' and attention layers' own forward, and hands a TRL
    fused head back to TRL's function; returns the counts."""
    counts = dict(_NO_COUNTS)
    for m in model.modules():
        parts = _patched_parts(m)
        if not parts and _is_causal_lm(m) and _trl.is_fused_forward(vars(m).get("forward")):
            head = m.get_output_embeddings()
            if _trl.is_registered(head.weight):  # TRL's forward stays; its head goes back to TRL
                _trl.unregister(head.weight)
                counts["loss"] += 1
        if parts:
            head = m.get_output_embeddings() if "loss" in parts else None
            if head is not None:
                _trl.unregister(head.weight)
            del m.forward
            for part in parts:
                counts[part] += 1
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


def _stand_in(family):
    """The class :func:`apply_to_transformers` puts in place of `family`'s
    RMSNorm: npukern's module built with the transformers class's own
    constructor signature (``LlamaRMSNorm(hidden_size, eps=...)``,
    ``Gemma3RMSNorm(dim=..., eps=...)``). It lives in this module as
    ``_StandIn_<family>``, so a model built with it pickles and loads in any
    process that can import transformers."""
    name = f"_StandIn_{family}"
    if name in globals():
        return globals()[name]
    module, norm, casting, _scaled = FAMILIES[family]
    original = _ORIGINAL_CLASSES.get((module, norm)) or getattr(importlib.import_module(module), norm)
    sig = inspect.signature(original.__init__)
    size_name = list(sig.parameters)[1]  # after self: hidden_size or dim
    eps_default = sig.parameters["eps"].default if "eps" in sig.parameters else 1e-6

    def __init__(self, *args, **kwargs):
        arguments = sig.bind(self, *args, **kwargs).arguments
        extra = sorted(set(arguments) - {"self", size_name, "eps"})
        if extra:
            raise TypeError(f"npukern's {original.__name__} does not take {', '.join(extra)}")
        HFRMSNorm.__init__(self, arguments[size_name], arguments.get("eps", eps_default), casting=casting)

    __init__.__signature__ = sig
    cls = type(original.__name__, (HFRMSNorm,), {
        "__init__": __init__,
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"npukern's RMSNorm standing in for transformers' {original.__name__} ({family}).",
    })
    globals()[name] = cls
    return cls


def __getattr__(name):
    # Unpickling a model built after apply_to_transformers, in a fresh process.
    family = name[len("_StandIn_"):] if name.startswith("_StandIn_") else None
    if family in FAMILIES:
        return _stand_in(family)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def apply_to_transformers(families=None) -> list:
    """The class-level form: replaces the RMSNorm classes of `families`
    (default: all of :data:`FAMILIES`) in their transformers modules, so that
    models built afterwards hold npukern's RMSNorm with the family's numerics
    (call :func:`patch` on such a model for the input embedding, which is
    torch's own ``nn.Embedding`` class). Returns the families applied;
    :func:`revert_transformers` undoes it."""
    applied = []
    for family in families or FAMILIES:
        module, norm, _casting, _scaled = FAMILIES[family]
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if (module, norm) not in _ORIGINAL_CLASSES:
            _ORIGINAL_CLASSES[(module, norm)] = getattr(mod, norm)
            setattr(mod, norm, _stand_in(family))
        applied.append(family)
    return applied


def revert_transformers() -> None:
    """Restores the transformers classes :func:`apply_to_transformers` replaced."""
    for (module, norm), cls in list(_ORIGINAL_CLASSES.items()):
        setattr(importlib.import_module(module), norm, cls)
        del _ORIGINAL_CLASSES[(module, norm)]
