"""Kernel results at one thread and at another thread count, for the tests
that a kernel's thread split leaves every output's bits as they are."""

from __future__ import annotations

from collections.abc import Callable

import torch


def at_one_and(threads: int, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(run() on one thread, run() on `threads` threads); the caller's thread count is restored."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(threads)
        many = run()
    finally:
        torch.set_num_threads(before)
    return one, many
