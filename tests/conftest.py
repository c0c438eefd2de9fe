"""Makes `tests/` importable (tests do `from checkpoints import ...`) and keeps tests offline."""

import os
import random
import sys
from pathlib import Path

# Set before anything imports huggingface_hub or transformers, which read them at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# transformers' weight-loading/saving bars would bury test output; it reads this at import.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

# The CI machines have two cores; more threads only add contention.
torch.set_num_threads(2)


import pytest  # noqa: E402


@pytest.fixture
def seed() -> int:
    """A fresh random seed per test (tests print it on failure);
    FP8SERVE_TEST_SEED replays one."""
    return int(os.environ.get("FP8SERVE_TEST_SEED", random.SystemRandom().randrange(2**31)))


@pytest.fixture(scope="module")
def ops():
    """torch.ops.fp8serve, or the module's tests skip when the C++ kernels cannot be built here."""
    from fp8serve.kernels.cpu_ops import load_cpu_ops

    module = load_cpu_ops()
    if module is None:
        pytest.skip("C++ CPU kernels unavailable (load_cpu_ops() returned None)")
    return module


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run where a CUDA device is present (the lent GPU
    machines) and are skipped, with the reason shown, everywhere else."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
