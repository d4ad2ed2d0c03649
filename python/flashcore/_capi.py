"""The C ABI of libflashcore through ctypes: the one place Python spells it.

`include/flashcore.h` is the contract; tests/c_header.rs checks the constants, the
structure and `SIGNATURES` below against it, line by line. Nothing here imports torch:
the harness and the CPU tests use this module on machines without PyTorch or a GPU.
"""

import ctypes
import os
import threading

# ---- constants (values from include/flashcore.h) ------------------------------------------

FLASHCORE_F16 = 1
FLASHCORE_BF16 = 2
FLASHCORE_F32 = 3
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


# name: (restype, argtypes), one line each.
SIGNATURES = {
    "flashcore_create": (ctypes.c_int32, [ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p)]),
    "flashcore_destroy": (None, [ctypes.c_void_p]),
    "flashcore_forward": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p]),
    "flashcore_check_forward": (ctypes.c_int32, [ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.POINTER(FlashcoreTensor), ctypes.c_uint64, ctypes.c_float, ctypes.c_int32]),
    "flashcore_last_error": (ctypes.c_char_p, []),
    "flashcore_error_name": (ctypes.c_char_p, [ctypes.c_int32]),
    "flashcore_version": (ctypes.c_char_p, []),
}


class FlashcoreError(RuntimeError):
    """A failure reported by libflashcore: `code` and `name` (e.g.
    FLASHCORE_ERROR_BAD_STRIDES) and the library's own message."""

    def __init__(self, code, name, message):
        super().__init__(f"{name} ({code}): {message}")
        self.code = code
        self.name = name
        self.message = message


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

    def check_forward(self, q, k, v, o, lse_ptr, scale, causal):
        """Validates FlashcoreTensor descriptors as flashcore_forward would; no GPU needed."""
        self.check(
            self.lib.flashcore_check_forward(
                ctypes.byref(q), ctypes.byref(k), ctypes.byref(v), ctypes.byref(o), lse_ptr, scale, int(causal)
            )
        )

    def forward(self, ctx, q, k, v, o, lse_ptr, scale, causal, stream):
        """flashcore_forward on FlashcoreTensor descriptors; `stream` is a CUstream address."""
        self.check(
            self.lib.flashcore_forward(
                ctx,
                ctypes.byref(q),
                ctypes.byref(k),
                ctypes.byref(v),
                ctypes.byref(o),
                lse_ptr,
                scale,
                int(causal),
                stream,
            )
        )


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
