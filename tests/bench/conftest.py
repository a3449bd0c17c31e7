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
