"""The languages a transcription may name: ISO-639-1 codes (OpenAI's `language`), and the two ISO-639-3 codes
Whisper's clients send besides (haw: Hawaiian, yue: Cantonese). Anything else is refused naming `language`."""
from __future__ import annotations

ISO_639_1 = frozenset("""
aa ab ae af ak am an ar as av ay az ba be bg bh bi bm bn bo br bs ca ce ch co cr cs cu cv cy da de dv dz ee el en
eo es et eu fa ff fi fj fo fr fy ga gd gl gn gu gv ha he hi ho hr ht hu hy hz ia id ie ig ii ik io is it iu ja jv
ka kg ki kj kk kl km kn ko kr ks ku kv kw ky la lb lg li ln lo lt lu lv mg mh mi mk ml mn mr ms mt my na nb nd ne
ng nl nn no nr nv ny oc oj om or os pa pi pl ps pt qu rm rn ro ru rw sa sc sd se sg si sk sl sm sn so sq sr ss st
su sv sw ta te tg th ti tk tl tn to tr ts tt tw ty ug uk ur uz ve vi vo wa wo xh yi yo za zh zu
""".split())
LANGUAGES = ISO_639_1 | {"haw", "yue"}


def check_language(code: str | None) -> str | None:
    """`code` when it names a language (ValueError otherwise, for a pydantic validator: the field is named)."""
    if code is not None and code not in LANGUAGES:
        raise ValueError(f"{code!r} is no ISO-639-1 language code (such as en, de, fr, zh, ja)")
    return code
