"""Tests that need no GPU: the package imports, the library loads, flashcore's argument
rules reach Python as exceptions, and shapes come out right on fake (meta) tensors."""

import ctypes
import math
import os
import re

import pytest
import torch

import flashcore
from flashcore import FlashcoreError, _capi
from flashcore.ops import kernel_ready

from conftest import REPO_ROOT


def meta(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def driver_present():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def test_versions_agree():
    cargo = open(os.path.join(REPO_ROOT, "Cargo.toml"), encoding="utf-8").read()
    version = re.search(r'^version = "([^"]+)"', cargo, re.M).group(1)
    assert flashcore.__version__ == version
    assert flashcore.library_version() == version


def test_the_library_comes_from_the_package():
    if os.environ.get(_capi.LIB_ENV):
        pytest.skip(f"{_capi.LIB_ENV} overrides the packaged library")
    lib = _capi.library().path
    assert os.path.dirname(lib) == os.path.dirname(os.path.abspath(flashcore.__file__))
    assert os.path.isfile(lib)


def describe(shape, dtype=_capi.FLASHCORE_F16, ptr=1 << 40):
    """A contiguous [B, S, H, D] descriptor."""
    b, s, h, d = shape
    return _capi.describe(ptr, dtype, shape, [s * h * d, h * d, d, 1])


def test_c_abi_checks_arrive_as_flashcore_errors():
    lib = _capi.library()
    q = describe((1, 64, 4, 128))
    k = describe((1, 80, 2, 128), ptr=2 << 40)
    v = describe((1, 80, 2, 128), ptr=3 << 40)
    o = describe((1, 64, 4, 128), ptr=4 << 40)
    lib.check_forward(q, k, v, o, 0, 0.0, True)  # valid: no exception

    bad = describe((1, 64, 4, 48), ptr=4 << 40)
    with pytest.raises(FlashcoreError) as e:
        lib.check_forward(bad, k, v, bad, 0, 0.0, False)
    assert e.value.name == "FLASHCORE_ERROR_SHAPE_MISMATCH"
    with pytest.raises(FlashcoreError) as e:
        lib.check_forward(q, k, v, o, (5 << 40) + 2, 0.0, False)
    assert e.value.name == "FLASHCORE_ERROR_MISALIGNED"
    assert e.value.code == 11
    assert e.value.message.startswith("flashcore_check_forward: ")


@pytest.mark.skipif(driver_present(), reason="a driver is present")
def test_no_driver_is_a_typed_error():
    with pytest.raises(FlashcoreError) as e:
        _capi.library().create(0)
    assert e.value.name == "FLASHCORE_ERROR_NO_DRIVER"


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
def test_fake_shapes(layout, causal):
    def make(b, h, s, d):
        return meta(b, h, s, d) if layout == "bhsd" else meta(b, s, h, d)

    q, k, v = make(2, 8, 77, 128), make(2, 2, 300, 128), make(2, 2, 300, 128)
    o = flashcore.attention(q, k, v, causal=causal, layout=layout)
    assert o.shape == q.shape and o.dtype == q.dtype and o.device.type == "meta"
    assert o.is_contiguous()
    o, lse = flashcore.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
    assert o.shape == q.shape
    assert lse.shape == (2, 8, 77) and lse.dtype == torch.float32


@pytest.mark.parametrize(
    "q_shape, kv_shape, dtype, kv_dtype, name, words",
    [
        ((1, 4, 64, 48), (1, 4, 64, 48), torch.float16, None, "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM", "48"),
        ((1, 6, 64, 64), (1, 4, 64, 64), torch.float16, None, "FLASHCORE_ERROR_HEAD_RATIO", "6"),
        ((1, 4, 64, 64), (1, 4, 64, 64), torch.float32, None, "FLASHCORE_ERROR_UNSUPPORTED_DTYPE", "f16 or bf16"),
        ((1, 4, 64, 64), (1, 4, 64, 64), torch.float16, torch.bfloat16, "FLASHCORE_ERROR_UNSUPPORTED_DTYPE", "share"),
        ((1, 4, 64, 64), (2, 4, 64, 64), torch.float16, None, "FLASHCORE_ERROR_SHAPE_MISMATCH", "batch"),
        ((1, 4, (1 << 25) + 1, 64), (1, 4, 64, 64), torch.float16, None, "FLASHCORE_ERROR_INVALID_ARGUMENT", "2^25"),
        ((1, 4, 64, 128), (1, 4, 64, 64), torch.bfloat16, None, "FLASHCORE_ERROR_SHAPE_MISMATCH", "head_dim"),
    ],
)
def test_fake_calls_apply_flashcore_rules(q_shape, kv_shape, dtype, kv_dtype, name, words):
    q = meta(*q_shape, dtype=dtype)
    k = meta(*kv_shape, dtype=kv_dtype or dtype)
    v = meta(*kv_shape, dtype=kv_dtype or dtype)
    with pytest.raises(FlashcoreError) as e:
        flashcore.attention(q, k, v)
    assert e.value.name == name
    assert words in str(e.value)


def test_misuse_is_refused_before_the_library():
    q = meta(1, 4, 64, 64)
    with pytest.raises(ValueError, match="layout"):
        flashcore.attention(q, q, q, layout="bsdh")
    for s in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="scale"):
            flashcore.attention(q, q, q, scale=s)
    with pytest.raises(ValueError, match="4-d"):
        flashcore.attention(meta(4, 64, 64), q, q)
    with pytest.raises(TypeError):
        flashcore.attention(q, q, None)
    cpu = torch.zeros(1, 4, 64, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA"):
        flashcore.attention(cpu, cpu, cpu)
    g = meta(1, 4, 64, 64).requires_grad_()
    with pytest.raises(NotImplementedError, match="backward"):
        flashcore.attention(g, q, q)
    with torch.no_grad():
        assert flashcore.attention(g, q, q).shape == g.shape


def test_empty_problems_follow_the_rules_too():
    # No keys or no queries: no launch, but the dtype/head-dim/ratio rules still apply.
    assert flashcore.attention(meta(1, 4, 0, 64), meta(1, 4, 9, 64), meta(1, 4, 9, 64)).shape == (1, 4, 0, 64)
    assert flashcore.attention(meta(1, 4, 5, 64), meta(1, 4, 0, 64), meta(1, 4, 0, 64)).shape == (1, 4, 5, 64)
    with pytest.raises(FlashcoreError, match="UNSUPPORTED_HEAD_DIM"):
        flashcore.attention(meta(1, 4, 0, 40), meta(1, 4, 9, 40), meta(1, 4, 9, 40))


def test_kernel_ready_views():
    x = torch.zeros(2, 77, 3, 8, 64, dtype=torch.float16)  # packed qkv [B, S, 3, H, D]
    q = x[:, :, 0]
    assert kernel_ready(q) and kernel_ready(q.transpose(1, 2))
    assert not kernel_ready(torch.zeros(1, 4, 64, 128, dtype=torch.float16)[..., ::2])
    assert not kernel_ready(torch.zeros(1, 4, 64, 68, dtype=torch.float16)[..., :64])  # rows of 136 B
    y = torch.zeros(1, 1, 64, 64, dtype=torch.float16).as_strided((1, 1, 64, 64), (3, 5, 64, 1))
    assert kernel_ready(y)  # extent-1 dims: strides never used


def test_compiles_to_one_graph():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    def f(q, k, v):
        return flashcore.attention(q, k, v, causal=True, layout="bshd") * 2

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    q, k = meta(2, 64, 8, 64), meta(2, 64, 2, 64)
    assert compiled(q, k, k).shape == q.shape
    assert len(calls) == 1
    ops = [n.target for n in calls[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.flashcore.attention in ops, ops
