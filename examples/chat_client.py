"""A multi-turn voice chat against `omni serve`, with the `openai` package.

    omni serve stage_configs/qwen2_5_omni_small.yaml &         # listens on 127.0.0.1:8000
    python examples/chat_client.py --turn "Hello, who are you?" --turn "Tell me more." \
        [--audio question.wav] [--voice Chelsie] [--out-dir replies/] [--base-url http://127.0.0.1:8000/v1]

Each turn streams: the reply's text is printed as it arrives, its audio (base64 pcm16 chunks in
`delta.audio.data`) is collected and saved as replies/turn-N.wav, and the usage chunk at the end
tells how many prompt tokens the server found in its prefix cache (from turn 2 on, the conversation
so far). `--audio FILE` sends a WAV file with the first turn (an `input_audio` part). `--text-only`
asks for text alone (a pipeline without an audio stage). The API key comes from $OMNI_API_KEY.
"""
from __future__ import annotations

import argparse
import base64
import os
import sys
import wave
from pathlib import Path

import openai

PCM16_RATE = 24000  # OpenAI's pcm16 (and Qwen2.5-Omni's token2wav) rate


def save_wav(path: Path, pcm: bytes, rate: int = PCM16_RATE) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)


def user_message(text: str, audio_file: Path | None) -> dict:
    if audio_file is None:
        return {"role": "user", "content": text}
    data = base64.b64encode(audio_file.read_bytes()).decode()
    return {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                                        {"type": "text", "text": text}]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="default: the server's one model")
    p.add_argument("--turn", action="append", required=True, help="a user turn (repeatable)")
    p.add_argument("--audio", type=Path, help="a WAV file sent with the first turn")
    p.add_argument("--voice", default="Chelsie")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out-dir", type=Path, default=Path("replies"))
    p.add_argument("--text-only", action="store_true")
    args = p.parse_args(argv)

    client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("OMNI_API_KEY", "none"))
    model = args.model or client.models.list().data[0].id
    args.out_dir.mkdir(parents=True, exist_ok=True)
    audio = {} if args.text_only else {"modalities": ["text", "audio"],
                                      "audio": {"voice": args.voice, "format": "pcm16"}}
    messages: list[dict] = []
    for n, turn in enumerate(args.turn, 1):
        messages.append(user_message(turn, args.audio if n == 1 else None))
        print(f"[turn {n}] user: {turn}\n[turn {n}] assistant: ", end="", flush=True)
        text, pcm, usage = "", bytearray(), None
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                                stream=True, stream_options={"include_usage": True}, **audio)
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if delta.content:
                text += delta.content
                print(delta.content, end="", flush=True)
            if getattr(delta, "audio", None) is not None:
                pcm += base64.b64decode(delta.audio.data)
        print()
        if pcm:
            path = args.out_dir / f"turn-{n}.wav"
            save_wav(path, bytes(pcm))
            print(f"[turn {n}] audio: {len(pcm) // 2} samples -> {path}")
        cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else None
        print(f"[turn {n}] prompt_tokens={usage.prompt_tokens} cached_tokens={cached} "
              f"completion_tokens={usage.completion_tokens}")
        messages.append({"role": "assistant", "content": text})  # the transcript carries the turn on
    return 0


if __name__ == "__main__":
    sys.exit(main())
