"""The C ABI of libflashcore through ctypes: the one place Python spells it.

`include/flashcore.h` is the contract; tests/c_header.rs checks the constants, the
structures and `SIGNATURES` below against it, line by line. Nothing here imports torch:
the harness and the CPU tests use this module on machines without PyTorch or a GPU.
"""

import ctypes
import os
import struct
import threading

# ---- constants (values from include/flashcore.h) ------------------------------------------

FLASHCORE_F16 = 1
FLASHCORE_BF16 = 2
FLASHCORE_F32 = 3
FLASHCORE_E4M3 = 4
FLASHCORE_SUCCESS = 0
FLASHCORE_ERROR_NO_DRIVER = 1
FLASHCORE_ERROR_NO_DEVICE = 2


class FlashcoreTensor(ctypes.Structure):
    _fields_ = [
        ("ptr", ctypes.c_uint64),
        ("dtype", ctypes.c_int32),
        ("shape", ctypes.c_int64 * 4),
        ("strides", ctypes.c_int64 * 4),
    ]


# FlashcoreTensor's bytes (ptr, dtype, 4 bytes of padding, shape, strides): packing them
# is a few times faster than the structure's constructor, which a forward call makes
# four of.
_TENSOR_BYTES = struct.Struct("<Qi4x4q4q")
assert _TENSOR_BYTES.size == ctypes.sizeof(FlashcoreTensor)


def tensor(ptr, dtype, sizes, strides):
    """A FlashcoreTensor of a device address, a FLASHCORE_* dtype code and four sizes and
    element strides."""
    return FlashcoreTensor.from_buffer_copy(_TENSOR_BYTES.pack(ptr, dtype, *sizes, *strides))


class FlashcoreKvCache(ctypes.Structure):
    _fields_ = [
        ("k", FlashcoreTensor),
        ("v", FlashcoreTensor),
        ("seqlens", ctypes.c_uint64),
        ("block_table", ctypes.c_uint64),
        ("max_pages", ctypes.c_int64),
        ("table_stride", ctypes.c_int64),
    ]


class FlashcoreKvScales(ctypes.Structure):
    _fields_ = [
        ("k_scale", FlashcoreTensor),
        ("v_scale", FlashcoreTensor),
    ]


class FlashcoreVarlen(ctypes.Structure):
    _fields_ = [
        ("cu_seqlens_q", ctypes.c_uint64),
        ("cu_seqlens_k", ctypes.c_uint64),
        ("batch", ctypes.c_int64),
        ("max_seqlen_q", ctypes.c_int64),
    ]


class FlashcoreFp8Operands(ctypes.Structure):
    _fields_ = [
        ("q", FlashcoreTensor),
        ("k", FlashcoreTensor),
        ("vt", ctypes.c_uint64),
        ("vt_shape", ctypes.c_int64 * 4),
        ("vt_strides", ctypes.c_int64 * 3),
        ("q_scale", ctypes.c_uint64),
        ("k_scale", ctypes.c_uint64),
        ("v_scale", ctypes.c_uint64),
        ("lse_shift", ctypes.c_uint64),
    ]


class FlashcoreQuantizeOptions(ctypes.Structure):
    _fields_ = [
        ("smooth_k", ctypes.c_int32),
        ("hadamard", ctypes.c_int32),
        ("hadamard_seed", ctypes.c_uint64),
    ]


class FlashcoreAttentionOptions(ctypes.Structure):
    """The options of the _ex spellings, size-versioned as the header's are: a new one is
    FLASHCORE_ATTENTION_OPTIONS_INIT (struct_size = ctypes.sizeof of this class, no options:
    the default scale, no window, no causal mask, no cap), keyword arguments set on top. All
    zeros is not "no options": the library refuses a struct_size of 0."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("softmax_scale", ctypes.c_float),
        ("window_left", ctypes.c_int64),
        ("window_right", ctypes.c_int64),
        ("causal", ctypes.c_int32),
        ("softcap", ctypes.c_float),
    ]

    def __init__(self, **fields):
        init = {"struct_size": ctypes.sizeof(FlashcoreAttentionOptions), "softmax_scale": 0.0,
                "window_left": -1, "window_right": -1, "causal": 0, "softcap": 0.0}
        super().__init__(**{**init, **fields})


_I32P = ctypes.POINTER(ctypes.c_int32)

# name: (restype, argtypes), one line each.
SIGNATURES = {
    "flashcore_create": (ctypes.c_int32, [ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p)]),
    "flashcore_destroy": (None, [ctypes.c_void_p]),
    "flashcore_forward": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p]),
    "flashcore_check_forward": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32]),
    "flashcore_forward_window": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]),
    "flashcore_check_forward_window": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64]),
    "flashcore_forward_ex": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreAttentionOptions), ctypes.c_void_p]),
    "flashcore_check_forward_ex": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreAttentionOptions)]),
    "flashcore_forward_varlen": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreVarlen), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.c_float, ctypes.c_int32, ctypes.c_void_p]),
    "flashcore_check_forward_varlen": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreVarlen), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.c_float, ctypes.c_int32]),
    "flashcore_forward_varlen_window": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreVarlen), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.c_float, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]),
    "flashcore_check_forward_varlen_window": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreVarlen), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.c_float, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64]),
    "flashcore_forward_varlen_ex": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreVarlen), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreAttentionOptions), ctypes.c_void_p]),
    "flashcore_check_forward_varlen_ex": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreVarlen), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreAttentionOptions)]),
    "flashcore_decode": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]),
    "flashcore_decode_workspace_bytes": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(ctypes.c_size_t)]),
    "flashcore_check_decode": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32]),
    "flashcore_decode_window": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]),
    "flashcore_check_decode_window": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64]),
    "flashcore_decode_ex": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreAttentionOptions), ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]),
    "flashcore_check_decode_ex": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreAttentionOptions)]),
    "flashcore_append_kv": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p]),
    "flashcore_check_append_kv": (ctypes.c_int32, [ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32)]),
    "flashcore_decode_fp8kv": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreKvScales), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]),
    "flashcore_decode_workspace_bytes_fp8kv": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreKvScales), ctypes.POINTER(ctypes.c_size_t)]),
    "flashcore_check_decode_fp8kv": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreKvScales), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32]),
    "flashcore_decode_fp8kv_window": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreKvScales), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]),
    "flashcore_check_decode_fp8kv_window": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreKvScales), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64]),
    "flashcore_decode_fp8kv_ex": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreKvScales), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreAttentionOptions), ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]),
    "flashcore_check_decode_fp8kv_ex": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreKvScales), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreAttentionOptions)]),
    "flashcore_decode_varlen": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreKvScales), ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreAttentionOptions), ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]),
    "flashcore_decode_varlen_workspace_bytes": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreKvScales), ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_size_t)]),
    "flashcore_check_decode_varlen": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreKvScales), ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.POINTER(FlashcoreAttentionOptions)]),
    "flashcore_append_kv_fp8kv": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreKvScales), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p]),
    "flashcore_check_append_kv_fp8kv": (ctypes.c_int32, [ctypes.POINTER(FlashcoreKvCache), ctypes.POINTER(FlashcoreKvScales), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32)]),
    "flashcore_merge": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64, ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_void_p]),
    "flashcore_check_merge": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64, ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64]),
    "flashcore_fp8_workspace_bytes": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreQuantizeOptions), ctypes.POINTER(ctypes.c_size_t)]),
    "flashcore_quantize_fp8": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreQuantizeOptions), ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(FlashcoreFp8Operands), ctypes.c_void_p]),
    "flashcore_check_quantize_fp8": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreQuantizeOptions), ctypes.c_uint64, ctypes.c_size_t]),
    "flashcore_forward_fp8": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreFp8Operands), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p]),
    "flashcore_check_forward_fp8": (ctypes.c_int32, [ctypes.POINTER(FlashcoreFp8Operands), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32]),
    "flashcore_last_error": (ctypes.c_char_p, []),
    "flashcore_error_name": (ctypes.c_char_p, [ctypes.c_int32]),
    "flashcore_version": (ctypes.c_char_p, []),
}


# The key window of the attention calls' _window spellings, (window_left, window_right) in
# FlashAttention's convention: -1 leaves a side unbounded, so this is no window.
NO_WINDOW = (-1, -1)

# The logit soft cap of the attention calls' _ex spellings (FlashAttention's softcap): 0 is
# no cap.
NO_SOFTCAP = 0.0


def attention_options(scale, causal, window=NO_WINDOW, softcap=NO_SOFTCAP):
    """A FlashcoreAttentionOptions: the softmax scale (0.0: 1/sqrt(D)), causal masking, the
    key window (left, right) (-1: unbounded) and the soft cap (0.0: none)."""
    window_left, window_right = window
    return FlashcoreAttentionOptions(softmax_scale=scale, causal=int(causal), window_left=window_left,
                                     window_right=window_right, softcap=softcap)


class FlashcoreError(RuntimeError):
    """A failure reported by libflashcore: `code` and `name` (e.g.
    FLASHCORE_ERROR_BAD_STRIDES) and the library's own message."""

    def __init__(self, code, name, message):
        super().__init__(f"{name} ({code}): {message}")
        self.code = code
        self.name = name
        self.message = message

    def __reduce__(self):
        # Pickled as its three fields (RuntimeError's default passes only the formatted
        # text back to __init__): errors cross process pools as FlashcoreError.
        return (type(self), (self.code, self.name, self.message))


LIB_ENV = "FLASHCORE_LIB"
LIB_NAME = "libflashcore.so"


def default_lib_path():
    """$FLASHCORE_LIB if set, else the library shipped inside this package."""
    return os.environ.get(LIB_ENV) or os.path.join(os.path.dirname(os.path.abspath(__file__)), LIB_NAME)


class Library:
    """libflashcore loaded with its functions typed; contexts are made per device."""

    def __init__(self, path=None):
        self.path = path or default_lib_path()
        try:
            self.lib = ctypes.CDLL(self.path)
        except OSError as e:
            raise OSError(
                f"flashcore: cannot load {self.path}: {e} (set {LIB_ENV} to libflashcore.so, or "
                "install the flashcore wheel, which contains it)"
            ) from e
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        self.version = self.lib.flashcore_version().decode()

    def error_name(self, rc):
        return self.lib.flashcore_error_name(rc).decode()

    def check(self, rc):
        """Raises FlashcoreError for a non-zero return code, with the library's message."""
        if rc != FLASHCORE_SUCCESS:
            raise FlashcoreError(rc, self.error_name(rc), self.lib.flashcore_last_error().decode())

    def create(self, device):
        """A new context (an opaque pointer) on driver ordinal `device`."""
        ctx = ctypes.c_void_p()
        self.check(self.lib.flashcore_create(device, ctypes.byref(ctx)))
        return ctx

    def destroy(self, ctx):
        self.lib.flashcore_destroy(ctx)

    # The attention calls take `window`, FlashAttention's window_size (left, right) as two
    # ints (-1: unbounded), and `softcap`, FlashAttention's softcap (0.0: none). Without
    # either they go to the plain C calls; with a window alone to their _window spellings;
    # with a cap (any non-zero value: the library refuses negative, NaN and infinite ones)
    # to their _ex spellings, which take every option in one FlashcoreAttentionOptions.
    # The errors carry the name of the spelling called.

    def check_forward(self, q, k, v, o, lse_ptr, scale, causal, window=NO_WINDOW, softcap=NO_SOFTCAP):
        """Validates FlashcoreTensor descriptors as flashcore_forward(_window, _ex) would; no GPU needed."""
        tensors = (ctypes.byref(q), ctypes.byref(k), ctypes.byref(v), ctypes.byref(o), lse_ptr)
        if softcap:
            rc = self.lib.flashcore_check_forward_ex(*tensors, _options(scale, causal, window, softcap))
        elif window == NO_WINDOW:
            rc = self.lib.flashcore_check_forward(*tensors, scale, int(causal))
        else:
            rc = self.lib.flashcore_check_forward_window(*tensors, scale, int(causal), *window)
        self.check(rc)

    def forward(self, ctx, q, k, v, o, lse_ptr, scale, causal, stream, window=NO_WINDOW, softcap=NO_SOFTCAP):
        """flashcore_forward(_window, _ex) on FlashcoreTensor descriptors; `stream` is a CUstream address."""
        tensors = (ctx, ctypes.byref(q), ctypes.byref(k), ctypes.byref(v), ctypes.byref(o), lse_ptr)
        if softcap:
            rc = self.lib.flashcore_forward_ex(*tensors, _options(scale, causal, window, softcap), stream)
        elif window == NO_WINDOW:
            rc = self.lib.flashcore_forward(*tensors, scale, int(causal), stream)
        else:
            rc = self.lib.flashcore_forward_window(*tensors, scale, int(causal), *window, stream)
        self.check(rc)

    # ---- variable-length prefill ------------------------------------------------------------

    def check_forward_varlen(self, q, k, v, o, lse_ptr, varlen, host_cu_q, host_cu_k, scale, causal, window=NO_WINDOW,
                             softcap=NO_SOFTCAP):
        """Validates a packed call as flashcore_forward_varlen(_window, _ex) would; no GPU needed."""
        args = (
            ctypes.byref(q), ctypes.byref(k), ctypes.byref(v), ctypes.byref(o), lse_ptr, ctypes.byref(varlen),
            host_cu_q, host_cu_k,
        )
        if softcap:
            rc = self.lib.flashcore_check_forward_varlen_ex(*args, _options(scale, causal, window, softcap))
        elif window == NO_WINDOW:
            rc = self.lib.flashcore_check_forward_varlen(*args, scale, int(causal))
        else:
            rc = self.lib.flashcore_check_forward_varlen_window(*args, scale, int(causal), *window)
        self.check(rc)

    def forward_varlen(self, ctx, q, k, v, o, lse_ptr, varlen, host_cu_q, host_cu_k, scale, causal, stream,
                       window=NO_WINDOW, softcap=NO_SOFTCAP):
        """flashcore_forward_varlen(_window, _ex) on descriptors; `stream` is a CUstream address."""
        args = (
            ctx, ctypes.byref(q), ctypes.byref(k), ctypes.byref(v), ctypes.byref(o), lse_ptr, ctypes.byref(varlen),
            host_cu_q, host_cu_k,
        )
        if softcap:
            rc = self.lib.flashcore_forward_varlen_ex(*args, _options(scale, causal, window, softcap), stream)
        elif window == NO_WINDOW:
            rc = self.lib.flashcore_forward_varlen(*args, scale, int(causal), stream)
        else:
            rc = self.lib.flashcore_forward_varlen_window(*args, scale, int(causal), *window, stream)
        self.check(rc)

    # ---- serving: decode, append, merge -----------------------------------------------------
    # Host arrays (host_seqlens, host_block_table) are None or anything ctypes passes as an
    # int32 pointer (a ctypes int32 array, or `host_ptr` of an address); the caller keeps
    # them alive and sized as include/flashcore.h says. `scales` is None (a 16-bit cache:
    # the plain C calls) or a FlashcoreKvScales (see `describe_scales`) for an FP8 cache
    # (the C calls' _fp8kv spellings).

    def decode_workspace_bytes(self, ctx, q, cache, scales=None):
        """Bytes of workspace flashcore_decode needs for these descriptors (0: none)."""
        out = ctypes.c_size_t()
        if scales is None:
            rc = self.lib.flashcore_decode_workspace_bytes(ctx, ctypes.byref(q), ctypes.byref(cache), ctypes.byref(out))
        else:
            rc = self.lib.flashcore_decode_workspace_bytes_fp8kv(
                ctx, ctypes.byref(q), ctypes.byref(cache), ctypes.byref(scales), ctypes.byref(out)
            )
        self.check(rc)
        return out.value

    def check_decode(self, q, cache, host_seqlens, host_block_table, o, lse_ptr, scale, causal, scales=None,
                     window=NO_WINDOW, softcap=NO_SOFTCAP):
        """Validates a decode as flashcore_decode(_fp8kv)(_window, _ex) would (but for the workspace); no GPU needed."""
        lib, before = self.lib, (ctypes.byref(q), ctypes.byref(cache))
        host = (host_seqlens, host_block_table, ctypes.byref(o), lse_ptr)
        if softcap:
            opts = _options(scale, causal, window, softcap)
            if scales is None:
                rc = lib.flashcore_check_decode_ex(*before, *host, opts)
            else:
                rc = lib.flashcore_check_decode_fp8kv_ex(*before, ctypes.byref(scales), *host, opts)
        elif scales is None and window == NO_WINDOW:
            rc = lib.flashcore_check_decode(*before, *host, scale, int(causal))
        elif scales is None:
            rc = lib.flashcore_check_decode_window(*before, *host, scale, int(causal), *window)
        elif window == NO_WINDOW:
            rc = lib.flashcore_check_decode_fp8kv(*before, ctypes.byref(scales), *host, scale, int(causal))
        else:
            rc = lib.flashcore_check_decode_fp8kv_window(
                *before, ctypes.byref(scales), *host, scale, int(causal), *window
            )
        self.check(rc)

    def decode(self, ctx, q, cache, host_seqlens, host_block_table, o, lse_ptr, scale, causal, ws_ptr, ws_bytes, stream,
               scales=None, window=NO_WINDOW, softcap=NO_SOFTCAP):
        """flashcore_decode(_fp8kv)(_window, _ex) on descriptors; `stream` is a CUstream address."""
        lib, before = self.lib, (ctx, ctypes.byref(q), ctypes.byref(cache))
        host = (host_seqlens, host_block_table, ctypes.byref(o), lse_ptr)
        workspace = (ws_ptr, ws_bytes, stream)
        if softcap:
            opts = _options(scale, causal, window, softcap)
            if scales is None:
                rc = lib.flashcore_decode_ex(*before, *host, opts, *workspace)
            else:
                rc = lib.flashcore_decode_fp8kv_ex(*before, ctypes.byref(scales), *host, opts, *workspace)
        elif scales is None and window == NO_WINDOW:
            rc = lib.flashcore_decode(*before, *host, scale, int(causal), *workspace)
        elif scales is None:
            rc = lib.flashcore_decode_window(*before, *host, scale, int(causal), *window, *workspace)
        elif window == NO_WINDOW:
            rc = lib.flashcore_decode_fp8kv(*before, ctypes.byref(scales), *host, scale, int(causal), *workspace)
        else:
            rc = lib.flashcore_decode_fp8kv_window(
                *before, ctypes.byref(scales), *host, scale, int(causal), *window, *workspace
            )
        self.check(rc)

    # A serving batch in one call: packed queries (`cu_q_ptr`, the device offsets, `batch`
    # sequences, the longest `max_seqlen_q` queries) against the cache; one C spelling,
    # which takes every option in a FlashcoreAttentionOptions and `scales` NULL for a
    # 16-bit cache. `host_cu_q` is None or an int32 pointer to batch + 1 host offsets.

    def decode_varlen_workspace_bytes(self, ctx, q, cache, scales, cu_q_ptr, batch, max_seqlen_q):
        """Bytes of workspace flashcore_decode_varlen needs for these arguments (0: none)."""
        out = ctypes.c_size_t()
        self.check(
            self.lib.flashcore_decode_varlen_workspace_bytes(
                ctx, ctypes.byref(q), ctypes.byref(cache), _byref_or_none(scales), cu_q_ptr, batch, max_seqlen_q,
                ctypes.byref(out),
            )
        )
        return out.value

    def check_decode_varlen(self, q, cache, scales, cu_q_ptr, batch, max_seqlen_q, host_cu_q, host_seqlens,
                            host_block_table, o, lse_ptr, scale, causal, window=NO_WINDOW, softcap=NO_SOFTCAP):
        """Validates a serving batch as flashcore_decode_varlen would (but for the workspace); no GPU needed."""
        self.check(
            self.lib.flashcore_check_decode_varlen(
                ctypes.byref(q), ctypes.byref(cache), _byref_or_none(scales), cu_q_ptr, batch, max_seqlen_q,
                host_cu_q, host_seqlens, host_block_table, ctypes.byref(o), lse_ptr,
                _options(scale, causal, window, softcap),
            )
        )

    def decode_varlen(self, ctx, q, cache, scales, cu_q_ptr, batch, max_seqlen_q, host_cu_q, host_seqlens,
                      host_block_table, o, lse_ptr, scale, causal, ws_ptr, ws_bytes, stream, window=NO_WINDOW,
                      softcap=NO_SOFTCAP):
        """flashcore_decode_varlen on descriptors; `stream` is a CUstream address."""
        self.check(
            self.lib.flashcore_decode_varlen(
                ctx, ctypes.byref(q), ctypes.byref(cache), _byref_or_none(scales), cu_q_ptr, batch, max_seqlen_q,
                host_cu_q, host_seqlens, host_block_table, ctypes.byref(o), lse_ptr,
                _options(scale, causal, window, softcap), ws_ptr, ws_bytes, stream,
            )
        )

    def check_append_kv(self, cache, k_new, v_new, host_seqlens, host_block_table, scales=None):
        """Validates an append as flashcore_append_kv would; no GPU needed."""
        if scales is None:
            rc = self.lib.flashcore_check_append_kv(
                ctypes.byref(cache), ctypes.byref(k_new), ctypes.byref(v_new), host_seqlens, host_block_table
            )
        else:
            rc = self.lib.flashcore_check_append_kv_fp8kv(
                ctypes.byref(cache), ctypes.byref(scales), ctypes.byref(k_new), ctypes.byref(v_new), host_seqlens,
                host_block_table,
            )
        self.check(rc)

    def append_kv(self, ctx, cache, k_new, v_new, host_seqlens, host_block_table, stream, scales=None):
        """flashcore_append_kv on descriptors; `stream` is a CUstream address."""
        if scales is None:
            rc = self.lib.flashcore_append_kv(
                ctx, ctypes.byref(cache), ctypes.byref(k_new), ctypes.byref(v_new), host_seqlens, host_block_table,
                stream,
            )
        else:
            rc = self.lib.flashcore_append_kv_fp8kv(
                ctx, ctypes.byref(cache), ctypes.byref(scales), ctypes.byref(k_new), ctypes.byref(v_new), host_seqlens,
                host_block_table, stream,
            )
        self.check(rc)

    def check_merge(self, parts, count, shard_stride, lse_parts, out, out_lse):
        """Validates a merge as flashcore_merge would; no GPU needed."""
        self.check(
            self.lib.flashcore_check_merge(ctypes.byref(parts), count, shard_stride, lse_parts, ctypes.byref(out), out_lse)
        )

    def merge(self, ctx, parts, count, shard_stride, lse_parts, out, out_lse, stream):
        """flashcore_merge on descriptors; `stream` is a CUstream address."""
        self.check(
            self.lib.flashcore_merge(
                ctx, ctypes.byref(parts), count, shard_stride, lse_parts, ctypes.byref(out), out_lse, stream
            )
        )

    # ---- FP8 (e4m3) attention -----------------------------------------------------------------
    # `options` is a FlashcoreQuantizeOptions (see `quantize_options`) or None for none.

    def fp8_workspace_bytes(self, q, k, v, options):
        """Bytes of workspace flashcore_quantize_fp8 needs for these descriptors (any start
        address); validates them as the quantizer does. No GPU needed."""
        out = ctypes.c_size_t()
        self.check(
            self.lib.flashcore_fp8_workspace_bytes(
                ctypes.byref(q), ctypes.byref(k), ctypes.byref(v), _byref_or_none(options), ctypes.byref(out)
            )
        )
        return out.value

    def check_quantize_fp8(self, q, k, v, options, ws_ptr, ws_bytes):
        """Validates a quantization as flashcore_quantize_fp8 would; no GPU needed."""
        self.check(
            self.lib.flashcore_check_quantize_fp8(
                ctypes.byref(q), ctypes.byref(k), ctypes.byref(v), _byref_or_none(options), ws_ptr, ws_bytes
            )
        )

    def quantize_fp8(self, ctx, q, k, v, options, ws_ptr, ws_bytes, stream):
        """flashcore_quantize_fp8 on descriptors: returns the FlashcoreFp8Operands it wrote
        (pointers into the workspace); `stream` is a CUstream address."""
        out = FlashcoreFp8Operands()
        self.check(
            self.lib.flashcore_quantize_fp8(
                ctx, ctypes.byref(q), ctypes.byref(k), ctypes.byref(v), _byref_or_none(options), ws_ptr, ws_bytes,
                ctypes.byref(out), stream,
            )
        )
        return out

    def check_forward_fp8(self, ops, o, lse_ptr, scale, causal):
        """Validates an FP8 forward as flashcore_forward_fp8 would; no GPU needed."""
        self.check(self.lib.flashcore_check_forward_fp8(ctypes.byref(ops), ctypes.byref(o), lse_ptr, scale, int(causal)))

    def forward_fp8(self, ctx, ops, o, lse_ptr, scale, causal, stream):
        """flashcore_forward_fp8 on descriptors; `stream` is a CUstream address."""
        self.check(
            self.lib.flashcore_forward_fp8(ctx, ctypes.byref(ops), ctypes.byref(o), lse_ptr, scale, int(causal), stream)
        )


def _byref_or_none(x):
    return None if x is None else ctypes.byref(x)


def _options(scale, causal, window, softcap):
    """`attention_options(...)` by reference, as the _ex spellings take it."""
    return ctypes.byref(attention_options(scale, causal, window, softcap))


def quantize_options(smooth_k=False, hadamard_seed=None):
    """A FlashcoreQuantizeOptions: K smoothing on or off, and the Hadamard rotation's seed
    (None: no rotation; an integer in [0, 2^64))."""
    o = FlashcoreQuantizeOptions()
    o.smooth_k = int(bool(smooth_k))
    if hadamard_seed is not None:
        seed = int(hadamard_seed)
        if not 0 <= seed < 1 << 64:
            raise ValueError(f"flashcore: hadamard_seed must be in [0, 2^64), got {seed}")
        o.hadamard = 1
        o.hadamard_seed = seed
    return o


_library = None
_library_lock = threading.Lock()


def library():
    """The process-wide Library, loaded on first use."""
    global _library
    with _library_lock:
        if _library is None:
            _library = Library()
        return _library


def describe(ptr, dtype_code, shape_bshd, strides_bshd):
    """A FlashcoreTensor from a pointer, a dtype code and logical [B, S, H, D] sizes/strides."""
    t = FlashcoreTensor()
    t.ptr = ptr
    t.dtype = dtype_code
    for i in range(4):
        t.shape[i] = shape_bshd[i]
        t.strides[i] = strides_bshd[i]
    return t


def describe_cache(k, v, seqlens_ptr, block_table_ptr=0, max_pages=0, table_stride=0):
    """A FlashcoreKvCache from two FlashcoreTensors and the metadata's device addresses:
    contiguous when block_table_ptr, max_pages and table_stride are all 0, else paged."""
    c = FlashcoreKvCache()
    c.k = k
    c.v = v
    c.seqlens = seqlens_ptr
    c.block_table = block_table_ptr
    c.max_pages = max_pages
    c.table_stride = table_stride
    return c


def describe_scales(k_scale, v_scale):
    """A FlashcoreKvScales from two FlashcoreTensors: an FP8 cache's float32 scales, each
    [outer, rows, Hkv, 1] (the cache's first three dimensions and 1)."""
    s = FlashcoreKvScales()
    s.k_scale = k_scale
    s.v_scale = v_scale
    return s


def int32_array(values):
    """A ctypes int32 array holding `values` (host metadata), or None for None."""
    if values is None:
        return None
    values = list(values)
    return (ctypes.c_int32 * len(values))(*values)


def host_ptr(address):
    """An int32 pointer at a host address (a CPU tensor's data_ptr()), or None for 0."""
    return ctypes.cast(address, _I32P) if address else None
