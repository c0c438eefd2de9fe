"""Makes `tests/` importable (tests do `from checkpoints import ...`) and keeps tests offline."""

import os
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
