import os

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpu_available():
    return torch.cuda.is_available()


requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def seed():
    """A fresh seed per test (FLASHCORE_SEED fixes it), printed so a failure can be rerun."""
    s = int(os.environ.get("FLASHCORE_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed {s}")
    torch.manual_seed(s)
    return s
