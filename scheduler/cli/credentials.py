"""The secrets ``pdlife serve`` reads: the peer token and the API key (docs/security.md).

The peer token never comes from the command line, where ``ps`` shows it to every user of the
machine: it is read from ``--peer-token-file`` or, failing that, from ``PDLIFE_PEER_TOKEN``.
The API key is SGLang's ``--api-key`` (a flag, for compatibility); ``PDLIFE_API_KEY`` gives it
without the flag. Both travel in HTTP headers, so they must be visible ASCII without spaces.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping

from kv.peer_token import peer_token_problem
from scheduler.cli.command import UsageError

logger = logging.getLogger(__name__)

PEER_TOKEN_ENV = "PDLIFE_PEER_TOKEN"
API_KEY_ENV = "PDLIFE_API_KEY"


def _checked(secret: str, what: str) -> str:
    if not secret:
        raise UsageError(f"{what} is empty")
    if not all("!" <= c <= "~" for c in secret):
        raise UsageError(f"{what} must be visible ASCII characters without spaces (it travels "
                         "in an HTTP header)")
    return secret


def peer_token(path: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The peer token from the file at ``path`` (its first line), else from
    ``PDLIFE_PEER_TOKEN``; None when neither is given."""
    if path is not None:
        try:
            with open(path) as f:
                mode = os.fstat(f.fileno()).st_mode
                secret = f.readline().strip()
        except OSError as exc:
            raise UsageError(f"--peer-token-file {path}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("peer token file %s is open to users other than its owner (mode %o): "
                           "chmod 600 it (a Kubernetes Secret volume: defaultMode 0400)", path,
                           stat.S_IMODE(mode))
        if PEER_TOKEN_ENV in environ:
            logger.warning("both --peer-token-file and %s are set: the file's token is used",
                           PEER_TOKEN_ENV)
        what = f"the peer token in {path}"
    elif PEER_TOKEN_ENV in environ:
        secret, what = environ[PEER_TOKEN_ENV].strip(), PEER_TOKEN_ENV
    else:
        return None
    if not secret:
        raise UsageError(f"{what} is empty")
    problem = peer_token_problem(secret)
    if problem:
        raise UsageError(f"{what} {problem}")
    return secret


def api_key(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The API key from ``--api-key``, else from ``PDLIFE_API_KEY``; None when neither is
    given."""
    if flag is not None:
        return _checked(flag, "--api-key")
    if API_KEY_ENV in environ:
        return _checked(environ[API_KEY_ENV].strip(), API_KEY_ENV)
    return None
