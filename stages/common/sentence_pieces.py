"""Cutting a text stream into pieces a text-to-speech stage can speak as soon as each is complete.

An LLM's reply arrives a few characters at a time; speaking it word by word sounds broken, and waiting for the whole
reply delays the first audio by all of it. `SentenceCutter` hands on each sentence as soon as its end is seen, a long
sentence at a clause end (`,` `;` `:` `—`) once it holds `clause_chars`, and a run with no punctuation at a word
boundary once it holds `max_chars` (or at `max_chars` itself when it has no space), so a piece is never longer.

    an end        `.` `!` `?` `…` (and the CJK `。` `！` `？`), with the closing quotes or brackets after it, then
                  whitespace; not after an abbreviation (Mr., e.g., No.), an initial (J.), or a token with inner dots
                  (U.S.), and never inside a number (3.14: no whitespace follows)
    a piece       the text from the previous cut to this one: the whitespace between two pieces starts the next, so
                  the pieces joined are the stream, character for character (nothing lost, nothing twice)

One character of lookahead: an end is known once the character after it has arrived; `flush()` hands on the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ENDS = ".!?…。！？"
CLAUSES = ",;:—"
CLOSERS = "\"')]}”’»"
ABBREVIATIONS = frozenset("""mr mrs ms dr prof sr jr st vs etc eg ie cf al no nos fig figs approx inc ltd co corp
dept est vol vols pp ed eds jan feb mar apr jun jul aug sep sept oct nov dec mt ft ave blvd rd""".split())


@dataclass(slots=True)
class SentenceCutter:
    clause_chars: int = 60  # a clause end cuts a piece at least this long
    max_chars: int = 200  # no piece is longer
    _buf: str = ""
    _scan: int = 0  # characters of _buf already looked at for an end
    _pieces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.clause_chars <= self.max_chars:
            raise ValueError(f"need 1 <= clause_chars <= max_chars, got {self.clause_chars} and {self.max_chars}")

    def feed(self, text: str) -> list[str]:
        """The pieces `text` completes (possibly none)."""
        self._buf += text
        out = []
        while True:
            cut = self._next_cut()
            if cut is None:
                break
            out.append(self._buf[:cut])
            self._buf, self._scan = self._buf[cut:], 0
        return out

    def flush(self) -> str | None:
        """The rest of the stream, once it has ended (None: nothing left)."""
        rest, self._buf, self._scan = self._buf, "", 0
        return rest or None

    def _next_cut(self) -> int | None:
        buf = self._buf
        i = self._scan
        while i < len(buf) - 1:  # buf[i + 1] is the lookahead
            ch = buf[i]
            if ch in ENDS or (ch in CLAUSES and i + 1 >= self.clause_chars):
                end = i + 1
                while end < len(buf) and buf[end] in CLOSERS:
                    end += 1
                if end >= len(buf):
                    break  # the character after the closers has not arrived
                if buf[end].isspace() and (ch not in "." or not self._abbreviation(buf, i)):
                    return end
            if i + 1 >= self.max_chars:
                return self._forced_cut(buf)
            i += 1
        self._scan = i
        if len(buf) > self.max_chars:
            return self._forced_cut(buf)
        return None

    def _forced_cut(self, buf: str) -> int:
        """At the last whitespace of the first max_chars characters (the whitespace starts the next piece), or at
        max_chars when there is none."""
        head = buf[: self.max_chars]
        space = max((k for k, c in enumerate(head) if c.isspace()), default=0)
        return space if space > 0 else self.max_chars

    @staticmethod
    def _abbreviation(buf: str, dot: int) -> bool:
        """Whether the `.` at `dot` ends an abbreviation, an initial or a dotted token rather than a sentence."""
        start = dot
        while start > 0 and not buf[start - 1].isspace():
            start -= 1
        token = buf[start:dot].lstrip("\"'([{“‘«")
        if not token or token.endswith(".."):  # an ellipsis ends a sentence
            return False
        if "." in token or (len(token) == 1 and token.isalpha()):
            return True
        return token.lower() in ABBREVIATIONS
