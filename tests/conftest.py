# The Triton interpreter must be selected before any @triton.jit function is
# defined, i.e. before any kernel module is imported: this file is loaded by
# pytest before every test module.
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama():
    from stages.checkpoints import tiny_checkpoint

    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    from stages.checkpoints import tiny_checkpoint

    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="session")
def smollm2():
    from stages.checkpoints import smollm2_path

    return smollm2_path()
