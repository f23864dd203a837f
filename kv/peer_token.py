"""What a peer token must be (docs/security.md): checked where a library user gives one
(:class:`kv.mooncake_engine.MooncakeConfig`) and where ``pdlife serve`` reads one."""

from __future__ import annotations

#: The shortest peer token accepted: anyone who guesses it can take part in KV transfers.
MIN_PEER_TOKEN_CHARS = 16
#: A command that makes a good one.
MAKE_PEER_TOKEN = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


def peer_token_problem(token: str | None) -> str:
    """What is wrong with ``token`` as a peer token ("" when nothing is, or it is None): it
    travels in an HTTP header, and a short one can be guessed."""
    if token is None:
        return ""
    if not isinstance(token, str) or not token or not all("!" <= c <= "~" for c in token):
        return ("must be visible ASCII characters without spaces (it travels in an HTTP "
                "header)")
    if len(token) < MIN_PEER_TOKEN_CHARS:
        return (f"has {len(token)} characters, fewer than {MIN_PEER_TOKEN_CHARS}; make one "
                f"with: {MAKE_PEER_TOKEN}")
    return ""
