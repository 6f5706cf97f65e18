"""npukern's C ABI from Python (ctypes over libnpukern.so), for the IPEX
race's "C ABI" columns: the call a C or C++ caller makes, with the library's
own thread pool (npk_threads_parallel_for) and, per `set_pages`, no hint
about the output's pages (NPK_BACKEND_CPU alone: what the kernel does
knowing nothing) or the store hint a caller that allocated them knows
(NPK_OUTPUTS_FRESH / NPK_OUTPUTS_RESIDENT). Structures as
include/npukern.h lays them out."""

import ctypes as C
import os

MAX_DIMS = 8
# npk_exec.backend's store hint bits (include/npukern.h).
PAGES = {None: 0, "fresh": 0x100, "resident": 0x200}
DTYPES = {"torch.float32": 0, "torch.float16": 1, "torch.bfloat16": 2}


class Tensor(C.Structure):
    _fields_ = [("data", C.c_void_p), ("dtype", C.c_int), ("ndim", C.c_uint32), ("shape", C.c_int64 * MAX_DIMS)]


class NormOptions(C.Structure):
    _fields_ = [("eps", C.c_double), ("gamma_offset", C.c_float), ("rounding", C.c_int)]


class Exec(C.Structure):
    _fields_ = [("ub_bytes", C.c_uint64), ("blocks", C.c_uint32), ("isa", C.c_int), ("backend", C.c_int),
                ("parallel_for", C.c_void_p), ("runner_ctx", C.c_void_p), ("foreign", C.c_void_p),
                ("detail", C.c_void_p)]


def load(path=None):
    """The library, or None when it was not built (cargo build --release -p npukern-capi)."""
    path = path or os.environ.get("NPK_CAPI_LIB") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "target", "release", "libnpukern.so")
    return CApi(C.CDLL(path)) if os.path.exists(path) else None


class CApi:
    def __init__(self, lib):
        self.lib = lib
        self.threads = C.c_uint32(1)
        self.exec = Exec()
        self.exec.parallel_for = C.cast(lib.npk_threads_parallel_for, C.c_void_p).value
        self.exec.runner_ctx = C.cast(C.pointer(self.threads), C.c_void_p).value
        self.ws = {}

    def set_threads(self, n):
        self.threads.value = n

    def set_pages(self, pages):
        """The store hint of the next calls: None, "fresh" or "resident"."""
        self.exec.backend = PAGES[pages]

    @staticmethod
    def describe(t):
        assert t.is_contiguous()
        d = Tensor(t.data_ptr(), DTYPES[str(t.dtype)], t.dim())
        for i, s in enumerate(t.shape):
            d.shape[i] = s
        return d

    def _workspace(self, key, size_fn):
        if key not in self.ws:
            n = C.c_size_t(0)
            assert size_fn(C.byref(n)) == 0
            self.ws[key] = C.create_string_buffer(max(n.value, 1))
        b = self.ws[key]
        return C.cast(b, C.c_void_p), C.sizeof(b)

    def rms_norm(self, x, w, eps, torch):
        """y = RmsNorm(x) * w (y and rstd allocated here, as a caller would)."""
        y = torch.empty_like(x)
        rstd = torch.empty(x.shape[:-1] + (1,), dtype=torch.float32)
        xt, wt, yt, rt = (self.describe(t) for t in (x, w, y, rstd))
        o = NormOptions(eps, 0.0, 0)
        ex = C.byref(self.exec)
        ws, n = self._workspace(("rms", tuple(x.shape), x.dtype), lambda p: self.lib.npk_rms_norm_workspace_size(
            C.byref(xt), C.byref(wt), C.byref(o), ex, p))
        st = self.lib.npk_rms_norm(C.byref(xt), C.byref(wt), C.byref(o), C.byref(yt), C.byref(rt), ws,
                                   C.c_size_t(n), ex)
        assert st == 0, st
        return y

    def add_rms_norm(self, x1, x2, w, eps, torch, in_place=False):
        """(y, x_sum): AddRmsNorm with both outputs allocated here, or with
        `in_place` the sum written over x1 (IPEX's add_back form) and y alone
        allocated."""
        y = torch.empty_like(x1)
        s = x1 if in_place else torch.empty_like(x1)
        rstd = torch.empty(x1.shape[:-1] + (1,), dtype=torch.float32)
        at, bt, wt, yt, rt, stt = (self.describe(t) for t in (x1, x2, w, y, rstd, s))
        o = NormOptions(eps, 0.0, 0)
        ex = C.byref(self.exec)
        ws, n = self._workspace(("add", tuple(x1.shape), x1.dtype), lambda p: self.lib.npk_add_rms_norm_workspace_size(
            C.byref(at), C.byref(bt), C.byref(wt), C.byref(o), ex, p))
        st = self.lib.npk_add_rms_norm(C.byref(at), C.byref(bt), C.byref(wt), C.byref(o), C.byref(yt),
                                       C.byref(rt), C.byref(stt), ws, C.c_size_t(n), ex)
        assert st == 0, st
        return y, s
