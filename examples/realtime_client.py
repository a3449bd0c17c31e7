"""A spoken conversation over `/v1/realtime`, with the `openai` package's `client.realtime.connect`.

    omni serve stage_configs/qwen2_5_omni_small.yaml &         # listens on 127.0.0.1:8000
    python examples/realtime_client.py --speak question.wav --say "And what else?" \
        [--vad] [--voice Chelsie] [--out-dir replies/] [--base-url http://127.0.0.1:8000/v1]

Each `--speak FILE` is a turn spoken from a WAV file (any rate: it is resampled to the protocol's 24 kHz
pcm16 and sent in 100 ms pieces, as a microphone would), each `--say TEXT` a typed turn, in the order
given. Manual turns (commit, then response.create) unless `--vad`: then the server's voice-activity
detection ends each spoken turn and answers by itself. Per turn the reply's transcript is printed as it
streams, its audio saved as replies/turn-N.wav, and `cached_tokens` shows the prefix cache holding the
conversation so far (from turn 2 on). `--voice`: one of the server's voices (GET /v1/audio/voices); none
given, the pipeline's default voice. The API key comes from $OMNI_API_KEY.

The same client talks to a voice agent's cascade (stage_configs/voice_agent_small.yaml served as above: a
speech recognizer, an LLM and a TTS): there the recognizer hears each turn, so every turn is spoken (`--speak`;
a typed turn is refused), and what it heard is printed as the turn's `user (heard):` line.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
import wave
from pathlib import Path

import numpy as np
import openai

RATE = 24000  # the Realtime protocol's pcm16 rate


class TurnAction(argparse.Action):
    """--speak / --say keep their order on the command line."""

    def __call__(self, parser, namespace, value, option_string=None):  # noqa: ANN001
        namespace.turns = [*(getattr(namespace, "turns", None) or []), (self.dest, value)]


def pcm16_of_wav(path: Path) -> bytes:
    """A WAV file as mono 16-bit pcm at 24 kHz (linear interpolation: enough for speech)."""
    with wave.open(str(path)) as w:
        if w.getsampwidth() != 2:
            raise SystemExit(f"{path}: only 16-bit PCM WAV files")
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32)
        x = x.reshape(-1, w.getnchannels()).mean(axis=1)
        rate = w.getframerate()
    t = np.arange(0, x.size * RATE // rate) * rate / RATE
    return np.interp(t, np.arange(x.size), x).astype("<i2").tobytes()


def save_wav(path: Path, pcm: bytes) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm)


async def converse(args: argparse.Namespace) -> None:
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=os.environ.get("OMNI_API_KEY", "none"))
    model = args.model or (await client.models.list()).data[0].id
    args.out_dir.mkdir(parents=True, exist_ok=True)
    vad = {"type": "server_vad", "silence_duration_ms": 1000} if args.vad else None
    async with client.realtime.connect(model=model) as conn:
        output = {"voice": args.voice} if args.voice else {}  # none: the pipeline's default voice
        await conn.session.update(session={"type": "realtime", "audio": {
            "input": {"turn_detection": vad}, "output": output}})
        for n, (kind, value) in enumerate(args.turns, 1):
            if kind == "speak":
                pcm = pcm16_of_wav(Path(value))
                if args.vad:
                    pcm += bytes(RATE * 2)  # a second of silence after the speech ends the turn
                step = RATE // 10 * 2
                for i in range(0, len(pcm), step):
                    await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + step]).decode())
                if not args.vad:
                    await conn.input_audio_buffer.commit()
                    await conn.response.create()
                print(f"[turn {n}] user: <{len(pcm) // 2 / RATE:.1f} s of speech from {value}>")
            else:
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": value}]})
                await conn.response.create()
                print(f"[turn {n}] user: {value}")
            audio, said = b"", False

            def say(text: str) -> None:  # the reply's transcript, after its `assistant:` prefix
                nonlocal said
                if not said:
                    said = True
                    print(f"[turn {n}] assistant: ", end="", flush=True)
                print(text, end="", flush=True)

            async for event in conn:
                if event.type == "conversation.item.input_audio_transcription.completed":
                    # what a voice agent's recognizer heard of the turn (before its reply)
                    print(f"[turn {n}] user (heard): {event.transcript}")
                elif event.type == "response.output_audio_transcript.delta":
                    say(event.delta)
                elif event.type == "response.output_audio.delta":
                    audio += base64.b64decode(event.delta)
                elif event.type == "error":
                    raise SystemExit(f"\nerror: {event.error.message}")
                elif event.type == "response.done":
                    usage = event.response.usage
                    say("\n")
                    if args.vad and kind == "speak" and event.response.status == "cancelled":
                        # A pause in the speech ended the turn and the speech went on (a barge-in): the
                        # server cancelled that response and answers again once the speech ends.
                        print(f"[turn {n}] (the speech went on: that response was cut, the next one follows)")
                        audio, said = b"", False
                        continue
                    if event.response.status not in ("completed", "incomplete"):  # incomplete: max tokens
                        raise SystemExit(f"[turn {n}] the response ended {event.response.status}")
                    out = args.out_dir / f"turn-{n}.wav"
                    save_wav(out, audio)
                    print(f"[turn {n}] audio: {len(audio) // 2} samples -> {out}")
                    print(f"[turn {n}] input_tokens={usage.input_tokens} "
                          f"cached_tokens={usage.input_token_details.cached_tokens}")
                    break


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--speak", action=TurnAction, metavar="WAV", help="a spoken turn, from a WAV file")
    p.add_argument("--say", action=TurnAction, metavar="TEXT", help="a typed turn")
    p.add_argument("--vad", action="store_true", help="server VAD ends spoken turns (else manual commits)")
    p.add_argument("--voice", help="one of the server's voices (Qwen2.5-Omni: Chelsie, Ethan); default: its own")
    p.add_argument("--model", help="default: the server's model")
    p.add_argument("--out-dir", type=Path, default=Path("replies"))
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = p.parse_args()
    if not getattr(args, "turns", None):
        p.error("give at least one --speak WAV or --say TEXT")
    try:
        asyncio.run(converse(args))
    except openai.APIConnectionError as e:
        sys.exit(f"cannot reach {args.base_url}: {e}")


if __name__ == "__main__":
    main()
