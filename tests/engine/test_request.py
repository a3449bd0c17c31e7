import pytest

from omni.engine.core.kv_cache import BlockHasher
from omni.engine.core.request import MultiModalFeature, Request, RequestStatus


def test_counters_and_append():
    r = Request("r", [1, 2, 3], eos_token_id=7, arrival_time=5.0)
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (3, 3, 0)
    assert r.num_computed_tokens == 0 and r.num_cached_tokens == -1
    assert r.status == RequestStatus.WAITING and not r.is_finished
    assert r.arrival_time == 5.0 and r.eos_token_id == 7
    r.append_output_token_ids(4)
    r.append_output_token_ids([5, 6])
    assert r.output_token_ids == [4, 5, 6]
    assert r.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert r.prompt_token_ids == [1, 2, 3]
    assert (r.num_tokens, r.num_output_tokens) == (6, 3)


def test_no_hasher_means_no_hashes():
    r = Request("r", list(range(40)))
    r.append_output_token_ids(list(range(20)))
    assert r.block_hashes == [] and r.block_hasher is None


def test_block_hashes_incremental_equal_full_recompute():
    hasher = BlockHasher(4, seed=3)
    r = Request("r", list(range(10)), block_hasher=hasher)
    assert len(r.block_hashes) == 2  # only full blocks
    for t in range(100, 111):
        r.append_output_token_ids(t)
        assert len(r.block_hashes) == r.num_tokens // 4
    r.append_output_token_ids([1, 2, 3, 4, 5, 6, 7, 8, 9])
    full = Request("f", r.all_token_ids, block_hasher=hasher)
    assert full.block_hashes == r.block_hashes


def test_status_helpers():
    finished = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}
    r = Request("r", [1, 2, 3])
    for s in RequestStatus:
        r.status = s
        assert r.is_finished == (s in finished)


def test_validation():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("r", [])
    with pytest.raises(ValueError, match="mm_features"):
        Request("r", [1, 2, 3], mm_features=[MultiModalFeature("img", 2, 5)])
    with pytest.raises(ValueError, match="offset"):
        MultiModalFeature("img", -1, 2)
    with pytest.raises(ValueError, match="length"):
        MultiModalFeature("img", 0, 0)


def test_mm_features_sorted_by_offset():
    feats = [MultiModalFeature("b", 6, 2), MultiModalFeature("a", 1, 2)]
    r = Request("r", list(range(10)), mm_features=feats)
    assert [f.mm_hash for f in r.mm_features] == ["a", "b"]


def test_kv_modules_import_no_torch():
    """The scheduler-side bookkeeping is pure Python: no torch (checked statically,
    so a heavy package __init__ elsewhere cannot hide a regression here)."""
    import ast
    import pathlib

    import omni.engine.core.kv_cache as kv_pkg
    import omni.engine.core.request as req_mod

    files = [pathlib.Path(req_mod.__file__), *pathlib.Path(kv_pkg.__file__).parent.glob("*.py")]
    allowed_omni = ("omni.engine.core.request", "omni.engine.core.kv_cache")
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in ("torch", "numpy"), f"{f.name} imports {name}"
                if name.startswith("omni"):
                    assert name.startswith(allowed_omni), f"{f.name} imports {name}"
