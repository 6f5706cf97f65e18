"""Every rank raises together: rank-local failures agree before a collective.

A rank that raises before an all-reduce leaves the others blocked in it until
the process group's timeout (30 minutes by default with gloo); a rank that
catches the error and goes on pairs its next all-reduce with the others'
current one and mixes steps silently. So each step's local work (validation,
the local kernels) runs first, its outcome is encoded in a few float64 slots,
and those slots are all-reduced -- riding on the step's own all-reduce where
there is one (``clip_grad_norm_``), or in one small all-reduce of their own
(the embedding's forward, whose payload is the activation itself). After it,
every rank knows whether any rank failed, and all raise the same exception
type together."""

import torch

# The exception types a rank-local failure is reported as, in order of
# precedence when ranks fail differently.
KINDS = (IndexError, TypeError, ValueError, RuntimeError)
SLOTS = len(KINDS)


def encode(error):
    """The flag slots of this rank's outcome: all zero, or a 1 in its kind's slot."""
    flags = [0.0] * SLOTS
    if error is not None:
        kind = next((i for i, k in enumerate(KINDS) if isinstance(error, k)), SLOTS - 1)
        flags[kind] = 1.0
    return flags


def raise_if_any(flags, error, where):
    """Raises on every rank when any rank failed (`flags` are the all-reduced
    slots). The failing rank re-raises its own error; the others raise the
    same type, saying that another rank failed."""
    counts = [int(v) for v in torch.as_tensor(flags).tolist()]
    if not any(counts):
        return
    kind = KINDS[next(i for i, c in enumerate(counts) if c)]
    if isinstance(error, kind):
        raise error
    failed = sum(counts)
    mine = f"; this rank's own error: {error}" if error is not None else ""
    raise kind(
        f"{where}: {failed} rank(s) of the process group failed before the collective with {kind.__name__}, "
        f"so every rank raises it together and no rank is left waiting{mine}"
    ) from error
