"""The worst sequence of two logprob files replayed through a session: where the engines part, and why.

The sequence's first token is the prompt and the rest, up to the token with the largest |log-ratio|, is
forced on both sides, so the reference and the subject consume exactly the tokens the outside engines
scored; the logits at the last position are the ones that predicted that token. The first far key of the
run is where the two sides part, and graft (session/graft.py) names every source from there.
"""
from __future__ import annotations

from ..errors import UsageError
from ..trace.compare import Tolerance
from .graft import DEFAULT_LIMIT, GraftResult, graft
from .session import Session


def replay_tokens(token_ids: list[int], index: int, vocab: int, max_positions: int) -> tuple[list[int], list[int]]:
    """(prompt, forced tokens) covering the positions up to the one that predicts token_ids[index]; at least
    one forced token (the prompt's own position is the reference's prefill, never compared)."""
    end = max(index, 2)  # positions 0 .. end-1: the last predicts token_ids[index]
    if end > len(token_ids):
        raise UsageError(f"the worst sequence has {len(token_ids)} token(s): too few to replay (a prompt token and"
                         f" a forced one)")
    ids = token_ids[:end]
    if end > max_positions:
        raise UsageError(f"the worst token is at position {index}, past the model's {max_positions} positions;"
                         f" the replay needs the whole sequence before it")
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise UsageError(f"token id {bad} of the worst sequence is past the model's vocabulary ({vocab});"
                         f" give the model the files were scored with (--model or the profile's)")
    return ids[:1], ids[1:]


def replay_worst(model, token_ids: list[int], index: int, reference, subject, *, kv: str, deep: bool,
                 tol: Tolerance, limit: int = DEFAULT_LIMIT) -> tuple[Session, GraftResult]:
    """The session over the worst sequence and graft from its first far key (raises SideFailed as graft does)."""
    prompt, forced = replay_tokens(token_ids, index, model.cfg.vocab, model.cfg.max_positions)
    session = Session(model, prompt, len(forced), reference=reference, subject=subject, kv=kv, deep=deep,
                      forced=forced)
    if not session.reference_engine.caps.forcing:
        raise UsageError(f"the reference {session.reference_engine.name} decodes its own tokens: it cannot replay"
                         f" the file's; use a reference that takes forced tokens")
    if not session.subject_engine.caps.forcing:
        raise UsageError(f"the subject {session.subject} decodes its own tokens: it cannot replay the file's;"
                         f" use a subject that takes forced tokens")
    return session, graft(session, session.initial_settings(), tol=tol, limit=limit)
