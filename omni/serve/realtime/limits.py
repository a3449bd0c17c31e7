"""What one `/v1/realtime` session may hold, so that no client can starve the server or fill its memory:

    responses at once     --max-session-responses (the conversation's and the out-of-band ones); one more
                          response.create is an `error` event (code session_response_limit)
    server admission      every response and transcription is a pipeline request counted against
                          runtime.max_pending_requests, as an HTTP request is (ServerState.admit); past it an
                          `error` event (type server_error, code overloaded), as HTTP's 503
    conversation          --max-conversation-items items and --max-conversation-mb of text, audio at the model's
                          rate and images; an item past either is refused (code conversation_too_large), naming
                          the bound and how to go on (conversation.item.delete)

The input audio buffer has its own bound (realtime/input_audio.py: buffer_too_large).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from omni.serve.http.errors import ApiError
from omni.serve.protocol.realtime import RealtimeEventError
from omni.serve.realtime.conversation import ConvItem

if TYPE_CHECKING:
    from omni.serve.realtime.session import Session

_MIB = 2**20


def admit_response(session: Session, event_id: str | None) -> None:
    """Room for one more response of `session`: its own bound, then the server's admission (counted until
    `release` once the response ends)."""
    limit = session.server.settings.max_session_responses
    running = (session.response is not None) + len(session.out_of_band)
    if running >= limit:
        raise RealtimeEventError(f"response.create: this session runs {running} responses, its limit "
                                 f"(--max-session-responses {limit}); wait for a response.done or cancel one",
                                 None, "session_response_limit", event_id)
    admit(session, event_id)


def admit(session: Session, event_id: str | None) -> None:
    """One pipeline request of the session counted in the server's admission (runtime.max_pending_requests)."""
    try:
        session.server.state.admit()
    except ApiError as e:
        raise RealtimeEventError(e.message, None, e.code or "overloaded", event_id, e.type) from None


def release(session: Session) -> None:
    session.server.state.release(None, "")


def check_room(session: Session, item: ConvItem, event_id: str | None) -> None:
    """`item` fits the session's conversation, or the error naming the bound it would pass."""
    settings, conversation = session.server.settings, session.conversation
    if len(conversation.items) >= settings.max_conversation_items:
        raise RealtimeEventError(f"the conversation holds {len(conversation.items)} items, its limit "
                                 f"(--max-conversation-items {settings.max_conversation_items}); delete items "
                                 "(conversation.item.delete) to add more", None, "conversation_too_large", event_id)
    held, adding = conversation.nbytes, item.nbytes
    if held + adding > settings.max_conversation_bytes:
        raise RealtimeEventError(f"the item ({adding / _MIB:.2f} MiB) would take the conversation to "
                                 f"{(held + adding) / _MIB:.2f} MiB, past its limit (--max-conversation-mb "
                                 f"{settings.max_conversation_bytes / _MIB:g}); delete items "
                                 "(conversation.item.delete) to add more", None, "conversation_too_large", event_id)
