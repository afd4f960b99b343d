"""Shared pytest setup: Triton runs through its CPU interpreter when there is no GPU."""
import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported anywhere in the session.
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture
def one_thread():
    """Many tiny calls (gradcheck, statistical tests): one thread, so that a busy machine (OpenMP
    waiting for a core another process holds) does not make each call many times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
