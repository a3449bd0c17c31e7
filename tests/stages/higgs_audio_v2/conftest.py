import pytest

REFERENCE = "tests/data/higgs_codec_reference.npz"


@pytest.fixture(scope="session")
def higgs_ref():
    """transformers' outputs on our tiny codec checkpoints (tests/data/make_higgs_codec_reference.py)."""
    from pathlib import Path

    import numpy as np

    return dict(np.load(Path(__file__).resolve().parents[3] / REFERENCE))


@pytest.fixture(scope="session")
def higgs_codec():
    """size -> the loaded HiggsCodec of stages.higgs_audio_v2.codec_checkpoint's recipe (built on first use)."""
    from stages.higgs_audio_v2.codec_checkpoint import higgs_codec_checkpoint
    from stages.higgs_audio_v2.codec_model import HiggsCodec

    loaded = {}

    def get(size: str) -> HiggsCodec:
        if size not in loaded:
            loaded[size] = HiggsCodec.from_pretrained(higgs_codec_checkpoint(size))
        return loaded[size]

    return get
