"""Which matmuls npukern's kernel takes over from torch's on this CPU.

The rule is by ISA, from measurements (docs/performance.md "Matmul"), not
timed at import: a route that depended on a timing would change the bits of
a model between two runs. npukern's default matmul (the FMA chain,
``npk_matmul``) is float32 FMA on operands widened while packing, so it runs
every dtype at the core's float32 FMA rate; its bf16 pair dot
(``npk_matmul_v2`` with ``NPK_MATMUL_BF16_DOT``: VDPBF16PS's sums, pairs of
k steps with the odd one first, subnormals flushed) runs ``VDPBF16PS``
itself where the CPU has it; torch's (oneDNN) runs bfloat16 at the rate of
the bf16 instructions the CPU has:

- AMX (Sapphire Rapids and later): oneDNN's tiles are many times the FMA
  rate: torch keeps every matmul.
- AVX512-BF16 on AMD (Zen 4, Zen 5; family 25 and later): ``VDPBF16PS``
  runs at twice the FMA rate (231 against 115 GFLOP/s on one Zen 4 core,
  486 against 263 on Zen 5) and oneDNN's bf16 ``mm`` uses it (187-204
  GFLOP/s on Zen 4); npukern's FMA chain reaches 82-96 (Zen 5: 233-248).
  npukern's pair dot (:func:`matmul_math`) runs ``VDPBF16PS`` itself:
  through torch on one Zen 5 core (torch 2.15, the LLaMA step's products,
  ``benches/matmul_torch.py``) it reaches 437-523 GFLOP/s against oneDNN's
  458-538 in the same runs (0.96-1.08x its time since 432076a, ``dy^T x``
  the slowest), and the whole bf16 Trainer step (``benches/hf_step.py
  --recipe trainer``, hidden 1024, 2 layers, seq 512, vocab 32 000) takes
  496-511 ms with it against 525-528 with torch's bf16 matmuls (0.619 of
  stock's against 0.643): the LM head inside the fused loss and the linear
  layers' float32 weight-gradient sums gain more than the products lose.
  So on Zen 5 (family 26 and later) npukern takes bfloat16, summed by the
  pair dot (its bits, the same on every ISA and thread count, not
  oneDNN's). On Zen 4 (2026-12-08, one core) the pair dot runs at 182-201
  GFLOP/s (``matmul_peak``), 1.02-1.22x the time of oneDNN's bf16 ``mm``
  (196-210) through torch, and the Trainer step took 1023-1036 ms with it
  against 1001-1026 with torch's bf16 matmuls: torch keeps bfloat16 there,
  and ``NPK_TORCH_MATMUL=npukern`` runs it on the pair dot.
- AVX512-BF16 on Intel without AMX (Cooper Lake, a Sapphire Rapids VM that
  hides AMX): ``VDPBF16PS`` peaks at half the FMA rate there (86 against
  172-178 GFLOP/s) and torch's bf16 ``mm`` ran at 82-84: npukern takes
  bfloat16.
- No BF16 instructions (AVX-512 Skylake/Cascade/Ice Lake, AVX2 Zen 2/3):
  oneDNN converts in its own loops (the bf16 matmuls were 95.8% of a
  Cascade Lake step): npukern takes bfloat16 and float16.
- float32 on AMD with full-width AVX-512 (Zen 5, family 26 and later):
  torch's float32 ``mm`` (MKL's sgemm, which runs its AVX2 path on AMD)
  reached 102-108 GFLOP/s on one Zen 5 core, npukern's 218-235 (FMA peak
  263; two threads 400-481 against 189-217): npukern takes float32.
  (A Zen 5 that runs AVX-512 on 256-bit datapaths, as the mobile parts
  do, would be at parity, as Zen 4 is: not slower.) npukern's one FMA
  chain per output has 2.3-3.7x the rms rounding error of MKL's blocked
  sums at K = 1024-2816 (docs/accuracy.md).
- float32 elsewhere: torch's ``mm`` ran at npukern's rate (83-92 against
  82-96 GFLOP/s on Zen 4, whose AVX-512 runs at the AVX2 rate; 149-216
  against 134-197 on Sapphire Rapids): torch keeps float32 and its stock
  bits.

``NPK_TORCH_MATMUL=npukern`` (every dtype the kernel takes) or ``=torch``
(none) in the environment overrides the rule. How npukern sums what it takes
is :func:`matmul_math`: the pair dot for bfloat16 on AMD Zen 4 and later
(on Zen 4 the rule itself leaves bfloat16 to torch: it applies under
``NPK_TORCH_MATMUL=npukern``), the FMA chain otherwise (Intel's ``VDPBF16PS`` runs at half the FMA rate,
and without AVX512-BF16 the pair dot is a slower flushed FMA chain);
``NPK_TORCH_MATMUL_MATH=chain`` (the FMA chain's bits everywhere) or
``=bf16_dot`` (the pair dot for every bfloat16 matmul) overrides it.
"""

import functools
import os

import torch

#: The dtypes npukern's matmul computes.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: ``npk_matmul_math`` values (the ops' ``math`` argument): one float32 FMA
#: chain per output (every dtype), VDPBF16PS's pair dot, or Arm's BFDOT
#: pair dot (both bfloat16 only; Arm's runs an exact scalar model off
#: AArch64's BF16 level, many times slower: opt-in, never ``"auto"``).
CHAIN, BF16_DOT, BF16_DOT_ARM = 0, 1, 2
_MATH_NAMES = {"chain": CHAIN, "bf16_dot": BF16_DOT, "bf16_dot_arm": BF16_DOT_ARM}


@functools.lru_cache(maxsize=1)
def _cpu():
    """(vendor, flags, family) of this CPU from /proc/cpuinfo; ("", set(), 0) elsewhere."""
    vendor, flags, family = "", set(), 0
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                elif key == "cpu family" and not family:
                    family = int(value) if value.strip().isdigit() else 0
                if vendor and flags and family:
                    break
    except OSError:
        pass
    return vendor, flags, family


def _rule(dtype):
    """(npukern takes it, why) by the rule above."""
    vendor, flags, family = _cpu()
    if dtype not in DTYPES:
        return False, f"{dtype} is not a dtype npukern's matmul computes"
    if "amx_tile" in flags:
        return False, "AMX: oneDNN's tiles run many times the FMA rate"
    if dtype == torch.float32 and vendor == "AuthenticAMD" and family >= 26 and "avx512f" in flags:
        return True, "float32 on AMD Zen 5 and later: torch's sgemm runs its AVX2 path, half npukern's AVX-512 FMA rate"
    if dtype == torch.float32:
        return False, "float32: torch's mm runs at npukern's rate, with the stock bits"
    x86 = vendor in ("GenuineIntel", "AuthenticAMD")
    if not x86:
        return False, "not x86: torch's matmul is not known slower here (NEON's BFMMLA is not used by npukern)"
    if dtype == torch.float16 and "avx512_fp16" in flags:
        return False, "AVX512-FP16: the CPU multiplies float16 natively"
    if dtype == torch.bfloat16 and _pair_dot_cpu(vendor, flags, family) and family >= 26:
        return True, ("AVX512-BF16 on AMD Zen 5 and later: npukern's bf16 pair dot runs VDPBF16PS, about oneDNN's "
                      "rate, and the Trainer step 0.94-0.97x its time with torch's bf16 matmuls")
    if dtype == torch.bfloat16 and "avx512_bf16" in flags and vendor == "AuthenticAMD":
        return False, ("AVX512-BF16 on AMD Zen 4: oneDNN's VDPBF16PS path (npukern's pair dot, the same "
                       "instruction, took 1.02-1.22x its time there, and the step no less)")
    if dtype == torch.bfloat16 and "avx512_bf16" in flags:
        return True, "AVX512-BF16 on Intel without AMX: VDPBF16PS runs at half the FMA rate"
    if "avx2" not in flags or "fma" not in flags:
        return False, "no AVX2 + FMA: npukern's portable kernel is not faster"
    return True, f"no {dtype} instructions: torch converts in its own loops, npukern at the FMA rate"


def _pair_dot_cpu(vendor, flags, family):
    """Whether npukern's bf16 pair dot runs VDPBF16PS at twice the FMA rate
    here: AMD Zen 4 (family 25) and later with AVX512-BF16 (no AMX: the
    rule gives those to oneDNN first)."""
    return vendor == "AuthenticAMD" and family >= 25 and "avx512_bf16" in flags and "amx_tile" not in flags


def matmul_route(dtype):
    """Whether :func:`npukern_torch.linear` and the patched models' projections
    run a ``dtype`` matmul on npukern's kernel (True) or torch's (False) on
    this CPU; see the module's docs for the rule and ``NPK_TORCH_MATMUL``."""
    forced = os.environ.get("NPK_TORCH_MATMUL", "").strip().lower()
    if forced in ("npukern", "torch"):
        return forced == "npukern" and dtype in DTYPES
    return _RULE.get(dtype, False)


def matmul_math(dtype):
    """How npukern's matmul sums a ``dtype`` matmul it runs for the route
    (:func:`npukern_torch.linear` with ``math="auto"``, the patched models'
    projections and the fused loss's head): :data:`BF16_DOT` for bfloat16
    where the CPU runs VDPBF16PS at twice the FMA rate (AMD Zen 4 and
    later), :data:`CHAIN` otherwise; ``NPK_TORCH_MATMUL_MATH=chain|bf16_dot|
    bf16_dot_arm`` overrides it (for bfloat16: every other dtype is always
    the chain)."""
    if dtype != torch.bfloat16:
        return CHAIN
    forced = os.environ.get("NPK_TORCH_MATMUL_MATH", "").strip().lower()
    if forced in _MATH_NAMES:
        return _MATH_NAMES[forced]
    return _MATH


def resolve_math(math, dtype):
    """The ops' ``math`` integer for a ``math`` argument of the functional
    API: ``"chain"``, ``"bf16_dot"``, ``"bf16_dot_arm"`` or ``"auto"``
    (:func:`matmul_math`)."""
    if math == "auto":
        return matmul_math(dtype)
    if math not in _MATH_NAMES:
        raise ValueError(f"math must be 'chain', 'bf16_dot', 'bf16_dot_arm' or 'auto', not {math!r}")
    return _MATH_NAMES[math]


# Read once (torch.compile traces a dict lookup, not /proc/cpuinfo).
_RULE = {dt: _rule(dt)[0] for dt in DTYPES}
_MATH = BF16_DOT if _pair_dot_cpu(*_cpu()) else CHAIN


def explain():
    """What :func:`matmul_route` says for each dtype, and why: ``{dtype: (takes, why)}``
    (the why also names :func:`matmul_math`'s choice where the environment
    overrides it)."""
    told = {}
    for dt in DTYPES:
        why = _rule(dt)[1]
        math = matmul_math(dt)
        if math != (_MATH if dt == torch.bfloat16 else CHAIN):  # NPK_TORCH_MATMUL_MATH
            name = {CHAIN: "FMA chain", BF16_DOT: "bf16 pair dot", BF16_DOT_ARM: "Arm bf16 pair dot"}[math]
            why += "; summed by the " + name + " (NPK_TORCH_MATMUL_MATH)"
        told[dt] = (matmul_route(dt), why)
    return told


def _attention_rule(dtype):
    """(npukern takes it, why) for the attention (see :func:`attention_route`)."""
    vendor, flags, _ = _cpu()
    if dtype not in DTYPES:
        return False, f"{dtype} is not a dtype npukern's attention computes"
    if "amx_tile" in flags:
        return False, "AMX: torch's CPU flash attention runs its products on oneDNN's tiles"
    if vendor not in ("GenuineIntel", "AuthenticAMD") or "avx2" not in flags or "fma" not in flags:
        return False, "no AVX2 + FMA (or not x86): npukern's attention is not known faster here"
    return True, ("x86 without AMX: npukern's attention (FMA chains) took 16.5 ms a layer forward + backward "
                  "where torch's CPU flash attention took 36.4 and Hugging Face's eager form 18.8 (Zen 5, "
                  "16 heads of 64, 4 KV heads, 512 tokens, causal, bf16)")


def attention_route(dtype):
    """Whether :func:`npukern_torch.hf.patch`'s attention layers run a
    ``dtype`` SDPA (no mask, no dropout) on npukern's attention (True) or
    torch's (False) on this CPU: npukern's on x86 with AVX2 + FMA and no
    AMX (measured: docs/performance.md "Attention"), torch's elsewhere.
    ``NPK_TORCH_ATTENTION=npukern`` or ``=torch`` overrides it."""
    forced = os.environ.get("NPK_TORCH_ATTENTION", "").strip().lower()
    if forced in ("npukern", "torch"):
        return forced == "npukern" and dtype in DTYPES
    return _attention_rule(dtype)[0]
