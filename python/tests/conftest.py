import math
import os

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpu_available():
    return torch.cuda.is_available()


requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def poison_allocator(*shapes_dtypes):
    """Fills blocks the caching allocator will hand out next with NaN, so an output element
    the kernel leaves unwritten shows up."""
    blocks = [torch.full(s, math.nan, dtype=dt, device="cuda") for s, dt in shapes_dtypes]
    del blocks


@pytest.fixture
def seed():
    """A fresh seed per test (FLASHCORE_SEED fixes it, decimal or 0x hexadecimal as the
    Rust tests take it), printed so a failure can be rerun."""
    given = os.environ.get("FLASHCORE_SEED")
    s = int(given, 0) if given else int.from_bytes(os.urandom(4), "little")
    print(f"seed {s}")
    torch.manual_seed(s)
    return s
