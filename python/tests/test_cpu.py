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
        ((1, 4, 64, 44), (1, 4, 64, 44), torch.float16, None, "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM", "44"),
        ((1, 4, 64, 264), (1, 4, 64, 264), torch.float16, None, "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM", "264"),
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
    # 1e-46 and 1e39 are finite Python floats that float32 turns into 0 (which the C ABI
    # reads as "the default scale") and inf; 3e38 is a float32 but times log2(e) is not.
    for s in (0.0, -1.0, math.nan, math.inf, 1e-46, 1e39, 3e38):
        with pytest.raises(ValueError, match="scale"):
            flashcore.attention(q, q, q, scale=s)
    with pytest.raises(ValueError, match="4-d"):
        flashcore.attention(meta(4, 64, 64), q, q)
    with pytest.raises(TypeError):
        flashcore.attention(q, q, None)
    cpu = torch.zeros(1, 4, 64, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA"):
        flashcore.attention(cpu, cpu, cpu)
    # An int past float64 and strings or bools: the documented errors, not OverflowError
    # or a silent 1.0.
    with pytest.raises(ValueError, match="scale"):
        flashcore.attention(q, q, q, scale=10**400)
    for s in ("0.1", True):
        with pytest.raises(TypeError, match="scale"):
            flashcore.attention(q, q, q, scale=s)
    with pytest.raises(ValueError, match="softcap"):
        flashcore.attention(q, q, q, softcap=10**400)
    # A finite float64 that float32 makes infinite: struct.pack's OverflowError is not
    # what the docs promise.
    with pytest.raises(ValueError, match="softcap"):
        flashcore.attention(q, q, q, softcap=1e39)
    g = meta(1, 4, 64, 64).requires_grad_()
    with pytest.raises(NotImplementedError, match="backward"):
        flashcore.attention(g, q, q)
    with torch.no_grad():
        assert flashcore.attention(g, q, q).shape == g.shape


def test_head_dims_without_a_kernel_of_their_own_are_taken():
    # Every multiple of 8 up to 256 runs (padded on the next larger kernel); the others,
    # and head dims past 256, are refused.
    for d in (8, 40, 72, 80, 160, 248):
        assert flashcore.forward_head_dim(d)
        out = flashcore.attention(meta(1, 4, 33, d), meta(1, 4, 9, d), meta(1, 4, 9, d))
        assert out.shape == (1, 4, 33, d)
    for d in (0, 4, 20, 100, 264):
        assert not flashcore.forward_head_dim(d)


def test_empty_problems_follow_the_rules_too():
    # No keys or no queries: no launch, but the dtype/head-dim/ratio rules still apply.
    assert flashcore.attention(meta(1, 4, 0, 64), meta(1, 4, 9, 64), meta(1, 4, 9, 64)).shape == (1, 4, 0, 64)
    assert flashcore.attention(meta(1, 4, 5, 64), meta(1, 4, 0, 64), meta(1, 4, 0, 64)).shape == (1, 4, 5, 64)
    with pytest.raises(FlashcoreError, match="UNSUPPORTED_HEAD_DIM"):
        flashcore.attention(meta(1, 4, 0, 36), meta(1, 4, 9, 36), meta(1, 4, 9, 36))


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


# ---- serving: decode, append_kv, merge --------------------------------------------------------


def i32(*shape):
    return meta(*shape, dtype=torch.int32)


def cache_descs(paged):
    """Two sequences of capacity 64, 2 KV heads of 64: contiguous, or pages of 16 in a pool of 8."""
    shape = (8, 16, 2, 64) if paged else (2, 64, 2, 64)
    k, v = describe(shape, ptr=1 << 40), describe(shape, ptr=2 << 40)
    if paged:
        return _capi.describe_cache(k, v, 3 << 40, (3 << 40) + 4096, 4, 4)
    return _capi.describe_cache(k, v, 3 << 40)


def test_c_abi_serving_checks_arrive_as_flashcore_errors():
    lib = _capi.library()
    q, o = describe((2, 1, 4, 64), ptr=4 << 40), describe((2, 1, 4, 64), ptr=5 << 40)
    table = _capi.int32_array(range(8))
    for paged in (False, True):
        c = cache_descs(paged)
        lib.check_decode(q, c, None, None, o, 0, 0.0, True)  # valid: no exception
        lib.check_decode(q, c, _capi.int32_array([64, 0]), table if paged else None, o, 6 << 40, 0.5, False)
    c = cache_descs(True)
    cases = [
        (dict(q=describe((2, 1, 3, 64), ptr=4 << 40)), "FLASHCORE_ERROR_HEAD_RATIO", "3"),
        (dict(lens=[65, 0], table=table), "FLASHCORE_ERROR_INVALID_ARGUMENT", "capacity"),
        (dict(lens=[64, 0], table=_capi.int32_array([0, 1, 2, 8, 4, 5, 6, 7])), "FLASHCORE_ERROR_INVALID_ARGUMENT",
         "block_table[0][3] = 8"),
        (dict(lens=[17, 0], table=_capi.int32_array([0, 99, 2, 3, 4, 5, 6, 7])), "FLASHCORE_ERROR_INVALID_ARGUMENT",
         "outside the pool"),
        (dict(lens=[1, 0]), "FLASHCORE_ERROR_INVALID_ARGUMENT", "block table"),
        (dict(table=table), "FLASHCORE_ERROR_INVALID_ARGUMENT", "without host_seqlens"),
        (dict(lse=(6 << 40) + 2), "FLASHCORE_ERROR_MISALIGNED", "lse"),
        (dict(scale=-1.0), "FLASHCORE_ERROR_INVALID_ARGUMENT", "scale"),
    ]
    for args, name, words in cases:
        with pytest.raises(FlashcoreError) as e:
            lens = args.get("lens")
            lib.check_decode(
                args.get("q", q), c, _capi.int32_array(lens) if lens else None, args.get("table"), o,
                args.get("lse", 0), args.get("scale", 0.0), False,
            )
        assert e.value.name == name, args
        assert words in e.value.message, (args, e.value.message)
        assert e.value.message.startswith("flashcore_check_decode: ")
    # A long prompt chunk passes the checks: the decode kernels' grid is the call's to apply.
    long_q, long_o = describe((2, 600000, 4, 64), ptr=4 << 40), describe((2, 600000, 4, 64), ptr=5 << 40)
    lib.check_decode(long_q, c, None, None, long_o, 0, 0.0, True)
    # Entries past a sequence's last page are not looked at.
    lib.check_decode(q, c, _capi.int32_array([48, 0]), _capi.int32_array([0, 1, 2, -1, 4, 5, 6, 7]), o, 0, 0.0, False)
    c.max_pages = -1
    with pytest.raises(FlashcoreError, match="max_pages is -1"):
        lib.check_decode(q, c, None, None, o, 0, 0.0, False)
    c = cache_descs(True)
    c.block_table = 0
    with pytest.raises(FlashcoreError) as e:
        lib.check_decode(q, c, None, None, o, 0, 0.0, False)
    assert e.value.name == "FLASHCORE_ERROR_NULL_POINTER"

    new = describe((2, 3, 2, 64), ptr=4 << 40)
    vnew = describe((2, 3, 2, 64), ptr=5 << 40)
    lib.check_append_kv(cache_descs(False), new, vnew, _capi.int32_array([61, 0]), None)
    with pytest.raises(FlashcoreError) as e:
        lib.check_append_kv(cache_descs(True), new, vnew, _capi.int32_array([62, 0]), table)
    assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT" and "3 new tokens" in e.value.message
    with pytest.raises(FlashcoreError) as e:
        lib.check_append_kv(cache_descs(False), describe((2, 3, 4, 64), ptr=4 << 40), vnew, None, None)
    assert e.value.name == "FLASHCORE_ERROR_SHAPE_MISMATCH"

    parts = describe((2, 5, 4, 128), ptr=1 << 40)
    out = describe((2, 5, 4, 128), dtype=_capi.FLASHCORE_F32, ptr=3 << 40)
    n = 2 * 5 * 4 * 128
    lib.check_merge(parts, 3, n, 2 << 40, out, 4 << 40)
    for count, stride, lse, name in [
        (0, n, 2 << 40, "FLASHCORE_ERROR_EMPTY_DIMENSION"),
        (3, 3, 2 << 40, "FLASHCORE_ERROR_BAD_STRIDES"),
        (3, -n, 2 << 40, "FLASHCORE_ERROR_BAD_STRIDES"),
        (3, n, 0, "FLASHCORE_ERROR_NULL_POINTER"),
        (3, n, (2 << 40) + 1, "FLASHCORE_ERROR_MISALIGNED"),
    ]:
        with pytest.raises(FlashcoreError) as e:
            lib.check_merge(parts, count, stride, lse, out, 0)
        assert e.value.name == name, (count, stride, lse)


@pytest.mark.parametrize("d", [128, 80], ids=["d128", "d80"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_serving_fake_shapes(paged, d):
    # 80 has no kernel of its own: the 96 one runs padded, for decode and the merge.
    q, lens = meta(3, 4, 32, d), i32(3)
    if paged:
        k, v, table = meta(96, 16, 8, d), meta(96, 16, 8, d), i32(3, 32)
    else:
        k, v, table = meta(3, 512, 8, d), meta(3, 512, 8, d), None
    o = flashcore.decode(q, k, v, lens, block_table=table, causal=True)
    assert o.shape == q.shape and o.dtype == q.dtype and o.device.type == "meta" and o.is_contiguous()
    o, lse = flashcore.decode(q, k, v, lens, block_table=table, return_lse=True, scale=0.1)
    assert o.shape == q.shape and lse.shape == (3, 32, 4) and lse.dtype == torch.float32
    assert flashcore.append_kv(k, v, lens, meta(3, 2, 8, d), meta(3, 2, 8, d), block_table=table) is None
    parts = meta(3, 3, 4, 32, d, dtype=torch.float32)
    assert flashcore.merge(parts, meta(3, 3, 32, 4, dtype=torch.float32)).shape == q.shape


def test_merge_fake_shapes():
    parts, lse_parts = meta(3, 2, 7, 8, 64, dtype=torch.bfloat16), meta(3, 2, 8, 7, dtype=torch.float32)
    out = flashcore.merge(parts, lse_parts)
    assert out.shape == (2, 7, 8, 64) and out.dtype == torch.bfloat16 and out.is_contiguous()
    out, lse = flashcore.merge(parts, lse_parts, out_dtype=torch.float32, return_lse=True)
    assert out.dtype == torch.float32 and lse.shape == (2, 8, 7)
    # flashcore.attention's default layout, and lists of shards.
    bhsd = [meta(2, 8, 7, 64) for _ in range(3)]
    out, lse = flashcore.merge(bhsd, list(lse_parts.unbind(0)), layout="bhsd", return_lse=True)
    assert out.shape == (2, 8, 7, 64) and lse.shape == (2, 8, 7)


@pytest.mark.parametrize(
    "q_shape, cache_shape, table_shape, dtype, cache_dtype, name, words",
    [
        ((2, 1, 12, 128), (2, 64, 8, 128), None, torch.float16, None, "FLASHCORE_ERROR_HEAD_RATIO", "12"),
        ((2, 1, 8, 264), (2, 64, 8, 264), None, torch.float16, None, "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM", "264"),
        ((2, 1, 8, 64), (2, 64, 8, 64), None, torch.float16, torch.bfloat16, "FLASHCORE_ERROR_UNSUPPORTED_DTYPE", "share"),
        ((2, 1, 8, 64), (2, 64, 8, 64), None, torch.float32, None, "FLASHCORE_ERROR_UNSUPPORTED_DTYPE", "f16 or bf16"),
        ((2, 1, 8, 64), (3, 64, 8, 64), None, torch.float16, None, "FLASHCORE_ERROR_SHAPE_MISMATCH", "batch"),
        ((2, 1, 8, 64), (2, 64, 8, 128), None, torch.float16, None, "FLASHCORE_ERROR_SHAPE_MISMATCH", "head_dim"),
        ((2, 1, 8, 64), (9, 48, 8, 64), (2, 4), torch.float16, None, "FLASHCORE_ERROR_INVALID_ARGUMENT", "power of two"),
        ((2, 1, 8, 64), (2, 0, 8, 64), None, torch.float16, None, "FLASHCORE_ERROR_EMPTY_DIMENSION", "k_cache"),
    ],
)
def test_fake_decode_applies_flashcore_rules(q_shape, cache_shape, table_shape, dtype, cache_dtype, name, words):
    q = meta(*q_shape, dtype=dtype)
    k = meta(*cache_shape, dtype=cache_dtype or dtype)
    table = i32(*table_shape) if table_shape else None
    with pytest.raises(FlashcoreError) as e:
        flashcore.decode(q, k, k.clone(), i32(q_shape[0]), block_table=table)
    assert e.value.name == name
    assert words in str(e.value)
    assert e.value.message.startswith("flashcore_check_decode: ")


def test_fake_decode_takes_long_prompt_chunks():
    # 300000 queries of 8 heads: past the decode kernels' grid (8 KV heads x 18750 blocks of
    # 16 rows), which only the call applies, where those kernels would take it (on Hopper
    # the forward kernels run such chunks).
    k = meta(2, 64, 8, 128)
    o = flashcore.decode(meta(2, 300000, 8, 128), k, k.clone(), i32(2))
    assert o.shape == (2, 300000, 8, 128)


def test_fake_append_and_merge_apply_flashcore_rules():
    k, lens = meta(2, 64, 8, 64), i32(2)
    with pytest.raises(FlashcoreError, match="SHAPE_MISMATCH"):
        flashcore.append_kv(k, k.clone(), lens, meta(2, 3, 4, 64), meta(2, 3, 4, 64))
    with pytest.raises(FlashcoreError, match="UNSUPPORTED_DTYPE"):
        flashcore.append_kv(k, k.clone(), lens, meta(2, 3, 8, 64, dtype=torch.bfloat16), meta(2, 3, 8, 64))
    with pytest.raises(FlashcoreError, match="too many for one append"):
        flashcore.append_kv(k, k.clone(), lens, meta(2, 65, 8, 64), meta(2, 65, 8, 64))
    with pytest.raises(FlashcoreError, match="UNSUPPORTED_HEAD_DIM"):
        flashcore.merge(meta(2, 1, 3, 4, 264), meta(2, 1, 4, 3, dtype=torch.float32))
    with pytest.raises(FlashcoreError, match="EMPTY_DIMENSION"):
        flashcore.merge(meta(0, 1, 3, 4, 64), meta(0, 1, 4, 3, dtype=torch.float32))


def test_serving_misuse_is_refused_before_the_library():
    q, k, lens, table = meta(2, 1, 8, 64), meta(2, 64, 8, 64), i32(2), i32(2, 4)
    pool = meta(8, 16, 8, 64)
    with pytest.raises(ValueError, match="int32"):
        flashcore.decode(q, k, k, meta(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="3 entries for a batch of 2"):
        flashcore.decode(q, k, k, i32(3))
    with pytest.raises(ValueError, match="contiguous"):
        flashcore.decode(q, k, k, i32(4)[::2])
    with pytest.raises(ValueError, match="3 rows"):
        flashcore.decode(q, pool, pool, lens, block_table=i32(3, 4))
    with pytest.raises(ValueError, match="rows must be contiguous"):
        flashcore.decode(q, pool, pool, lens, block_table=i32(4, 2).t())
    with pytest.raises(ValueError, match="no pages"):
        flashcore.decode(q, pool, pool, lens, block_table=i32(2, 0))
    with pytest.raises(ValueError, match="block_table must be torch.int32"):
        flashcore.decode(q, pool, pool, lens, block_table=meta(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="4-d"):
        flashcore.decode(meta(2, 8, 64), k, k, lens)
    with pytest.raises(TypeError):
        flashcore.decode(q, k, None, lens)
    for s in (0.0, -1.0, math.nan, math.inf, 1e-46, 1e39):
        with pytest.raises(ValueError, match="scale"):
            flashcore.decode(q, k, k, lens, scale=s)
    cpu = torch.zeros(2, 1, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA"):
        flashcore.decode(cpu, k, k, lens)
    with pytest.raises(NotImplementedError, match="backward"):
        flashcore.decode(meta(2, 1, 8, 64).requires_grad_(), k, k, lens)
    # Host copies: on the CPU, shaped like the device metadata, lengths first.
    with pytest.raises(ValueError, match="CPU"):
        flashcore.decode(q, k, k, lens, host_seqlens=lens)
    with pytest.raises(ValueError, match="shape"):
        flashcore.decode(q, k, k, lens, host_seqlens=[1, 2, 3])
    with pytest.raises(ValueError, match="needs host_seqlens"):
        flashcore.decode(q, pool, pool, lens, block_table=table, host_block_table=[[0] * 4] * 2)
    with pytest.raises(ValueError, match="contiguous cache"):
        flashcore.decode(q, k, k, lens, host_seqlens=[1, 2], host_block_table=[[0] * 4] * 2)
    with pytest.raises(ValueError, match="shape"):
        flashcore.decode(q, pool, pool, lens, block_table=table, host_seqlens=[1, 2], host_block_table=[[0] * 3] * 2)
    # Values past int32 are refused, not wrapped into valid-looking entries.
    with pytest.raises(ValueError, match="outside int32"):
        flashcore.decode(q, k, k, lens, host_seqlens=torch.tensor([1, 2**32 + 3]))
    with pytest.raises(ValueError, match="outside int32"):
        flashcore.decode(q, pool, pool, lens, block_table=table, host_seqlens=[1, 2],
                         host_block_table=[[0, 1, 2, 2**32 + 3]] * 2)
    with pytest.raises(ValueError, match="integers"):
        flashcore.decode(q, k, k, lens, host_seqlens=torch.tensor([1.0, 2.0]))
    # Given correctly they are accepted (and read only by the real call).
    o = flashcore.decode(q, pool, pool, lens, block_table=table, host_seqlens=[1, 2], host_block_table=[[0] * 4] * 2)
    assert o.shape == q.shape

    with pytest.raises(ValueError, match="seqlens"):
        flashcore.append_kv(k, k, i32(3), meta(2, 1, 8, 64), meta(2, 1, 8, 64))
    with pytest.raises(ValueError, match="CUDA"):
        flashcore.append_kv(k, k, lens, cpu, cpu)

    parts, lse_parts = meta(3, 2, 7, 8, 64), meta(3, 2, 8, 7, dtype=torch.float32)
    with pytest.raises(ValueError, match="expected"):
        flashcore.merge(parts, meta(3, 2, 7, 8, dtype=torch.float32))
    with pytest.raises(ValueError, match="float32"):
        flashcore.merge(parts, lse_parts.half())
    with pytest.raises(ValueError, match="out_dtype"):
        flashcore.merge(parts, lse_parts, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="layout"):
        flashcore.merge(parts, lse_parts, layout="sbhd")
    with pytest.raises(ValueError, match="5-d"):
        flashcore.merge(parts[0], lse_parts)


def test_serving_calls_compile_to_one_graph():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    def step(q, k_new, v_new, k_pool, v_pool, seqlens, table):
        flashcore.append_kv(k_pool, v_pool, seqlens, k_new, v_new, block_table=table)
        o, lse = flashcore.decode(q, k_pool, v_pool, seqlens + 1, block_table=table, causal=True, return_lse=True)
        return flashcore.merge(torch.stack([o, o]), torch.stack([lse, lse])) * 2

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    pool = meta(64, 16, 8, 128)
    out = compiled(meta(2, 1, 32, 128), meta(2, 1, 8, 128), meta(2, 1, 8, 128), pool, pool.clone(), i32(2), i32(2, 32))
    assert out.shape == (2, 1, 32, 128)
    assert len(calls) == 1
    ops = [n.target for n in calls[0].graph.nodes if n.op == "call_function"]
    for op in (torch.ops.flashcore.append_kv, torch.ops.flashcore.decode, torch.ops.flashcore.merge):
        assert op in ops, ops


# ---- serving with an FP8 (e4m3) KV cache -----------------------------------------------------

E4M3 = torch.float8_e4m3fn


def fp8_cache_descs(paged, d=64):
    """cache_descs' caches holding e4m3 codes, and their scales: float32 [outer, rows, 2, 1]."""
    shape = (8, 16, 2, d) if paged else (2, 64, 2, d)
    k, v = (describe(shape, dtype=_capi.FLASHCORE_E4M3, ptr=p) for p in (1 << 40, 2 << 40))
    paging = ((3 << 40) + 4096, 4, 4) if paged else ()
    cache = _capi.describe_cache(k, v, 3 << 40, *paging)
    o, r, h = shape[0], shape[1], shape[2]
    scale = [_capi.describe(p, _capi.FLASHCORE_F32, (o, r, h, 1), (r * h, h, 1, 1)) for p in (6 << 40, 7 << 40)]
    return cache, _capi.describe_scales(*scale)


def test_c_abi_fp8_cache_checks_arrive_as_flashcore_errors():
    lib = _capi.library()
    o = describe((2, 1, 4, 64), ptr=5 << 40)
    table = _capi.int32_array(range(8))
    for paged in (False, True):
        c, s = fp8_cache_descs(paged)
        for dtype in (_capi.FLASHCORE_F16, _capi.FLASHCORE_BF16):
            q = describe((2, 1, 4, 64), dtype=dtype, ptr=4 << 40)
            qo = describe((2, 1, 4, 64), dtype=dtype, ptr=5 << 40)
            lib.check_decode(q, c, None, None, qo, 0, 0.0, True, scales=s)  # valid: no exception
            lib.check_decode(q, c, _capi.int32_array([64, 0]), table if paged else None, qo, 8 << 40, 0.5, False,
                             scales=s)
        new = describe((2, 3, 2, 64), ptr=4 << 40)
        lib.check_append_kv(c, new, describe((2, 3, 2, 64), ptr=5 << 40), None, None, scales=s)
    q = describe((2, 1, 4, 64), ptr=4 << 40)
    c, s = fp8_cache_descs(True)

    def scales_with(tensor=None, field=None, value=None, index=None):
        """Fresh scales with one field of one tensor changed (an array field: entry `index`)."""
        bad = fp8_cache_descs(True)[1]
        if tensor is not None:
            t = getattr(bad, tensor)
            if index is None:
                setattr(t, field, value)
            else:
                getattr(t, field)[index] = value
        return bad

    cases = [
        (scales_with(), None, None),
        (scales_with("k_scale", "dtype", _capi.FLASHCORE_F16), "FLASHCORE_ERROR_UNSUPPORTED_DTYPE", "k_scale"),
        (scales_with("v_scale", "shape", 8, 1), "FLASHCORE_ERROR_SHAPE_MISMATCH", "v_scale"),
        (scales_with("k_scale", "shape", 64, 3), "FLASHCORE_ERROR_SHAPE_MISMATCH", "k_scale"),
        (scales_with("k_scale", "ptr", (6 << 40) + 2), "FLASHCORE_ERROR_MISALIGNED", "k_scale"),
        (scales_with("v_scale", "ptr", 0), "FLASHCORE_ERROR_NULL_POINTER", "v_scale"),
        # Overlapping scales: a decode only reads them (an append refuses them, below).
        (scales_with("v_scale", "ptr", (6 << 40) + 4), None, None),
        (scales_with("k_scale", "strides", -1, 1), "FLASHCORE_ERROR_BAD_STRIDES", "k_scale"),
    ]
    for scales, name, words in cases:
        if name is None:
            lib.check_decode(q, c, None, None, o, 0, 0.0, False, scales=scales)
            continue
        with pytest.raises(FlashcoreError) as e:
            lib.check_decode(q, c, None, None, o, 0, 0.0, False, scales=scales)
        assert e.value.name == name, words
        assert words in e.value.message, e.value.message
        assert e.value.message.startswith("flashcore_check_decode_fp8kv: ")
    shared = scales_with("v_scale", "ptr", (6 << 40) + 4)
    with pytest.raises(FlashcoreError) as e:
        lib.check_append_kv(c, describe((2, 3, 2, 64), ptr=4 << 40), describe((2, 3, 2, 64), ptr=5 << 40), None,
                            None, scales=shared)
    assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT" and "overlaps" in e.value.message
    # An e4m3 cache without scales (either spelling), scales with a 16-bit cache.
    for call in (lambda: lib.check_decode(q, c, None, None, o, 0, 0.0, False),
                 lambda: lib.check_decode(q, cache_descs(True), None, None, o, 0, 0.0, False, scales=s)):
        with pytest.raises(FlashcoreError) as e:
            call()
        assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT" and "scales" in e.value.message
    # The append quantizes 16-bit tokens (one dtype) and may not write onto its inputs.
    new = describe((2, 3, 2, 64), ptr=4 << 40)
    e4m3 = _capi.FLASHCORE_E4M3
    for k_new, v_new, name in [
        (new, describe((2, 3, 2, 64), dtype=_capi.FLASHCORE_BF16, ptr=5 << 40), "FLASHCORE_ERROR_UNSUPPORTED_DTYPE"),
        (describe((2, 3, 2, 64), dtype=e4m3), describe((2, 3, 2, 64), dtype=e4m3, ptr=5 << 40),
         "FLASHCORE_ERROR_UNSUPPORTED_DTYPE"),
        (new, describe((2, 3, 2, 64), ptr=7 << 40), "FLASHCORE_ERROR_INVALID_ARGUMENT"),  # onto v_scale
    ]:
        with pytest.raises(FlashcoreError) as e:
            lib.check_append_kv(c, k_new, v_new, None, None, scales=s)
        assert e.value.name == name
        assert e.value.message.startswith("flashcore_check_append_kv_fp8kv: ")
    with pytest.raises(FlashcoreError) as e:
        lib.check_append_kv(c, new, describe((2, 3, 2, 64), ptr=5 << 40), _capi.int32_array([62, 0]), table, scales=s)
    assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT" and "3 new tokens" in e.value.message


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_fp8_cache_fake_shapes(paged, dtype):
    q, lens = meta(3, 4, 32, 128, dtype=dtype), i32(3)
    if paged:
        k, v, table = meta(96, 16, 8, 128, dtype=E4M3), meta(96, 16, 8, 128, dtype=E4M3), i32(3, 32)
        ks, vs = meta(96, 16, 8, dtype=torch.float32), meta(96, 16, 8, dtype=torch.float32)
    else:
        k, v, table = meta(3, 512, 8, 128, dtype=E4M3), meta(3, 512, 8, 128, dtype=E4M3), None
        ks, vs = meta(3, 512, 8, dtype=torch.float32), meta(3, 512, 8, dtype=torch.float32)
    o = flashcore.decode(q, k, v, lens, block_table=table, causal=True, k_scale=ks, v_scale=vs)
    assert o.shape == q.shape and o.dtype == dtype and o.device.type == "meta" and o.is_contiguous()
    o, lse = flashcore.decode(q, k, v, lens, block_table=table, return_lse=True, k_scale=ks, v_scale=vs)
    assert lse.shape == (3, 32, 4) and lse.dtype == torch.float32
    # [.., 1] 4-d scales, and scales sliced out of a wider tensor, are taken too.
    o = flashcore.decode(q, k, v, lens, block_table=table, k_scale=ks[..., None], v_scale=vs.unsqueeze(-1))
    wide = meta(*ks.shape[:2], 16, dtype=torch.float32)
    o = flashcore.decode(q, k, v, lens, block_table=table, k_scale=wide[:, :, :8], v_scale=wide[:, :, 8:])
    assert o.shape == q.shape
    new = meta(3, 2, 8, 128, dtype=dtype)
    assert flashcore.append_kv(k, v, lens, new, new.clone(), block_table=table, k_scale=ks, v_scale=vs) is None


@pytest.mark.parametrize(
    "q_dtype, cache_shape, scale_shape, scale_dtype, name, words",
    [
        (torch.float16, (2, 64, 8, 128), (2, 64, 8), torch.float16, "FLASHCORE_ERROR_UNSUPPORTED_DTYPE", "k_scale"),
        (torch.float16, (2, 64, 8, 128), (2, 32, 8), torch.float32, "FLASHCORE_ERROR_SHAPE_MISMATCH", "k_scale"),
        (torch.float16, (2, 64, 8, 128), (2, 64, 4), torch.float32, "FLASHCORE_ERROR_SHAPE_MISMATCH", "k_scale"),
        (torch.float16, (2, 64, 8, 96), (2, 64, 8), torch.float32, "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM", "96"),
        (E4M3, (2, 64, 8, 128), (2, 64, 8), torch.float32, "FLASHCORE_ERROR_UNSUPPORTED_DTYPE", "f16 or bf16"),
    ],
)
def test_fake_fp8_cache_decode_applies_flashcore_rules(q_dtype, cache_shape, scale_shape, scale_dtype, name, words):
    q = meta(2, 1, 16, cache_shape[3], dtype=q_dtype)
    k = meta(*cache_shape, dtype=E4M3)
    ks = meta(*scale_shape, dtype=scale_dtype)
    with pytest.raises(FlashcoreError) as e:
        flashcore.decode(q, k, k.clone(), i32(2), k_scale=ks, v_scale=ks.clone())
    assert e.value.name == name
    assert words in str(e.value)
    assert e.value.message.startswith("flashcore_check_decode_fp8kv: ")


def test_fake_fp8_cache_append_applies_flashcore_rules():
    k, lens = meta(2, 64, 8, 64, dtype=E4M3), i32(2)
    ks = meta(2, 64, 8, dtype=torch.float32)
    args = (k, k.clone(), lens)
    scales = dict(k_scale=ks, v_scale=ks.clone())
    with pytest.raises(FlashcoreError, match="UNSUPPORTED_DTYPE"):
        flashcore.append_kv(*args, meta(2, 3, 8, 64, dtype=E4M3), meta(2, 3, 8, 64, dtype=E4M3), **scales)
    with pytest.raises(FlashcoreError, match="UNSUPPORTED_DTYPE"):
        flashcore.append_kv(*args, meta(2, 3, 8, 64), meta(2, 3, 8, 64, dtype=torch.bfloat16), **scales)
    with pytest.raises(FlashcoreError, match="SHAPE_MISMATCH"):
        flashcore.append_kv(*args, meta(2, 3, 8, 64), meta(2, 3, 8, 64), k_scale=meta(2, 64, 4, dtype=torch.float32),
                            v_scale=ks)
    # Scales with a 16-bit cache.
    with pytest.raises(FlashcoreError) as e:
        flashcore.append_kv(meta(2, 64, 8, 64), meta(2, 64, 8, 64), lens, meta(2, 3, 8, 64), meta(2, 3, 8, 64),
                            **scales)
    assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT" and "e4m3" in e.value.message


def test_fp8_cache_misuse_is_refused_before_the_library():
    q, lens = meta(2, 1, 8, 64), i32(2)
    k8 = meta(2, 64, 8, 64, dtype=E4M3)
    ks = meta(2, 64, 8, dtype=torch.float32)
    new = meta(2, 1, 8, 64)
    with pytest.raises(ValueError, match="needs its scales"):
        flashcore.decode(q, k8, k8, lens)
    with pytest.raises(ValueError, match="needs its scales"):
        flashcore.append_kv(k8, k8, lens, new, new)
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        flashcore.decode(q, k8, k8, lens, k_scale=ks)
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        flashcore.append_kv(k8, k8, lens, new, new, v_scale=ks)
    with pytest.raises(ValueError, match=r"\[outer, rows, Hkv\]"):
        flashcore.decode(q, k8, k8, lens, k_scale=ks[0], v_scale=ks[0])
    with pytest.raises(ValueError, match=r"\[outer, rows, Hkv\]"):
        flashcore.decode(q, k8, k8, lens, k_scale=meta(2, 64, 8, 2, dtype=torch.float32), v_scale=ks)
    with pytest.raises(TypeError, match="k_scale"):
        flashcore.decode(q, k8, k8, lens, k_scale=[1.0], v_scale=ks)
    with pytest.raises(ValueError, match="CUDA"):
        flashcore.decode(q, k8, k8, lens, k_scale=torch.zeros(2, 64, 8), v_scale=ks)
    with pytest.raises(NotImplementedError, match="backward"):
        flashcore.decode(q, k8, k8, lens, k_scale=ks.clone().requires_grad_(), v_scale=ks)


def test_fp8_cache_serving_calls_compile_to_one_graph():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    def step(q, k_new, v_new, k_pool, v_pool, k_scale, v_scale, seqlens, table):
        flashcore.append_kv(k_pool, v_pool, seqlens, k_new, v_new, block_table=table, k_scale=k_scale,
                            v_scale=v_scale)
        o = flashcore.decode(q, k_pool, v_pool, seqlens + 1, block_table=table, causal=True, k_scale=k_scale,
                             v_scale=v_scale)
        return o * 2

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    pool, scales = meta(64, 16, 8, 128, dtype=E4M3), meta(64, 16, 8, dtype=torch.float32)
    new = meta(2, 1, 8, 128, dtype=torch.bfloat16)
    out = compiled(meta(2, 1, 32, 128, dtype=torch.bfloat16), new, new.clone(), pool, pool.clone(), scales,
                   scales.clone(), i32(2), i32(2, 32))
    assert out.shape == (2, 1, 32, 128) and out.dtype == torch.bfloat16
    assert len(calls) == 1
    ops = [n.target for n in calls[0].graph.nodes if n.op == "call_function"]
    for op in (torch.ops.flashcore.append_kv, torch.ops.flashcore.decode):
        assert op in ops, ops


def test_varlen_checks_and_fake_shapes():
    lib = _capi.library()
    q, o = describe((1, 300, 8, 64), ptr=1 << 40), describe((1, 300, 8, 64), ptr=4 << 40)
    k, v = describe((1, 500, 2, 64), ptr=2 << 40), describe((1, 500, 2, 64), ptr=3 << 40)
    good = _capi.FlashcoreVarlen(5 << 40, (5 << 40) + 64, 2, 200)
    lib.check_forward_varlen(q, k, v, o, 6 << 40, good, None, None, 0.0, True)  # valid: no exception
    lib.check_forward_varlen(q, k, v, o, 0, good, _capi.int32_array([0, 100, 300]),
                             _capi.int32_array([0, 250, 500]), 0.0, False)
    for varlen, host_q, name in [
        (_capi.FlashcoreVarlen(5 << 40, (5 << 40) + 64, 0, 200), None, "FLASHCORE_ERROR_EMPTY_DIMENSION"),
        (_capi.FlashcoreVarlen(0, (5 << 40) + 64, 2, 200), None, "FLASHCORE_ERROR_NULL_POINTER"),
        (_capi.FlashcoreVarlen(5 << 40, (5 << 40) + 2, 2, 200), None, "FLASHCORE_ERROR_MISALIGNED"),
        (good, [0, 100, 50], "FLASHCORE_ERROR_INVALID_ARGUMENT"),
        (good, [0, 250, 300], "FLASHCORE_ERROR_INVALID_ARGUMENT"),  # longer than max_seqlen_q
    ]:
        with pytest.raises(FlashcoreError) as e:
            host_k = _capi.int32_array([0, 250, 500]) if host_q else None
            lib.check_forward_varlen(q, k, v, o, 0, varlen, _capi.int32_array(host_q), host_k, 0.0, False)
        assert e.value.name == name, (varlen.batch, host_q)
    # Fake tensors: output shapes, and flashcore's rules (a head dim without kernels).
    cu = i32(3)
    o, lse = torch.ops.flashcore.attention_varlen(
        meta(300, 8, 64), meta(500, 2, 64), meta(500, 2, 64), cu, cu, 200, None, None, True, 0.0, True
    )
    assert o.shape == (300, 8, 64) and lse.shape == (8, 300) and lse.dtype == torch.float32
    with pytest.raises(FlashcoreError) as e:
        torch.ops.flashcore.attention_varlen(
            meta(300, 8, 100), meta(500, 2, 100), meta(500, 2, 100), cu, cu, 200, None, None, True, 0.0, False
        )
    assert e.value.name == "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM"
    with pytest.raises(ValueError, match="both"):
        flashcore.attention_varlen(meta(300, 8, 64), meta(500, 2, 64), meta(500, 2, 64), cu, cu, 200,
                                   host_cu_seqlens_q=[0, 1, 2])
    # Host offsets are integers within int32, never truncated or wrapped into other values.
    for bad, words in [([0, 1.9, 2], "integers"), ([0, 1, 2**32 + 2], "int32"),
                       (torch.tensor([0, 1, 2], dtype=torch.float32), "integers")]:
        with pytest.raises(ValueError, match=words):
            flashcore.attention_varlen(meta(300, 8, 64), meta(500, 2, 64), meta(500, 2, 64), cu, cu, 200,
                                       host_cu_seqlens_q=bad, host_cu_seqlens_k=[0, 1, 2])


def test_varlen_without_rows_still_follows_the_rules():
    """No key rows at all: every query row sees none (zeros, LSE -inf), as attention()
    gives for Sk = 0; no query rows: nothing runs, but the call is still checked."""
    cu = i32(3)
    o, lse = torch.ops.flashcore.attention_varlen(
        meta(10, 8, 64), meta(0, 2, 64), meta(0, 2, 64), cu, cu, 8, None, None, False, 0.0, True
    )
    assert o.shape == (10, 8, 64) and lse.shape == (8, 10)
    # The eager implementation never launches for these (CPU tensors show it).
    cpu_cu = torch.zeros(3, dtype=torch.int32)
    q = torch.randn(10, 8, 64, dtype=torch.float16)
    empty = torch.empty(0, 2, 64, dtype=torch.float16)
    o, lse = flashcore.varlen._varlen(q, empty, empty, cpu_cu, cpu_cu, 8, None, None, True, 0.0, True)
    assert torch.equal(o, torch.zeros_like(q)) and torch.all(lse == -math.inf)
    host = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="0 rows"):
        flashcore.varlen._varlen(q, empty, empty, cpu_cu, cpu_cu, 8, host, host, True, 0.0, False)
    # No query rows, and a head dim, a dtype and a head ratio flashcore has no kernel for.
    for q, k, name in [
        (meta(0, 8, 52), meta(5, 2, 52), "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM"),
        (meta(0, 8, 64, dtype=torch.float32), meta(5, 2, 64, dtype=torch.float32),
         "FLASHCORE_ERROR_UNSUPPORTED_DTYPE"),
        (meta(0, 8, 64), meta(5, 3, 64), "FLASHCORE_ERROR_HEAD_RATIO"),
    ]:
        with pytest.raises(FlashcoreError) as e:
            torch.ops.flashcore.attention_varlen(q, k, k, cu, cu, 8, None, None, False, 0.0, False)
        assert e.value.name == name
    # No heads (or no head dim) is no smaller problem but a malformed one, with rows or
    # without: refused as the library refuses it, never answered with zeros.
    for q, k in [(meta(10, 8, 64), meta(7, 0, 64)), (meta(10, 8, 64), meta(0, 0, 64)),
                 (meta(10, 0, 64), meta(7, 2, 64)), (meta(10, 8, 0), meta(7, 2, 0))]:
        with pytest.raises(FlashcoreError) as e:
            torch.ops.flashcore.attention_varlen(q, k, k, cu, cu, 8, None, None, False, 0.0, False)
        assert e.value.name == "FLASHCORE_ERROR_EMPTY_DIMENSION", (q.shape, k.shape, e.value.name)


def test_varlen_max_seqlen_and_host_copies_of_any_integer_type():
    cu = i32(3)
    args = (meta(300, 8, 64), meta(500, 2, 64), meta(500, 2, 64), cu, cu)
    # Past 2^25 (and past the C struct's int64, which would wrap it onto 200): refused.
    for bad in (2**25 + 1, 2**64 + 200):
        with pytest.raises(ValueError, match="max_seqlen_q"):
            flashcore.attention_varlen(*args, bad)
    assert flashcore.attention_varlen(*args, 2**25).shape == (300, 8, 64)
    # Host copies of any integer type, unsigned 64-bit included, are range-checked.
    wide = torch.tensor([0, 100, 300], dtype=torch.uint64)
    flashcore.attention_varlen(*args, 200, host_cu_seqlens_q=wide, host_cu_seqlens_k=[0, 250, 500])
    with pytest.raises(ValueError, match="int32"):
        flashcore.attention_varlen(*args, 200, host_cu_seqlens_q=torch.tensor([0, 1, 2**40], dtype=torch.uint64),
                                   host_cu_seqlens_k=[0, 250, 500])


# ---- a serving batch in one call: packed queries against a cache ----------------------------


def test_decode_varlen_fake_shapes_and_flashcore_rules():
    lens, cu, pool, table = i32(3), i32(4), meta(64, 16, 8, 128), i32(3, 32)
    o, lse = flashcore.decode_varlen(meta(40, 32, 128), pool, pool.clone(), lens, cu, 20, block_table=table,
                                     causal=True, return_lse=True)
    assert o.shape == (40, 32, 128) and o.dtype == torch.float16 and o.is_contiguous()
    assert lse.shape == (32, 40) and lse.dtype == torch.float32
    k8, scales = meta(3, 256, 8, 64, dtype=E4M3), meta(3, 256, 8, dtype=torch.float32)
    o = flashcore.decode_varlen(meta(9, 16, 64, dtype=torch.bfloat16), k8, k8.clone(), lens, cu, 4, k_scale=scales,
                                v_scale=scales.clone(), window_size=(127, 0), causal=True, softcap=30.0)
    assert o.shape == (9, 16, 64) and o.dtype == torch.bfloat16
    cache = meta(3, 256, 8, 64)
    for q, k, kwargs, name, words in [
        (meta(9, 12, 64), cache, {}, "FLASHCORE_ERROR_HEAD_RATIO", "12"),
        (meta(9, 8, 264), meta(3, 256, 8, 264), {}, "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM", "264"),
        (meta(9, 8, 64, dtype=torch.bfloat16), cache, {}, "FLASHCORE_ERROR_UNSUPPORTED_DTYPE", "share"),
        (meta(2**25 + 1, 8, 64), cache, {}, "FLASHCORE_ERROR_INVALID_ARGUMENT", "2^25"),
        (meta(9, 8, 64), cache, {"causal": True, "window_size": (4, 2)}, "FLASHCORE_ERROR_INVALID_ARGUMENT", "causal"),
        # No rows to compute: still checked, empty dimensions described as 1.
        (meta(0, 8, 264), meta(3, 256, 8, 264), {}, "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM", "264"),
    ]:
        with pytest.raises(FlashcoreError) as e:
            flashcore.decode_varlen(q, k, k.clone(), lens, cu, 4, **kwargs)
        assert e.value.name == name, (tuple(q.shape), kwargs)
        assert words in str(e.value)
        assert e.value.message.startswith("flashcore_check_decode_varlen: ")
    o, lse = flashcore.decode_varlen(meta(0, 8, 64), cache, cache.clone(), lens, cu, 4, return_lse=True)
    assert o.shape == (0, 8, 64) and lse.shape == (8, 0)


def test_decode_varlen_misuse_is_refused_before_the_library():
    q, k, lens, cu = meta(9, 8, 64), meta(3, 64, 8, 64), i32(3), i32(4)
    for kwargs_or_args, error, words in [
        ((q, k, k, lens, i32(3), 4), ValueError, "3 entries for a batch of 3"),
        ((q, k, k, lens, meta(4, dtype=torch.int64), 4), ValueError, "cu_seqlens_q must be torch.int32"),
        ((q, k, k, lens, i32(8)[::2], 4), ValueError, "contiguous"),
        ((q, k, k, lens, cu, 0), ValueError, "max_seqlen_q"),
        ((q, k, k, lens, cu, 2**25 + 1), ValueError, "max_seqlen_q"),
        ((q, k, k, lens, cu, 4.0), ValueError, "max_seqlen_q"),
        ((q, k, k, lens, cu, True), ValueError, "max_seqlen_q"),
        ((meta(1, 9, 8, 64), k, k, lens, cu, 4), ValueError, "3-d"),
        ((q, k, k, i32(2), cu, 4), ValueError, "batch"),
        ((q, k, k, i32(()), cu, 4), ValueError, "seqlens must be 1-d"),
        ((q, k, k, lens, [0, 1, 2, 3], 4), TypeError, "cu_seqlens_q"),
        ((q, k, k, lens, torch.zeros(4, dtype=torch.int32), 4), ValueError, "CUDA"),
    ]:
        with pytest.raises(error, match=words):
            flashcore.decode_varlen(*kwargs_or_args)
    with pytest.raises(ValueError, match="shape"):
        flashcore.decode_varlen(q, k, k, lens, cu, 4, host_cu_seqlens_q=[0, 1, 2])
    with pytest.raises(ValueError, match="int32"):
        flashcore.decode_varlen(q, k, k, lens, cu, 4, host_cu_seqlens_q=[0, 1, 2, 2**32 + 3])
    with pytest.raises(ValueError, match="host_block_table needs host_seqlens"):
        flashcore.decode_varlen(q, meta(8, 16, 8, 64), meta(8, 16, 8, 64), lens, cu, 4, block_table=i32(3, 2),
                                host_block_table=[[0, 1], [2, 3], [4, 5]])
    with pytest.raises(ValueError, match="need host_block_table too"):
        flashcore.decode_varlen(q, meta(8, 16, 8, 64), meta(8, 16, 8, 64), lens, cu, 4, block_table=i32(3, 2),
                                host_seqlens=[1, 2, 3])
    with pytest.raises(NotImplementedError, match="backward"):
        flashcore.decode_varlen(q.clone().requires_grad_(), k, k, lens, cu, 4)


def test_host_copies_are_made_on_the_cpu_whatever_the_default_device():
    """The library reads host copies on the host: under torch.set_default_device("cuda")
    (common in serving code) a copy made on the default device would hand it a device
    address. Checked with the meta device, which a CPU machine has."""
    import numpy as np

    from flashcore import serving

    table = torch.zeros(2, 8, dtype=torch.int32, device="cpu")[:, :2]  # row stride 8 > 2 pages
    torch.set_default_device("meta")
    try:
        for x, shape in (([1, 2, 3], (3,)), ([], (0,)), (np.array([4, 5], dtype=np.int64), (2,))):
            t = serving._host_int32("decode", "host_seqlens", x, shape)
            assert t.device.type == "cpu" and t.dtype == torch.int32 and tuple(t.shape) == shape
        lens, padded = serving._prepare_host("decode", 2, table, [1, 2], [[0, 1], [2, 3]])
        assert lens.device.type == padded.device.type == "cpu"
        assert padded.tolist() == [[0, 1, 0, 0, 0, 0, 0, 0], [2, 3, 0, 0, 0, 0, 0, 0]]
    finally:
        torch.set_default_device(None)


def test_errors_cross_process_boundaries_as_flashcore_errors():
    """Process pools send a worker's exception back pickled: it must come back whole."""
    import pickle

    e = FlashcoreError(5, "FLASHCORE_ERROR_BAD_STRIDES", "q: a stride")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is FlashcoreError
    assert (back.code, back.name, back.message, str(back)) == (e.code, e.name, e.message, str(e))


def test_decode_varlen_host_offsets_are_checked_by_the_library():
    lib = _capi.library()
    q, o = describe((1, 40, 8, 64)), describe((1, 40, 8, 64), ptr=4 << 40)
    cache = _capi.describe_cache(describe((3, 256, 2, 64), ptr=2 << 40), describe((3, 256, 2, 64), ptr=3 << 40),
                                 5 << 40)
    cu = 6 << 40

    def check(host, max_seqlen_q=20, batch=3, cu_ptr=cu):
        lib.check_decode_varlen(q, cache, None, cu_ptr, batch, max_seqlen_q, _capi.int32_array(host), None, None, o,
                                0, 0.0, True)

    check([0, 1, 21, 40])  # valid: no exception
    check(None)
    for host, kwargs, name in [
        ([0, 1, 30, 40], {}, "FLASHCORE_ERROR_INVALID_ARGUMENT"),  # a run longer than max_seqlen_q
        ([0, 10, 5, 40], {}, "FLASHCORE_ERROR_INVALID_ARGUMENT"),  # decreasing
        ([0, 1, 21, 41], {}, "FLASHCORE_ERROR_INVALID_ARGUMENT"),  # past q's rows
        ([-1, 1, 21, 40], {}, "FLASHCORE_ERROR_INVALID_ARGUMENT"),
        (None, {"batch": 0}, "FLASHCORE_ERROR_EMPTY_DIMENSION"),
        (None, {"batch": 2}, "FLASHCORE_ERROR_SHAPE_MISMATCH"),  # the cache holds 3 sequences
        (None, {"cu_ptr": 0}, "FLASHCORE_ERROR_NULL_POINTER"),
        (None, {"cu_ptr": cu + 2}, "FLASHCORE_ERROR_MISALIGNED"),
        (None, {"max_seqlen_q": 0}, "FLASHCORE_ERROR_INVALID_ARGUMENT"),
    ]:
        with pytest.raises(FlashcoreError) as e:
            check(host, **kwargs)
        assert e.value.name == name, (host, kwargs)
    # The eager implementation launches nothing for an empty q, and still checks the host
    # offsets against its rows (CPU tensors show it: no launch could take them).
    empty, k = torch.empty(0, 8, 64, dtype=torch.float16), torch.empty(3, 64, 8, 64, dtype=torch.float16)
    lens = torch.zeros(3, dtype=torch.int32)
    o, lse = flashcore.varlen._decode_varlen(empty, k, k, lens, torch.zeros(4, dtype=torch.int32), 4, None, None, None,
                                             None, True, 0.0, True)
    assert o.shape == (0, 8, 64) and lse.shape == (8, 0)
    with pytest.raises(ValueError, match="0 rows"):
        flashcore.varlen._decode_varlen(empty, k, k, lens, torch.zeros(4, dtype=torch.int32), 4, None, None, None,
                                        torch.tensor([0, 1, 1, 1], dtype=torch.int32), True, 0.0, False)


def test_decode_varlen_compiles_to_one_graph():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    def step(q, k_new, v_new, k_pool, v_pool, seqlens, cu, table):
        flashcore.append_kv(k_pool, v_pool, seqlens, k_new, v_new, block_table=table)
        return flashcore.decode_varlen(q, k_pool, v_pool, seqlens + 1, cu, 16, block_table=table, causal=True) * 2

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    pool, new = meta(64, 16, 8, 128), meta(2, 1, 8, 128)
    out = compiled(meta(17, 32, 128), new, new.clone(), pool, pool.clone(), i32(2), i32(3), i32(2, 32))
    assert out.shape == (17, 32, 128)
    assert len(calls) == 1
    ops = [n.target for n in calls[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.flashcore.decode_varlen in ops, ops


# ---- key windows: sliding-window (local) attention ------------------------------------------------

# The C calls that take a key window, by the call they are with one.
WINDOW_SPELLINGS = {
    "flashcore_forward_window": "flashcore_forward",
    "flashcore_check_forward_window": "flashcore_check_forward",
    "flashcore_forward_varlen_window": "flashcore_forward_varlen",
    "flashcore_check_forward_varlen_window": "flashcore_check_forward_varlen",
    "flashcore_decode_window": "flashcore_decode",
    "flashcore_check_decode_window": "flashcore_check_decode",
    "flashcore_decode_fp8kv_window": "flashcore_decode_fp8kv",
    "flashcore_check_decode_fp8kv_window": "flashcore_check_decode_fp8kv",
}


def test_window_spellings_are_their_calls_with_two_int64s_after_causal():
    lib = _capi.library()
    for name, plain in WINDOW_SPELLINGS.items():
        ret, args = _capi.SIGNATURES[name]
        plain_ret, plain_args = _capi.SIGNATURES[plain]
        causal = plain_args.index(ctypes.c_float) + 1  # softmax_scale, then causal
        assert plain_args[causal] is ctypes.c_int32, plain
        assert ret is plain_ret and args == [*plain_args[: causal + 1], ctypes.c_int64, ctypes.c_int64,
                                             *plain_args[causal + 1 :]], name
        assert getattr(lib.lib, name).argtypes == args  # exported and typed
    # The FP8 forward has no window spelling: its kernels have no window.
    assert not [n for n in _capi.SIGNATURES if "fp8_window" in n or n.startswith("flashcore_forward_fp8_")]


def test_c_abi_window_checks_arrive_as_flashcore_errors():
    lib = _capi.library()
    q, o = describe((1, 64, 4, 128)), describe((1, 64, 4, 128), ptr=4 << 40)
    k, v = describe((1, 80, 2, 128), ptr=2 << 40), describe((1, 80, 2, 128), ptr=3 << 40)
    varlen = _capi.FlashcoreVarlen(5 << 40, (5 << 40) + 64, 2, 40)
    cu_q, cu_k = _capi.int32_array([0, 24, 64]), _capi.int32_array([0, 30, 80])
    dq, do = describe((2, 4, 4, 64), ptr=4 << 40), describe((2, 4, 4, 64), ptr=5 << 40)
    c8, s8 = fp8_cache_descs(False)
    calls = {
        "flashcore_check_forward_window": lambda causal, w: lib.check_forward(q, k, v, o, 0, 0.0, causal, w),
        "flashcore_check_forward_varlen_window": lambda causal, w: lib.check_forward_varlen(
            q, k, v, o, 0, varlen, cu_q, cu_k, 0.0, causal, w),
        "flashcore_check_decode_window": lambda causal, w: lib.check_decode(
            dq, cache_descs(True), None, None, do, 0, 0.0, causal, window=w),
        "flashcore_check_decode_fp8kv_window": lambda causal, w: lib.check_decode(
            dq, c8, None, None, do, 0, 0.0, causal, scales=s8, window=w),
    }
    for name, call in calls.items():
        # Sliding windows (causal, left = keys - 1), one side or both, sides past every
        # sequence, and negative sides (FlashAttention's -1, or any other: unbounded).
        for causal, window in [(True, (15, 0)), (True, (0, 0)), (True, (100, -1)), (False, (-1, 5)),
                               (False, (50, 7)), (True, (-3, -9)), (False, (2**62, 2**62)),
                               (True, (-(2**63), -(2**63)))]:
            call(causal, window)  # valid: no exception
        # Causal masking sees no key past the diagonal: causal with a right side > 0.
        for right in (1, 7, 2**63 - 1):
            with pytest.raises(FlashcoreError) as e:
                call(True, (15, right))
            assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT", name
            assert e.value.message.startswith(name + ": ") and "right side" in e.value.message
    # The other rules under a window, reported under the window spelling's name.
    with pytest.raises(FlashcoreError) as e:
        lib.check_forward(q, k, v, describe((1, 64, 4, 48), ptr=4 << 40), 0, 0.0, True, (15, 0))
    assert e.value.name == "FLASHCORE_ERROR_SHAPE_MISMATCH"
    assert e.value.message.startswith("flashcore_check_forward_window: ")
    with pytest.raises(FlashcoreError) as e:
        lib.check_decode(dq, cache_descs(True), _capi.int32_array([65, 0]), _capi.int32_array(range(8)), do, 0, 0.0,
                         True, window=(15, 0))
    assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT" and "capacity" in e.value.message
    # Without a window (NO_WINDOW) the plain calls run, under their own names.
    with pytest.raises(FlashcoreError) as e:
        lib.check_forward(q, k, v, o, (5 << 40) + 2, 0.0, True, _capi.NO_WINDOW)
    assert e.value.message.startswith("flashcore_check_forward: ")


def test_windows_reach_the_library_through_every_op(monkeypatch):
    """window_size reaches the C checks of the ops' fake implementations as given (the
    real calls take the same path): the windows the library refuses (causal with keys
    past the diagonal) come back as its FlashcoreError, from each op."""
    lib = _capi.library()
    seen = []
    for method in ("check_forward", "check_forward_varlen", "check_decode"):
        real = getattr(lib, method)

        def record(*args, _real=real, **kwargs):
            seen.append(kwargs.get("window", args[-1] if len(args) in (8, 11) else _capi.NO_WINDOW))
            return _real(*args, **kwargs)

        monkeypatch.setattr(lib, method, record)
    q, k = meta(2, 8, 77, 128), meta(2, 2, 300, 128)
    cu = i32(3)
    dq, cache, lens = meta(2, 3, 8, 64), meta(2, 64, 2, 64), i32(2)
    k8, scales = meta(2, 64, 2, 64, dtype=E4M3), meta(2, 64, 2, dtype=torch.float32)
    ops = {
        "attention": lambda causal, w: flashcore.attention(q, k, k, causal=causal, window_size=w),
        "attention_varlen": lambda causal, w: flashcore.attention_varlen(
            meta(300, 8, 64), meta(500, 2, 64), meta(500, 2, 64), cu, cu, 200, causal=causal, window_size=w),
        "decode": lambda causal, w: flashcore.decode(dq, cache, cache, lens, causal=causal, window_size=w),
        "decode fp8": lambda causal, w: flashcore.decode(dq, k8, k8, lens, causal=causal, window_size=w,
                                                         k_scale=scales, v_scale=scales),
    }
    for label, op in ops.items():
        seen.clear()
        for causal, window in [(True, (15, 0)), (False, (50, 7)), (False, [-1, 5]), (True, (-7, -3))]:
            op(causal, window)
        assert seen == [(15, 0), (50, 7), (-1, 5), (-7, -3)], label
        with pytest.raises(FlashcoreError) as e:
            op(True, (15, 1))
        assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT", label
        assert "_window: " in e.value.message and "right side" in e.value.message, label
        seen.clear()
        op(True, (-1, -1))
        assert seen == [(-1, -1)], label
    # Through the registered ops directly: the two ints at the end of each schema.
    o, _ = torch.ops.flashcore.attention(q, k, k, True, 0.0, "bhsd", "bhsd", False, 15, 0)
    assert o.shape == q.shape
    with pytest.raises(FlashcoreError, match="right side"):
        torch.ops.flashcore.attention(q, k, k, True, 0.0, "bhsd", "bhsd", False, 15, 1)
    with pytest.raises(FlashcoreError, match="right side"):
        torch.ops.flashcore.attention_varlen(meta(300, 8, 64), meta(500, 2, 64), meta(500, 2, 64), cu, cu, 200, None,
                                             None, True, 0.0, False, 15, 1)
    with pytest.raises(FlashcoreError, match="right side"):
        torch.ops.flashcore.decode(dq, cache, cache, lens, None, None, None, True, 0.0, False, None, None, 15, 1)


def test_window_size_misuse_is_refused_before_the_library():
    q, k = meta(1, 4, 64, 64), meta(1, 4, 80, 64)
    cu = i32(3)
    calls = [
        lambda w: flashcore.attention(q, k, k, window_size=w),
        lambda w: flashcore.attention_varlen(meta(30, 4, 64), meta(50, 4, 64), meta(50, 4, 64), cu, cu, 20,
                                             window_size=w),
        lambda w: flashcore.decode(meta(2, 1, 8, 64), meta(2, 64, 8, 64), meta(2, 64, 8, 64), i32(2), window_size=w),
    ]
    for call in calls:
        for bad in ("ab", (1,), (1, 2, 3), (1.5, 0), (0, 2.0), (True, 0), None, 5):
            with pytest.raises(TypeError, match="window_size"):
                call(bad)
        # Past int64 a side would wrap into another, valid-looking window.
        for bad in ((2**63, 0), (0, -(2**63) - 1)):
            with pytest.raises(ValueError, match="window_size"):
                call(bad)
        call((2**63 - 1, -(2**63)))  # the int64 extremes are windows (unbounded ones)
        call((torch.tensor(3), 0))  # integers of other types


def test_windows_compile_to_one_graph():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    def step(q, k, v, cu, dq, cache, lens):
        o = flashcore.attention(q, k, v, causal=True, layout="bshd", window_size=(15, 0))
        packed = flashcore.attention_varlen(q[0], k[0], v[0], cu, cu, 64, causal=True, window_size=(15, 0))
        d = flashcore.decode(dq, cache, cache, lens, causal=True, window_size=(15, 0))
        return o * 2, packed, d

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    q, k = meta(2, 64, 8, 64), meta(2, 64, 2, 64)
    o, packed, d = compiled(q, k, k, i32(3), meta(2, 4, 8, 64), meta(2, 128, 2, 64), i32(2))
    assert o.shape == q.shape and packed.shape == (64, 8, 64) and d.shape == (2, 4, 8, 64)
    assert len(calls) == 1
    nodes = [n for n in calls[0].graph.nodes if n.op == "call_function"]
    for op in (torch.ops.flashcore.attention, torch.ops.flashcore.attention_varlen, torch.ops.flashcore.decode):
        node = next(n for n in nodes if n.target in (op, op.default))
        assert tuple(node.args[-3:]) == (15, 0, 0.0), node.args  # window_left, window_right, softcap


def test_dynamic_shapes_compile_once():
    """Under torch.compile's dynamic shapes, a bound that changes every step and a view
    whose strides follow a dynamic length are symbolic: the fake checks leave them to the
    real call instead of reading them (which specialized the graph on each value and
    recompiled for every new one)."""
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    def step(x, k, cu, bound):
        q = x[:, -1:]  # strides follow x's length
        o = flashcore.attention(q, k, k, layout="bshd")
        packed = flashcore.attention_varlen(x[0], k[0], k[0], cu, cu, bound, causal=True)
        d = flashcore.decode_varlen(x[0], k, k, cu[1:], cu, bound)
        return o, packed, d

    compiled = torch.compile(step, backend=backend, dynamic=True, fullgraph=True)
    for s, bound in ((72, 20), (96, 21), (128, 33), (80, 7)):  # (72: not D, which duck sizing would tie)
        o, packed, d = compiled(meta(2, s, 8, 64), meta(2, s, 8, 64), i32(3), bound)
        assert o.shape == (2, 1, 8, 64) and packed.shape == d.shape == (s, 8, 64)
    assert len(calls) == 1


# ---- logit soft-capping: the _ex spellings ---------------------------------------------------------

# The C calls that take their options as one FlashcoreAttentionOptions, by the call they are
# with it in place of (softmax_scale, causal).
EX_SPELLINGS = {
    "flashcore_forward_ex": "flashcore_forward",
    "flashcore_check_forward_ex": "flashcore_check_forward",
    "flashcore_forward_varlen_ex": "flashcore_forward_varlen",
    "flashcore_check_forward_varlen_ex": "flashcore_check_forward_varlen",
    "flashcore_decode_ex": "flashcore_decode",
    "flashcore_check_decode_ex": "flashcore_check_decode",
    "flashcore_decode_fp8kv_ex": "flashcore_decode_fp8kv",
    "flashcore_check_decode_fp8kv_ex": "flashcore_check_decode_fp8kv",
}


def test_ex_spellings_are_their_calls_with_the_options_in_place_of_scale_and_causal():
    lib = _capi.library()
    opts = ctypes.POINTER(_capi.FlashcoreAttentionOptions)
    for name, plain in EX_SPELLINGS.items():
        ret, args = _capi.SIGNATURES[name]
        plain_ret, plain_args = _capi.SIGNATURES[plain]
        scale = plain_args.index(ctypes.c_float)  # softmax_scale, then causal
        assert plain_args[scale + 1] is ctypes.c_int32, plain
        assert ret is plain_ret and args == [*plain_args[:scale], opts, *plain_args[scale + 2 :]], name
        assert getattr(lib.lib, name).argtypes == args  # exported and typed
    # The FP8 forward has no _ex spelling: its kernels have no cap.
    assert not [n for n in _capi.SIGNATURES if n.startswith("flashcore_forward_fp8") and n.endswith("_ex")]
    # The C layout: 32 bytes, no padding, struct_size first.
    o = _capi.FlashcoreAttentionOptions
    fields = ("struct_size", "softmax_scale", "window_left", "window_right", "causal", "softcap")
    assert ctypes.sizeof(o) == 32 and ctypes.alignment(o) == 8
    assert [getattr(o, f).offset for f in fields] == [0, 4, 8, 16, 24, 28]
    # A new one is FLASHCORE_ATTENTION_OPTIONS_INIT: its size, then no options.
    assert tuple(getattr(o(), f) for f in fields) == (32, 0.0, -1, -1, 0, 0.0)
    assert o(causal=1).window_left == -1 and o(causal=1).causal == 1
    built = _capi.attention_options(0.125, True, (15, 0), 50.0)
    assert tuple(getattr(built, f) for f in fields) == (32, 0.125, 15, 0, 1, 50.0)
    plain = _capi.attention_options(0.0, False)
    assert tuple(getattr(plain, f) for f in fields) == tuple(getattr(o(), f) for f in fields)


def test_c_abi_refuses_options_of_another_size():
    """struct_size below 32 or not a multiple of 8 (not from FLASHCORE_ATTENTION_OPTIONS_INIT),
    or above the library's own size (a newer header's), is FLASHCORE_ERROR_INVALID_ARGUMENT."""
    lib = _capi.library()
    q, o = describe((1, 64, 4, 128)), describe((1, 64, 4, 128), ptr=4 << 40)
    k, v = describe((1, 80, 2, 128), ptr=2 << 40), describe((1, 80, 2, 128), ptr=3 << 40)
    tensors = [ctypes.byref(t) for t in (q, k, v, o)]
    opts = _capi.attention_options(0.0, True, softcap=50.0)
    assert lib.lib.flashcore_check_forward_ex(*tensors, 0, ctypes.byref(opts)) == _capi.FLASHCORE_SUCCESS
    for size, why in [(0, "FLASHCORE_ATTENTION_OPTIONS_INIT"), (24, "FLASHCORE_ATTENTION_OPTIONS_INIT"),
                      (36, "FLASHCORE_ATTENTION_OPTIONS_INIT"), (40, "newer flashcore header"),
                      (2**32 - 8, "newer flashcore header")]:
        opts.struct_size = size
        rc = lib.lib.flashcore_check_forward_ex(*tensors, 0, ctypes.byref(opts))
        assert lib.error_name(rc) == "FLASHCORE_ERROR_INVALID_ARGUMENT", size
        message = lib.lib.flashcore_last_error().decode()
        assert message.startswith("flashcore_check_forward_ex: ") and why in message, message


def test_c_abi_softcap_checks_arrive_as_flashcore_errors():
    lib = _capi.library()
    q, o = describe((1, 64, 4, 128)), describe((1, 64, 4, 128), ptr=4 << 40)
    k, v = describe((1, 80, 2, 128), ptr=2 << 40), describe((1, 80, 2, 128), ptr=3 << 40)
    varlen = _capi.FlashcoreVarlen(5 << 40, (5 << 40) + 64, 2, 40)
    cu_q, cu_k = _capi.int32_array([0, 24, 64]), _capi.int32_array([0, 30, 80])
    dq, do = describe((2, 4, 4, 64), ptr=4 << 40), describe((2, 4, 4, 64), ptr=5 << 40)
    c8, s8 = fp8_cache_descs(False)
    calls = {
        "flashcore_check_forward": lambda causal, w, cap: lib.check_forward(q, k, v, o, 0, 0.0, causal, w, cap),
        "flashcore_check_forward_varlen": lambda causal, w, cap: lib.check_forward_varlen(
            q, k, v, o, 0, varlen, cu_q, cu_k, 0.0, causal, w, softcap=cap),
        "flashcore_check_decode": lambda causal, w, cap: lib.check_decode(
            dq, cache_descs(True), None, None, do, 0, 0.0, causal, window=w, softcap=cap),
        "flashcore_check_decode_fp8kv": lambda causal, w, cap: lib.check_decode(
            dq, c8, None, None, do, 0, 0.0, causal, scales=s8, window=w, softcap=cap),
    }
    for name, call in calls.items():
        # Gemma 2's cap on full and sliding-window layers, Grok's, small and large ones.
        for cap in (50.0, 30.0, 5.0, 0.5, 1e4):
            for causal, window in [(True, (-1, -1)), (True, (15, 0)), (False, (-1, -1)), (False, (50, 7))]:
                call(causal, window, cap)  # valid: no exception
        # A cap must be finite and positive (0 is none): the _ex spelling says so.
        for cap in (-1.0, -50.0, math.nan, math.inf, -math.inf, 1e39):
            with pytest.raises(FlashcoreError) as e:
                call(True, (-1, -1), cap)
            assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT", (name, cap)
            assert e.value.message.startswith(name + "_ex: ") and "softcap" in e.value.message, e.value.message
        # The window's rule under a cap, reported under the _ex name.
        with pytest.raises(FlashcoreError) as e:
            call(True, (15, 1), 50.0)
        assert e.value.message.startswith(name + "_ex: ") and "right side" in e.value.message
        # No cap (0.0, of either sign): the plain or _window spelling, as before.
        for zero in (0.0, -0.0):
            with pytest.raises(FlashcoreError) as e:
                call(True, (15, 1), zero)
            assert e.value.message.startswith(name + "_window: ")
    # The other rules under a cap: a bad shape, host metadata.
    with pytest.raises(FlashcoreError) as e:
        lib.check_forward(q, k, v, describe((1, 64, 4, 48), ptr=4 << 40), 0, 0.0, True, softcap=50.0)
    assert e.value.name == "FLASHCORE_ERROR_SHAPE_MISMATCH"
    assert e.value.message.startswith("flashcore_check_forward_ex: ")
    with pytest.raises(FlashcoreError) as e:
        lib.check_decode(dq, cache_descs(True), _capi.int32_array([65, 0]), _capi.int32_array(range(8)), do, 0, 0.0,
                         True, softcap=50.0)
    assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT" and "capacity" in e.value.message


def test_softcaps_reach_the_library_through_every_op(monkeypatch):
    """softcap reaches the C checks of the ops' fake implementations as a float (the real
    calls take the same path): 0.0 and None as no cap, the caps the library refuses
    (negative, NaN, infinite) as its FlashcoreError from each op."""
    lib = _capi.library()
    seen = []
    for method in ("check_forward", "check_forward_varlen", "check_decode"):
        real = getattr(lib, method)

        def record(*args, _real=real, **kwargs):
            seen.append(kwargs.get("softcap", _capi.NO_SOFTCAP))
            return _real(*args, **kwargs)

        monkeypatch.setattr(lib, method, record)
    q, k = meta(2, 8, 77, 128), meta(2, 2, 300, 128)
    cu = i32(3)
    dq, cache, lens = meta(2, 3, 8, 64), meta(2, 64, 2, 64), i32(2)
    k8, scales = meta(2, 64, 2, 64, dtype=E4M3), meta(2, 64, 2, dtype=torch.float32)
    ops = {
        "attention": lambda causal, w, cap: flashcore.attention(q, k, k, causal=causal, window_size=w, softcap=cap),
        "attention_varlen": lambda causal, w, cap: flashcore.attention_varlen(
            meta(300, 8, 64), meta(500, 2, 64), meta(500, 2, 64), cu, cu, 200, causal=causal, window_size=w,
            softcap=cap),
        "decode": lambda causal, w, cap: flashcore.decode(dq, cache, cache, lens, causal=causal, window_size=w,
                                                          softcap=cap),
        "decode fp8": lambda causal, w, cap: flashcore.decode(dq, k8, k8, lens, causal=causal, window_size=w,
                                                              softcap=cap, k_scale=scales, v_scale=scales),
    }
    for label, op in ops.items():
        seen.clear()
        for causal, window, cap in [(True, (-1, -1), 50.0), (True, (15, 0), 50), (False, (50, 7), 30.0),
                                    (False, (-1, -1), 5.0), (True, (-1, -1), None), (True, (-1, -1), 0),
                                    (True, (-1, -1), torch.tensor(2.5))]:
            op(causal, window, cap)
        assert seen == [50.0, 50.0, 30.0, 5.0, 0.0, 0.0, 2.5], label
        assert all(type(x) is float for x in seen), label
        for cap in (-1.0, math.nan, math.inf):
            with pytest.raises(FlashcoreError) as e:
                op(True, (-1, -1), cap)
            assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT", label
            assert "_ex: " in e.value.message and "softcap" in e.value.message, label
    # Through the registered ops directly: the float after the window in each schema.
    o, _ = torch.ops.flashcore.attention(q, k, k, True, 0.0, "bhsd", "bhsd", False, 15, 0, 50.0)
    assert o.shape == q.shape
    with pytest.raises(FlashcoreError, match="softcap"):
        torch.ops.flashcore.attention(q, k, k, True, 0.0, "bhsd", "bhsd", False, -1, -1, -50.0)
    with pytest.raises(FlashcoreError, match="softcap"):
        torch.ops.flashcore.attention_varlen(meta(300, 8, 64), meta(500, 2, 64), meta(500, 2, 64), cu, cu, 200, None,
                                             None, True, 0.0, False, -1, -1, -50.0)
    with pytest.raises(FlashcoreError, match="softcap"):
        torch.ops.flashcore.decode(dq, cache, cache, lens, None, None, None, True, 0.0, False, None, None, -1, -1,
                                   -50.0)


def test_softcap_misuse_is_refused_before_the_library():
    q, k = meta(1, 4, 64, 64), meta(1, 4, 80, 64)
    cu = i32(3)
    calls = [
        lambda c: flashcore.attention(q, k, k, softcap=c),
        lambda c: flashcore.attention_varlen(meta(30, 4, 64), meta(50, 4, 64), meta(50, 4, 64), cu, cu, 20,
                                             softcap=c),
        lambda c: flashcore.decode(meta(2, 1, 8, 64), meta(2, 64, 8, 64), meta(2, 64, 8, 64), i32(2), softcap=c),
    ]
    for call in calls:
        for bad in ("50", b"50", True, [50.0], (50.0,), object()):
            with pytest.raises(TypeError, match="softcap"):
                call(bad)
        # A cap float32 rounds to 0 would reach the library as "no cap".
        for bad in (1e-50, -1e-46):
            with pytest.raises(ValueError, match="softcap"):
                call(bad)
        for good in (50.0, 30, 1e-3, torch.tensor(5.0), None, 0, -0.0):
            call(good)


def test_softcaps_compile_to_one_graph():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    def step(q, k, v, cu, dq, cache, lens):
        o = flashcore.attention(q, k, v, causal=True, layout="bshd", window_size=(15, 0), softcap=50.0)
        packed = flashcore.attention_varlen(q[0], k[0], v[0], cu, cu, 64, causal=True, softcap=30.0)
        d = flashcore.decode(dq, cache, cache, lens, causal=True, softcap=5.0)
        return o * 2, packed, d

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    q, k = meta(2, 64, 8, 64), meta(2, 64, 2, 64)
    o, packed, d = compiled(q, k, k, i32(3), meta(2, 4, 8, 64), meta(2, 128, 2, 64), i32(2))
    assert o.shape == q.shape and packed.shape == (64, 8, 64) and d.shape == (2, 4, 8, 64)
    assert len(calls) == 1
    nodes = [n for n in calls[0].graph.nodes if n.op == "call_function"]
    want = {torch.ops.flashcore.attention: (15, 0, 50.0), torch.ops.flashcore.attention_varlen: (-1, -1, 30.0),
            torch.ops.flashcore.decode: (-1, -1, 5.0)}
    for op, args in want.items():
        node = next(n for n in nodes if n.target in (op, op.default))
        assert tuple(node.args[-3:]) == args, node.args


# ---- FP8: attention_fp8, quantize_fp8, forward_fp8 ----------------------------------------------


def fp8_operands(b, sq, hq, sk, hkv, d, smooth_k=False, base=8 << 40):
    """FlashcoreFp8Operands of contiguous operands at stand-in addresses, as the quantizer
    lays them out (pitch = Sk rounded up to 16; regions 256-byte aligned)."""
    pitch = -(-sk // 16) * 16
    ops = _capi.FlashcoreFp8Operands()
    ops.q = _capi.describe(base, _capi.FLASHCORE_E4M3, (b, sq, hq, d), (sq * hq * d, hq * d, d, 1))
    ops.k = _capi.describe(base + (1 << 32), _capi.FLASHCORE_E4M3, (b, sk, hkv, d), (sk * hkv * d, hkv * d, d, 1))
    ops.vt = base + (2 << 32)
    for i, n in enumerate((b, hkv, d, sk)):
        ops.vt_shape[i] = n
    for i, n in enumerate((hkv * d * pitch, d * pitch, pitch)):
        ops.vt_strides[i] = n
    ops.q_scale, ops.k_scale, ops.v_scale = base + (3 << 32), base + (4 << 32), base + (5 << 32)
    ops.lse_shift = base + (6 << 32) if smooth_k else 0
    return ops


def test_c_abi_fp8_checks_arrive_as_flashcore_errors():
    lib = _capi.library()
    q = describe((2, 300, 8, 128))
    k = describe((2, 1001, 2, 128), ptr=2 << 40)
    v = describe((2, 1001, 2, 128), ptr=3 << 40)
    plain = _capi.quantize_options()
    need = lib.fp8_workspace_bytes(q, k, v, plain)
    assert need == lib.fp8_workspace_bytes(q, k, v, None)
    assert lib.fp8_workspace_bytes(q, k, v, _capi.quantize_options(smooth_k=True)) > need
    assert lib.fp8_workspace_bytes(q, k, v, _capi.quantize_options(hadamard_seed=2**64 - 1)) == need
    lib.check_quantize_fp8(q, k, v, plain, 5 << 40, need)  # valid: no exception
    lib.check_quantize_fp8(q, k, v, plain, (5 << 40) + 1, need)  # any start: the size has room
    for ws, size, name, words in [
        (0, need, "FLASHCORE_ERROR_NULL_POINTER", "workspace"),
        ((5 << 40) + 1, need - 1, "FLASHCORE_ERROR_INVALID_ARGUMENT", "needs"),
        ((2 << 40) + 4096, need, "FLASHCORE_ERROR_INVALID_ARGUMENT", "overlaps k"),
    ]:
        with pytest.raises(FlashcoreError) as e:
            lib.check_quantize_fp8(q, k, v, plain, ws, size)
        assert e.value.name == name and words in e.value.message, e.value.message
        assert e.value.message.startswith("flashcore_check_quantize_fp8: ")
    with pytest.raises(FlashcoreError) as e:
        lib.fp8_workspace_bytes(describe((2, 300, 8, 96)), describe((2, 1001, 2, 96), ptr=2 << 40),
                                describe((2, 1001, 2, 96), ptr=3 << 40), None)
    assert e.value.name == "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM" and "64, 128, 256" in e.value.message
    e4m3 = describe((2, 1001, 2, 128), dtype=_capi.FLASHCORE_E4M3, ptr=3 << 40)
    with pytest.raises(FlashcoreError) as e:
        lib.fp8_workspace_bytes(q, k, e4m3, None)
    assert e.value.name == "FLASHCORE_ERROR_UNSUPPORTED_DTYPE"

    o = describe((2, 300, 8, 128), dtype=_capi.FLASHCORE_BF16, ptr=1 << 40)
    for smooth_k in (False, True):
        lib.check_forward_fp8(fp8_operands(2, 300, 8, 1001, 2, 128, smooth_k), o, 7 << 40, 0.0, True)
    ops = fp8_operands(2, 300, 8, 1001, 2, 128, smooth_k=True)
    cases = [
        (lambda ops, o: setattr(ops.q, "dtype", _capi.FLASHCORE_F16), "FLASHCORE_ERROR_UNSUPPORTED_DTYPE", "e4m3"),
        (lambda ops, o: setattr(o, "dtype", _capi.FLASHCORE_E4M3), "FLASHCORE_ERROR_UNSUPPORTED_DTYPE", "f16 or bf16"),
        (lambda ops, o: ops.vt_shape.__setitem__(3, 1000), "FLASHCORE_ERROR_SHAPE_MISMATCH", "vt"),
        (lambda ops, o: ops.vt_strides.__setitem__(2, 1000), "FLASHCORE_ERROR_BAD_STRIDES", "pitch"),
        (lambda ops, o: setattr(ops, "k_scale", 0), "FLASHCORE_ERROR_NULL_POINTER", "k_scale"),
        (lambda ops, o: setattr(ops, "lse_shift", ops.lse_shift + 2), "FLASHCORE_ERROR_MISALIGNED", "lse_shift"),
        (lambda ops, o: setattr(o, "ptr", ops.v_scale), "FLASHCORE_ERROR_INVALID_ARGUMENT", "overlaps"),
    ]
    for change, name, words in cases:
        bad_ops, bad_o = fp8_operands(2, 300, 8, 1001, 2, 128, smooth_k=True), describe(
            (2, 300, 8, 128), dtype=_capi.FLASHCORE_BF16, ptr=1 << 40
        )
        change(bad_ops, bad_o)
        with pytest.raises(FlashcoreError) as e:
            lib.check_forward_fp8(bad_ops, bad_o, 0, 0.0, False)
        assert e.value.name == name and words in e.value.message, (name, e.value.message)
        assert e.value.message.startswith("flashcore_check_forward_fp8: ")
    with pytest.raises(FlashcoreError, match="INVALID_ARGUMENT"):
        lib.check_forward_fp8(ops, o, 0, math.nan, False)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_fake_shapes(layout, causal):
    def make(b, h, s, d, dtype=torch.bfloat16):
        return meta(b, h, s, d, dtype=dtype) if layout == "bhsd" else meta(b, s, h, d, dtype=dtype)

    q, k, v = make(2, 8, 77, 128), make(2, 2, 300, 128), make(2, 2, 300, 128)
    o = flashcore.attention_fp8(q, k, v, causal=causal, layout=layout)
    assert o.shape == q.shape and o.dtype == q.dtype and o.device.type == "meta" and o.is_contiguous()
    o, lse = flashcore.attention_fp8(
        q, k, v, causal=causal, layout=layout, return_lse=True, smooth_k=True, hadamard_seed=2**64 - 1, scale=0.1
    )
    assert o.shape == q.shape and lse.shape == (2, 8, 77) and lse.dtype == torch.float32
    h = make(1, 4, 64, 64, torch.float16)
    assert flashcore.attention_fp8(h, h, h, layout=layout).dtype == torch.float16


@pytest.mark.parametrize(
    "q_shape, kv_shape, dtype, kv_dtype, name, words",
    [
        ((1, 4, 64, 96), (1, 4, 64, 96), torch.float16, None, "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM", "64, 128, 256"),
        ((1, 4, 64, 32), (1, 4, 64, 32), torch.float16, None, "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM", "32"),
        ((1, 6, 64, 64), (1, 4, 64, 64), torch.float16, None, "FLASHCORE_ERROR_HEAD_RATIO", "6"),
        ((1, 4, 64, 64), (1, 4, 64, 64), torch.float32, None, "FLASHCORE_ERROR_UNSUPPORTED_DTYPE", "f16 or bf16"),
        ((1, 4, 64, 64), (1, 4, 64, 64), torch.float16, torch.bfloat16, "FLASHCORE_ERROR_UNSUPPORTED_DTYPE", "share"),
        ((1, 4, 64, 64), (2, 4, 64, 64), torch.float16, None, "FLASHCORE_ERROR_SHAPE_MISMATCH", "batch"),
        ((1, 4, (1 << 25) + 1, 64), (1, 4, 64, 64), torch.float16, None, "FLASHCORE_ERROR_INVALID_ARGUMENT", "2^25"),
    ],
)
def test_fp8_fake_calls_apply_flashcore_rules(q_shape, kv_shape, dtype, kv_dtype, name, words):
    q = meta(*q_shape, dtype=dtype)
    k = meta(*kv_shape, dtype=kv_dtype or dtype)
    v = meta(*kv_shape, dtype=kv_dtype or dtype)
    with pytest.raises(FlashcoreError) as e:
        flashcore.attention_fp8(q, k, v)
    assert e.value.name == name
    assert words in str(e.value)
    assert e.value.message.startswith("flashcore_fp8_workspace_bytes: ")


def test_fp8_misuse_is_refused_before_the_library():
    q = meta(1, 4, 64, 64)
    with pytest.raises(ValueError, match="layout"):
        flashcore.attention_fp8(q, q, q, layout="bsdh")
    for s in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="scale"):
            flashcore.attention_fp8(q, q, q, scale=s)
    for seed in (-1, 2**64):
        with pytest.raises(ValueError, match="hadamard_seed"):
            flashcore.attention_fp8(q, q, q, hadamard_seed=seed)
    for seed in (1.5, "7", True):
        with pytest.raises(TypeError, match="hadamard_seed"):
            flashcore.attention_fp8(q, q, q, hadamard_seed=seed)
    with pytest.raises(ValueError, match="4-d"):
        flashcore.attention_fp8(meta(4, 64, 64), q, q)
    with pytest.raises(TypeError):
        flashcore.attention_fp8(q, q, None)
    cpu = torch.zeros(1, 4, 64, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA"):
        flashcore.attention_fp8(cpu, cpu, cpu)
    with pytest.raises(NotImplementedError, match="backward"):
        flashcore.attention_fp8(meta(1, 4, 64, 64).requires_grad_(), q, q)
    # The empty problem: no launch, the rules still apply.
    assert flashcore.attention_fp8(meta(1, 4, 0, 64), meta(1, 4, 9, 64), meta(1, 4, 9, 64)).shape == (1, 4, 0, 64)
    with pytest.raises(FlashcoreError, match="UNSUPPORTED_HEAD_DIM"):
        flashcore.attention_fp8(meta(1, 4, 0, 80), meta(1, 4, 9, 80), meta(1, 4, 9, 80))
    # quantize_fp8 and forward_fp8 run on real CUDA tensors only.
    with pytest.raises(ValueError, match="CUDA"):
        flashcore.quantize_fp8(q, q, q)
    with pytest.raises(ValueError, match="CUDA"):
        flashcore.quantize_fp8(cpu, cpu, cpu)
    with pytest.raises(ValueError, match="hadamard_seed"):
        flashcore.quantize_fp8(q, q, q, hadamard_seed=-5)
    with pytest.raises(TypeError, match="Fp8Operands"):
        flashcore.forward_fp8((q, q, q))


def test_fp8_seeds_cross_the_op_as_int64():
    from flashcore.fp8 import _seed_from_op, _seed_to_op

    for seed in (0, 1, 2**63 - 1, 2**63, 2**64 - 1):
        op = _seed_to_op(seed)
        assert -(2**63) <= op < 2**63 and _seed_from_op(op) == seed
    opts = _capi.quantize_options(True, 2**64 - 1)
    assert (opts.smooth_k, opts.hadamard, opts.hadamard_seed) == (1, 1, 2**64 - 1)
    opts = _capi.quantize_options()
    assert (opts.smooth_k, opts.hadamard, opts.hadamard_seed) == (0, 0, 0)


def test_fp8_compiles_to_one_graph():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    def f(q, k, v):
        return flashcore.attention_fp8(q, k, v, causal=True, layout="bshd", smooth_k=True, hadamard_seed=5) * 2

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    q, k = meta(2, 64, 8, 128), meta(2, 64, 2, 128)
    assert compiled(q, k, k).shape == q.shape
    assert len(calls) == 1
    ops = [n.target for n in calls[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.flashcore.attention_fp8 in ops, ops


def test_forward_mode_derivatives_are_refused_not_dropped():
    """A dual tensor (forward-mode AD) or torch.func.jvp's inputs carry tangents the op
    would drop (a zero or missing tangent): refused, as gradients are."""
    import torch.autograd.forward_ad as fwAD

    q = meta(1, 4, 64, 64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, meta(1, 4, 64, 64))
        with pytest.raises(NotImplementedError, match="forward-mode"):
            flashcore.attention(dual, q, q)
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda t: flashcore.attention(t, q, q), (q,), (meta(1, 4, 64, 64),))


def test_fake_calls_refuse_what_the_real_ones_refuse():
    """The fake (meta) path stands in only for the dimensions the real call takes as
    nothing to launch: 0 KV heads are refused either way, 0 query heads beside 2 KV heads
    are not a head-ratio error."""
    q = meta(2, 16, 4, 64)
    none = meta(2, 16, 0, 64)
    with pytest.raises(FlashcoreError) as e:
        flashcore.attention(q, none, none, layout="bshd")
    assert e.value.name == "FLASHCORE_ERROR_EMPTY_DIMENSION", e.value
    o = flashcore.attention(meta(2, 16, 0, 64), meta(2, 16, 2, 64), meta(2, 16, 2, 64), layout="bshd")
    assert o.shape == (2, 16, 0, 64)


def test_host_copies_are_range_checked_as_python_ints():
    """Lists are checked as Python ints (no tensor made first: an empty list is not a float
    tensor, a value past int64 is not an OverflowError)."""
    from flashcore.serving import _host_int32

    assert _host_int32("decode", "host_seqlens", [], (0,)).dtype == torch.int32
    with pytest.raises(ValueError, match="shape"):
        _host_int32("decode", "host_seqlens", [], (3,))
    with pytest.raises(ValueError, match="outside int32"):
        _host_int32("decode", "host_seqlens", [0, 1, 2**70], (3,))
    with pytest.raises(ValueError, match="integers"):
        _host_int32("decode", "host_seqlens", [0, 1.5], (2,))
    got = _host_int32("decode", "host_block_table", [[1, 2], [3, 4]], (2, 2))
    assert got.tolist() == [[1, 2], [3, 4]] and got.dtype == torch.int32


def test_host_copies_may_be_numpy_arrays():
    """Serving code often keeps its host metadata in NumPy: arrays are taken as the CPU
    tensors they convert to, with the same checks."""
    np = pytest.importorskip("numpy")
    from flashcore.serving import _host_int32

    got = _host_int32("decode", "host_block_table", np.array([[1, 2], [3, 4]], dtype=np.int64), (2, 2))
    assert got.tolist() == [[1, 2], [3, 4]] and got.dtype == torch.int32
    assert _host_int32("decode", "host_seqlens", np.arange(3, dtype=np.int32), (3,)).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="outside int32"):
        _host_int32("decode", "host_seqlens", np.array([0, 2**40]), (2,))
    with pytest.raises(ValueError, match="integers"):
        _host_int32("decode", "host_seqlens", np.array([0.0, 1.0]), (2,))
    with pytest.raises(ValueError, match="shape"):
        _host_int32("decode", "host_seqlens", np.zeros(3, dtype=np.int32), (2,))


def test_merge_lists_of_mixed_or_no_shards_are_refused():
    parts = [meta(1, 8, 2, 64), meta(1, 8, 2, 64, dtype=torch.float32)]
    lses = [meta(1, 2, 8, dtype=torch.float32), meta(1, 2, 8, dtype=torch.float32)]
    with pytest.raises(ValueError, match="one dtype"):
        flashcore.merge(parts, lses)
    with pytest.raises(ValueError, match="empty list"):
        flashcore.merge([], [])
    # Shards that torch.stack would refuse: a ValueError, as for any misuse.
    with pytest.raises(ValueError, match="one shape"):
        flashcore.merge([meta(1, 8, 2, 64), meta(1, 9, 2, 64)], lses)
    with pytest.raises(ValueError, match="one shape"):
        uneven = [meta(1, 2, 8, dtype=torch.float32), meta(1, 2, 9, dtype=torch.float32)]
        flashcore.merge([meta(1, 8, 2, 64)] * 2, uneven)
    with pytest.raises(ValueError, match="one device"):
        flashcore.merge([meta(1, 8, 2, 64), torch.empty(1, 8, 2, 64, dtype=torch.float16)], lses)
