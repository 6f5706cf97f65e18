"""Eager callers of the npukern:: op overloads the functional forms and the
modules call: the op through the dispatcher as ``torch.ops`` calls it, but
without the ``torch.ops`` door's argument parsing (csrc/fast_call.cpp; 2.4-4
us of a decode-sized call, docs/performance.md "Per-call cost"). Anything the
C caller does not take (keyword arguments, tensor subclasses, a
``__torch_function__`` mode) goes to the overload itself, and under
``torch.compile`` the overload is called directly: Dynamo traces it, and
cannot trace a C function. ``NPK_TORCH_FAST_CALL=0`` in the environment keeps
every call on ``torch.ops`` (for comparing the two)."""

import os

import torch

from . import _C

_ENABLED = os.environ.get("NPK_TORCH_FAST_CALL", "1") != "0"

# The norm modules' eager forwards (csrc/fast_call.cpp): the op called unboxed
# with exactly the arguments the module's general path would pass, its y
# (and x_sum) returned without the rest of the result; NotImplemented for any
# argument that path would treat otherwise. None with the fast caller off.
rms_norm_module = _C.rms_norm_module if _ENABLED else None
add_rms_norm_module = _C.add_rms_norm_module if _ENABLED else None
# Dynamo folds this to True while it traces (it cannot trace the C caller);
# eagerly it is one Python call returning False, where
# torch.compiler.is_compiling makes two (0.1 us a call). torch.export's
# non-strict mode runs the Python for real under a torch function mode, which
# the C caller hands to the overload itself.
is_compiling = torch.compiler.is_dynamo_compiling


def eager(overload):
    """A callable equal to `overload` (an ``OpOverload`` of an npukern:: op)
    that skips the ``torch.ops`` door when called eagerly (positional
    arguments only; ``.fast`` is the C caller); `overload` itself when its schema has an argument the fast
    caller does not take."""
    schema = overload._schema
    fast = _C.fast_op(overload, schema.name.split("::", 1)[1], schema.overload_name, torch.nn.Parameter) \
        if _ENABLED else None
    if fast is None:
        return overload
    # Positional arguments only (the package's own callers): a ``**kwargs``
    # dict per call measured 0.15 us. The C caller itself hands keywords on.
    def call(*args):
        if is_compiling():
            return overload(*args)
        return fast(*args)

    call.__name__ = call.__qualname__ = overload.__name__
    call.fast = fast
    call.__doc__ = f"``torch.ops.{schema.name.replace('::', '.')}``, called eagerly without the torch.ops door."
    return call
