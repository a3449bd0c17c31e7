import pytest


@pytest.fixture(scope="session")
def hf_omni(tiny_omni):
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(str(tiny_omni), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def thinker_stage(tiny_omni):
    import torch

    from stages.qwen2_5_omni.thinker import Qwen2_5OmniThinkerStage

    return Qwen2_5OmniThinkerStage.load(tiny_omni, dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="session")
def talker_stage(tiny_omni):
    import torch

    from stages.qwen2_5_omni.talker import Qwen2_5OmniTalkerStage

    return Qwen2_5OmniTalkerStage.load(tiny_omni, dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="session")
def token2wav_stage(tiny_omni):
    import torch

    from stages.qwen2_5_omni.token2wav import Qwen2_5OmniToken2WavStage

    return Qwen2_5OmniToken2WavStage.load(tiny_omni, dtype=torch.float32, device=torch.device("cpu"))
