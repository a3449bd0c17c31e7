import pytest


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Some benchmarks set torch's thread count for their measurement (`--threads`): put it back, or every
    later test in the session computes with another count (and other fp32 reduction orders)."""
    import torch

    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
