"""Our top-level `kernels` package shares its import name with Hugging Face's `kernels` (hub kernels),
which transformers probes for when `transformers.integrations.hub_kernels` is imported (that is, when
any model class is loaded):

    is_kernels_available() = find_spec("kernels") is not None
                             and KERNELS_MIN_VERSION <= version < KERNELS_MAX_VERSION

`find_spec` finds *our* package, and the version comes from `importlib.metadata`: no distribution is
named "kernels", so transformers asks `packages_distributions()`, which maps "kernels" to the "omni"
distribution, and reads omni's version. It is far outside transformers' window ([0.18.2, 0.19.0) in
5.23), so the probe answers False and transformers never imports our package. If it answered True,
transformers would run `from kernels import LayerRepository, kernelize, ...` while importing
`modeling_utils` and every model load would fail. These tests pin that down in a fresh interpreter.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging import version

REPO = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: records every lookup of `kernels`, loads a model, runs generate.
_PROBE = r"""
import importlib.abc, importlib.metadata, json, logging, sys, warnings

hide_metadata = sys.argv[2] == "checkout"
if hide_metadata:  # as if running from a checkout without `pip install -e .`
    _orig = importlib.metadata.packages_distributions
    def _packages_distributions():
        mapping = dict(_orig())
        mapping.pop("kernels", None)
        return mapping
    importlib.metadata.packages_distributions = _packages_distributions

lookups = []
class _Recorder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "kernels" or name.startswith("kernels."):
            lookups.append(name)
        return None
sys.meta_path.insert(0, _Recorder())

messages = []
class _Handler(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())

warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_info()
    logging.getLogger("transformers").addHandler(_Handler())
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True)
    ids = torch.tensor([[1, 2, 3, 4]])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)

from transformers.integrations import hub_kernels
from transformers.utils import import_utils
print(json.dumps({
    "available": import_utils.is_kernels_available(),
    "probe": list(import_utils._is_package_available("kernels", return_version=True)),
    "window": [import_utils.KERNELS_MIN_VERSION, import_utils.KERNELS_MAX_VERSION],
    "lookups": lookups,
    "imported_ours": [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")],
    # names hub_kernels binds only from `kernels` (its fallback branch defines stubs of some others)
    "hub_names_bound": [n for n in ("CUDAProperties", "Mode", "get_kernel_hub", "_kernels_kernelize")
                        if hasattr(hub_kernels, n)],
    "layer_repository_module": hub_kernels.LayerRepository.__module__,
    "use_kernels": bool(model.use_kernels),
    "kernel_messages": [m for m in messages if "kernel" in m.lower()],
    "kernel_warnings": [str(w.message) for w in caught if "kernel" in str(w.message).lower()],
}))
"""


def _run_probe(model_path: Path, mode: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(model_path), mode],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _omni_installed() -> bool:
    try:
        importlib.metadata.distribution("omni")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_is_kernels_available_false_in_this_process():
    from transformers.utils.import_utils import is_kernels_available

    assert is_kernels_available() is False


@pytest.mark.slow
@pytest.mark.skipif(not _omni_installed(), reason="omni is not pip-installed in this environment")
def test_installed_omni_is_not_mistaken_for_hub_kernels(tiny_llama):
    result = _run_probe(tiny_llama, "installed")
    # transformers does find a "kernels" package (ours), with omni's version ...
    assert result["probe"] == [True, importlib.metadata.version("omni")]
    lo, hi = (version.parse(v) for v in result["window"])
    omni_version = version.parse(importlib.metadata.version("omni"))
    assert not (lo <= omni_version < hi), (
        f"omni's version {omni_version} lies in transformers' hub-kernels window [{lo}, {hi}): transformers "
        "would take our top-level `kernels` package for Hugging Face's `kernels` and import hub-kernel names "
        "from it. Keep omni's version outside that window."
    )
    # ... so it answers False and never touches our package.
    assert result["available"] is False
    _assert_no_hub_kernels(result)


@pytest.mark.slow
def test_checkout_without_metadata_is_not_mistaken_for_hub_kernels(tiny_llama):
    result = _run_probe(tiny_llama, "checkout")
    assert result["available"] is False
    _assert_no_hub_kernels(result, allow_import=True)


def _assert_no_hub_kernels(result: dict, allow_import: bool = False) -> None:
    if not allow_import:
        # With omni installed transformers only *looks up* the name (find_spec) while probing, and
        # nothing imports our package. Without omni's metadata its last resort is to import the
        # package to read a __version__ (so kernels/__init__.py must stay light and must not import
        # transformers); our package has none in the window, so the answer is still False.
        assert set(result["lookups"]) <= {"kernels"}, result["lookups"]
        assert result["imported_ours"] == [], result["imported_ours"]
    assert result["hub_names_bound"] == [], "transformers imported hub-kernel names from our package"
    assert result["layer_repository_module"] == "transformers.integrations.hub_kernels"  # its own stub
    assert result["use_kernels"] is False
    assert result["kernel_messages"] == [] and result["kernel_warnings"] == [], result
