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


@pytest.fixture
def tiny_streamed_omni(tmp_path):
    """stage_configs/qwen2_5_omni_tiny.yaml with streaming edges (as the small config has them), written to a
    YAML file of its own: its path."""
    from pathlib import Path

    import yaml

    from tests.stages.test_qwen2_5_omni_streaming import CONFIG, STREAMED

    cfg = yaml.safe_load(Path(CONFIG).read_text())
    for stage in cfg["stages"]:
        stage.update(STREAMED.get(stage["name"], {}))
    path = tmp_path / "tiny_streamed.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def tiny_streamed_qwen3_omni(tmp_path):
    """stage_configs/qwen3_omni_tiny.yaml with streaming edges and small code2wav chunks, written to a YAML file of
    its own: its path. Every window is 2 frames, streamed or not: each window of chunked_decode drops a few trailing
    samples, so a smaller first chunk (the small config's) would make the streamed waveform a little shorter."""
    from pathlib import Path

    import yaml

    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "stage_configs" / "qwen3_omni_tiny.yaml").read_text())
    streamed = {"talker": {"inputs": [{"stage": "thinker", "stream": True, "chunk_tokens": 1}]},
                "code2wav": {"inputs": [{"stage": "talker", "stream": True, "chunk_tokens": 2}],
                             "model_kwargs": {"first_chunk_frames": 2, "chunk_frames": 2, "left_context_frames": 25}}}
    for stage in cfg["stages"]:
        stage.update(streamed.get(stage["name"], {}))
    path = tmp_path / "tiny_streamed_qwen3.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
