"""Whether W&B credentials are configured on this machine, found without the network.

The service asks before any rank starts: an online run (``logger.wandb.offline=false``) without
credentials would otherwise fail inside ``wandb.init`` on rank 0, after the job's other ranks were
launched; ``offline=auto`` picks offline mode without them. ``syncbn-dashboard`` asks before it
talks to the W&B server.

Credentials are what ``wandb.init`` itself would find for the configured server
(``WANDB_BASE_URL`` or the ``base_url`` of W&B's settings): ``WANDB_API_KEY``,
``WANDB_IDENTITY_TOKEN_FILE``, a ``wandb login`` entry in ``~/.netrc`` (or ``$NETRC``), or an API
key in W&B's settings. Nothing is verified against the server and nothing is prompted.
"""

from __future__ import annotations

import contextlib
import logging
import netrc
import os
from typing import Any
from urllib.parse import urlparse

__all__ = [
    "LOGIN_HINT",
    "check_wandb",
    "has_wandb_credentials",
    "netrc_login",
    "wandb_mode_offline",
    "wandb_offline",
]

log = logging.getLogger(__name__)

#: How to get credentials, for error messages.
LOGIN_HINT = "run `wandb login` (or set WANDB_API_KEY)"

_DEFAULT_HOST = "api.wandb.ai"


def wandb_mode_offline() -> bool:
    """Whether ``WANDB_MODE`` makes every run offline or disabled (no credentials needed)."""
    return os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled")


def has_wandb_credentials() -> bool:
    """Whether ``wandb.init`` in online mode would find credentials, without the network.

    Uses W&B's own lookup (``wandb.sdk.lib.wbauth``, with prompting and session updates off), so
    that a custom server (``WANDB_BASE_URL``) and every source W&B reads are honoured; with a
    W&B version without it, ``WANDB_API_KEY`` or a ``~/.netrc`` entry for the W&B host.

    Returns:
        True when credentials for the configured W&B server exist (they may still be rejected
        by the server; that is not checked).
    """
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth
    except ImportError:  # a W&B without wbauth (< 0.22): the sources it read back then
        return netrc_login(os.environ.get("WANDB_BASE_URL", ""))
    try:
        host = wandb_setup.singleton().settings.base_url
        auth = wbauth.authenticate_session(
            host=host, source="syncbn", prompt=False, update_session=False
        )
    except Exception as e:  # a malformed key or settings file: wandb.init would fail too
        log.warning("W&B credentials could not be read (%s); treating them as missing", e)
        return False
    return auth is not None


def netrc_login(base_url: str) -> bool:
    """Whether ``~/.netrc`` (or ``$NETRC``) has a login for the W&B host of ``base_url``."""
    host = urlparse(base_url).hostname or _DEFAULT_HOST
    with contextlib.suppress(FileNotFoundError, netrc.NetrcParseError, OSError):
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    return False


def wandb_offline(setting: Any) -> bool:
    """``auto``: offline when ``WANDB_MODE`` says so, or unless ``WANDB_API_KEY`` is set or
    ``~/.netrc`` has a W&B login (``wandb login`` writes it). Not W&B's full lookup
    (:func:`has_wandb_credentials`, used to refuse ``offline=false``): in CI a
    multirun's ranks went online with it and failed in ``wandb.init`` for want of a key."""
    if setting != "auto":
        return bool(setting)
    if os.environ.get("WANDB_MODE") in ("offline", "dryrun"):
        return True
    base_url = os.environ.get("WANDB_BASE_URL", "")
    return not (os.environ.get("WANDB_API_KEY") or netrc_login(base_url))


def check_wandb(offline: Any, log_model: Any) -> bool:
    """Check ``offline`` and ``log_model`` of ``logger.wandb``; returns whether the run is offline.

    Needs no network: an online run (``offline=false``) without W&B credentials on this machine
    is refused here, before any rank starts, instead of failing in ``wandb.init`` on rank 0
    (``WANDB_MODE=offline`` or ``disabled`` need none).

    Raises:
        ValueError: the message starts with the offending argument's name.
    """
    if offline not in ("auto", True, False):
        raise ValueError(f"offline={offline!r}: use auto, true or false")
    if log_model not in (True, False, "all"):
        raise ValueError(f"log_model={log_model!r}: use false, true (at the end) or all")
    is_offline = wandb_offline(offline)
    if not is_offline and not wandb_mode_offline() and not has_wandb_credentials():
        raise ValueError(
            f"offline=false: this machine has no W&B API key for an online run; {LOGIN_HINT}, "
            f"or log offline with offline=auto (or true) and upload later with `wandb sync`"
        )
    if log_model and is_offline:
        cause = (
            "offline=true"
            if offline is True
            else "offline=auto: no W&B login, or WANDB_MODE=offline"
        )
        raise ValueError(
            f"log_model={log_model!r}: checkpoints cannot be uploaded from an offline run "
            f"({cause}); log in (wandb login) and set offline=auto or false, or leave "
            f"log_model=false"
        )
    return is_offline
