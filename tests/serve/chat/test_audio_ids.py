"""omni/serve/state.py: a spoken reply's transcript by audio id, until its expires_at, the oldest leaving first."""
from __future__ import annotations

from omni.serve.state import AudioTranscripts


def test_transcripts_expire_and_the_oldest_leave_first():
    now = [1000.0]
    store = AudioTranscripts(ttl_s=60, max_entries=2, clock=lambda: now[0])
    store.put("a", "first", expires_at=1060)
    store.put("b", "second", expires_at=1030)
    assert (store.get("a"), store.get("b"), store.get("c")) == ("first", "second", None)
    now[0] = 1030.0
    assert store.get("b") is None and store.get("a") == "first"  # b expired at 1030
    store.put("c", "third", expires_at=1090)
    store.put("d", "fourth", expires_at=1090)  # over max_entries: a, the oldest, leaves
    assert store.get("a") is None and (store.get("c"), store.get("d")) == ("third", "fourth") and len(store) == 2
