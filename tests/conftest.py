"""Shared pytest setup: Triton runs through its CPU interpreter when there is no GPU."""
import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported anywhere in the session.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The kernels too are made now: triton.jit reads the variable when a kernel module is imported,
    # and a test that unsets it (tests/test_errors.py) must not be the first to import them (its
    # kernels would then want a GPU driver for the rest of the session, whatever the file order).
    try:
        import bst_fast.backends.triton_backend  # noqa: F401
    except ImportError:  # no triton: the tests that need it skip
        pass


import pytest  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n 2 (.ci/run) on two cores: one thread a worker, not two each (OpenMP threads waiting
    # for a core the other worker holds made the C++ engine's tests many times slower). The tests of
    # thread counts set theirs.
    torch.set_num_threads(1)
    # and the processes tests start (the CLI, torchrun's ranks, scripts): one OpenMP thread each
    # unless a test says otherwise, for the same reason (review helper-88)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def one_thread():
    """Many tiny calls (gradcheck, statistical tests): one thread, so that a busy machine (OpenMP
    waiting for a core another process holds) does not make each call many times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
