"""auth: peer authentication on or off, where the secret comes from, a short
secret, two secrets that differ, exposed engines without one."""
from __future__ import annotations

import os

from .hosts import _is_loopback, _resolve, _split_hp
from .report import OK, WARN


MIN_SECRET_BYTES = 16


def _secret(cfg):
    """(secret, where it comes from) as the engine picks it: mooncake.json's
    auth_secret, else MC_AUTH_SECRET, else off (docs/security.md)."""
    if cfg and cfg.get("auth_secret"):
        return cfg["auth_secret"], "auth_secret in " + cfg["origin"]
    env = os.environ.get("MC_AUTH_SECRET", "")
    if env:
        return env, "environment MC_AUTH_SECRET"
    return "", ""


def check_auth(rep, cfg):
    secret, where = _secret(cfg)
    env = os.environ.get("MC_AUTH_SECRET", "")
    hosts = [_split_hp(cfg[f"{s}_url"])[0] for s in ("prefill", "decode")]
    exposed = [h for h in hosts if not all(_is_loopback(a) for a in _resolve(h) or [h])]
    if not secret:
        if exposed:
            rep.add("auth", "peer authentication", WARN,
                    f"off: any host that reaches the engine ports on {', '.join(exposed)} can "
                    "read and write the registered KV memory",
                    'set the same "auth_secret" in mooncake.json on every host (or export '
                    "MC_AUTH_SECRET), e.g. the output of `python3 -c 'import secrets; "
                    "print(secrets.token_hex(16))'` (docs/security.md)")
        else:
            rep.add("auth", "peer authentication", OK, "off (both engines on loopback addresses)")
        return
    n = len(secret.encode())
    if n < MIN_SECRET_BYTES:
        rep.add("auth", "peer authentication", WARN,
                f"on ({where}), but the secret is {n} bytes: short secrets can be guessed",
                f"use at least {MIN_SECRET_BYTES} random bytes, e.g. `python3 -c 'import secrets; "
                "print(secrets.token_hex(16))'`, the same on every host")
    else:
        rep.add("auth", "peer authentication", OK, f"on ({where}, {n} bytes)")
    if env and cfg.get("auth_secret") and env != cfg["auth_secret"]:
        rep.add("auth", "MC_AUTH_SECRET", WARN,
                f"differs from auth_secret in {cfg['origin']}; the file's secret is used and the "
                "environment's is ignored",
                "unset MC_AUTH_SECRET or make it equal to the file's auth_secret, so every "
                "process on this host uses one secret")
