"""Higgs Audio v2's prompt: a request's text or chat messages (and reference voices) -> token ids, the audio frames
of its audio positions, and the multimodal features that key their blocks.

As `HiggsAudioV2Processor.apply_chat_template` builds it: the conversation (a system turn, an optional scene, user
texts, assistant audio turns) rendered by the checkpoint's chat template with a generation prompt, each audio turn's
`<|AUDIO_OUT|>` expanded to its frames' placeholders (stages/higgs_audio_v2/delay.py), the text tokenized without
added special tokens (the template writes the bos).

    a text prompt      the text to speak: [system, scene?, voice reference?, user text]
    chat messages      transformers' conversation format: roles system / scene / user / assistant, content a string
                       or parts ({"type": "text", "text"} or {"type": "audio"}: the request's next audio input)
    a voice            `extra["speaker"]`: a named reference (voices.py), or `extra["reference_text"]` with the
                       last audio input (the Python API's `voice: {"audio", "text"}`), spoken before the last user
                       turn as user: its transcript, assistant: its audio; `extra["instructions"]`: the scene text

Every audio item is encoded once per content (the codec's encoder; voices.py keeps the codes by hash), and its
frames' hash becomes the item's multimodal feature: two prompts that differ in one code of one codebook never share
a block, and a second request in the same voice reuses every block up to its own text.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from omni.engine.core.request import MultiModalFeature
from omni.engine.stage_model import PreparedPrompt
from omni.errors import RequestError
from omni.messages import StageInput
from omni.stage_info import StageInfo

from stages.higgs_audio_v2.delay import audio_placeholders, build_delay_pattern
from stages.higgs_audio_v2.voices import VoiceBook

DEFAULT_SYSTEM = "Generate audio following instruction."  # transformers' documented example's system turn
AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS, DELAY_TOKEN = ("<|AUDIO_OUT|>", "<|audio_out_bos|>", "<|audio_eos|>",
                                                  "<|reserved_special_token_6|>")
_ROLES = ("system", "scene", "user", "assistant")


def read_chat_template(model_path: Path, tokenizer: Any) -> str:
    """The processor's chat template (chat_template.jinja / .json as save_pretrained writes it), else the
    tokenizer's."""
    jinja = model_path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    js = model_path / "chat_template.json"
    if js.is_file():
        import json

        return json.loads(js.read_text())["chat_template"]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    raise ValueError(f"{model_path}: no chat template (chat_template.jinja, chat_template.json or the tokenizer's)")


class HiggsPrompter:
    def __init__(self, tokenizer: Any, chat_template: str, config: Any, voices: VoiceBook):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.voices = voices
        self.num_codebooks = int(config.num_codebooks)
        self.stream_bos, self.stream_eos = int(config.audio_stream_bos_id), int(config.audio_stream_eos_id)
        self.audio_ids = (int(config.audio_token_id), int(config.audio_delay_token_id))
        self.max_model_len = int(config.max_position_embeddings)

    @classmethod
    def from_checkpoint(cls, model_path: Path, tokenizer: Any, config: Any, device: Any,
                        model_kwargs: dict[str, Any]) -> "HiggsPrompter":
        voices = VoiceBook.from_kwargs(model_path, model_kwargs, device, int(config.num_codebooks))
        return cls(tokenizer, read_chat_template(model_path, tokenizer), config, voices)

    def info(self, base: StageInfo) -> StageInfo:
        return replace(base, voices=self.voices.names())

    def stats(self) -> dict[str, Any]:
        return self.voices.stats()

    # -- the conversation -----------------------------------------------------------------------------
    def conversation(self, inp: StageInput) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
        """The messages to render and the codes [K, T] of each audio turn, in order."""
        audio_inputs = [m for m in inp.mm_inputs if m.modality == "audio"]
        if len(audio_inputs) != len(inp.mm_inputs):
            bad = next(m.modality for m in inp.mm_inputs if m.modality != "audio")
            raise RequestError(f"multi_modal_data: higgs_audio_v2 takes audio only (reference voices), got {bad!r}",
                               field="multi_modal_data")
        extra = inp.extra or {}
        speaker, instructions = extra.get("speaker"), extra.get("instructions")
        reference = None
        if extra.get("reference_text") is not None:  # a per-request reference clip: the last audio input
            if speaker is not None:
                raise RequestError("voice: give a voice's name or a reference clip, not both", field="voice")
            if not audio_inputs:
                raise RequestError("voice.audio: a reference text with no clip", field="voice.audio")
            reference = (str(extra["reference_text"]), self.voices.encode(audio_inputs.pop(), "voice.audio"))
        if isinstance(inp.prompt, str):
            messages: list[dict[str, Any]] = [{"role": "user", "content": inp.prompt}]
        elif isinstance(inp.prompt, list) and inp.prompt:
            messages = [dict(m) for m in inp.prompt]
        else:
            raise RequestError("prompt: higgs_audio_v2 takes the text to speak or chat messages", field="prompt")
        if not isinstance(messages[-1], dict) or messages[-1].get("role") != "user":
            raise RequestError("prompt: the last message is the user text to speak", field="prompt")
        codes: list[np.ndarray] = []
        queue = list(audio_inputs)
        for i, msg in enumerate(messages):
            role = msg.get("role")
            if role not in _ROLES:
                raise RequestError(f"prompt[{i}].role: one of {', '.join(_ROLES)} (got {role!r})",
                                   field=f"prompt[{i}].role")
            content = msg.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.get("type") == "audio":
                        if role != "assistant":
                            raise RequestError(f"prompt[{i}].content[{j}]: audio belongs in an assistant turn (a "
                                               "reference voice)", field=f"prompt[{i}].content[{j}]")
                        if not queue:
                            raise RequestError(f"prompt[{i}].content[{j}]: an audio part with no audio input left",
                                               field="multi_modal_data")
                        codes.append(self.voices.encode(queue.pop(0), f"prompt[{i}].content[{j}]"))
                    elif part.get("type") != "text":
                        raise RequestError(f"prompt[{i}].content[{j}].type: text or audio (got {part.get('type')!r})",
                                           field=f"prompt[{i}].content[{j}].type")
            elif role == "assistant":
                raise RequestError(f"prompt[{i}].content: an assistant turn is audio (a list with an audio part)",
                                   field=f"prompt[{i}].content")
        if queue:
            raise RequestError(f"multi_modal_data: {len(queue)} audio input(s) with no audio part to place them",
                               field="multi_modal_data")
        if speaker is not None or reference is not None:
            text, voice_codes = self.voices.reference(speaker) if reference is None else reference
            at = len(messages) - 1
            messages[at:at] = [{"role": "user", "content": text},
                               {"role": "assistant", "content": [{"type": "audio"}]}]
            codes.insert(sum(1 for m in messages[:at] if _has_audio(m)), voice_codes)
        if instructions and not any(m.get("role") == "scene" for m in messages):
            messages.insert(0, {"role": "scene", "content": str(instructions)})
        if messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": DEFAULT_SYSTEM})
        return messages, codes

    def next_turn(self, text: str) -> list[int]:
        """The tokens that follow a generated reply's last frame to speak `text` next in the same request: the rest
        of the assistant's audio turn, the user's turn with the text, and the generation prompt, as the chat template
        renders the conversation with that reply as an audio turn (the frame positions are the reply's own)."""
        return self.tokenizer(f"<|audio_eos|><|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{text.strip()}"
                              "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<|audio_out_bos|>",
                              add_special_tokens=False)["input_ids"]

    def prepare(self, inp: StageInput) -> PreparedPrompt:
        messages, codes = self.conversation(inp)
        text = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)
        frames = [build_delay_pattern(c, self.stream_bos, self.stream_eos) for c in codes]
        pieces = text.split(AUDIO_TOKEN)
        if len(pieces) != len(frames) + 1:
            raise RequestError(f"prompt: {len(pieces) - 1} audio placeholders for {len(frames)} audio turns "
                               "(the text may not contain the audio token itself)", field="prompt")
        expanded = pieces[0] + "".join(
            audio_placeholders(len(f), self.num_codebooks, AUDIO_TOKEN, DELAY_TOKEN) + rest
            for f, rest in zip(frames, pieces[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        frames_at: dict[int, np.ndarray] = {}
        features: list[MultiModalFeature] = []
        runs = _audio_runs(ids, self.audio_ids)
        for (start, length), f in zip(runs, frames):
            if length != len(f):
                raise RuntimeError(f"higgs_audio_v2: an audio run of {length} tokens for {len(f)} frames")
            for p in range(length):
                frames_at[start + p] = f[p]
            h = xxhash.xxh3_128(f"higgs|{f.shape}|".encode())
            h.update(np.ascontiguousarray(f).tobytes())
            features.append(MultiModalFeature(h.hexdigest(), start, length, "audio"))
        last = messages[-1].get("content")
        spoken = last if isinstance(last, str) else " ".join(p.get("text", "") for p in last or [] if isinstance(p, dict))
        return PreparedPrompt(token_ids=list(ids), mm_features=features,
                              extra={"frames_at": frames_at, "turn_chars": len(spoken.strip())})


def _has_audio(msg: dict[str, Any]) -> bool:
    content = msg.get("content")
    return isinstance(content, list) and any(p.get("type") == "audio" for p in content)


def _audio_runs(ids: list[int], audio_ids: tuple[int, int]) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of audio / delay tokens."""
    runs, start = [], None
    for p, t in enumerate([*ids, -1]):
        if t in audio_ids:
            start = p if start is None else start
        elif start is not None:
            runs.append((start, p - start))
            start = None
    return runs
