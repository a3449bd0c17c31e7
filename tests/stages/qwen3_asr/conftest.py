import pytest


@pytest.fixture(scope="session")
def asr_path():
    from stages.qwen3_asr.checkpoint import qwen3_asr_checkpoint

    return qwen3_asr_checkpoint("tiny")


@pytest.fixture(scope="session")
def asr_stage(asr_path):
    import torch

    from stages.qwen3_asr.model import Qwen3ASRStage

    return Qwen3ASRStage.load(asr_path, dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="session")
def hf_asr(asr_path):
    import torch
    from transformers import Qwen3ASRForConditionalGeneration

    return Qwen3ASRForConditionalGeneration.from_pretrained(str(asr_path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def asr_processor(asr_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(asr_path))
