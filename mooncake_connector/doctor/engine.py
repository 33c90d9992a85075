"""engine: this host's engine address (prefill_url or decode_url), its
interface, its ports free to bind, its route to the other engine."""
from __future__ import annotations

import errno
import ipaddress
import os
import socket

from .hosts import _hp, _is_loopback, _local_addrs, _resolve, _route_src, _split_hp
from .report import FAIL, OK, WARN


def engine_ports(port, tp, pp=1, dp=1):
    """[(port, (dp engine, pp stage, tp rank))] of a server whose engine URL
    has `port`: vLLM data-parallel engine k's ranks start at port + k * tp *
    pp (the connector's settings.dp_base), stage s's at + s * tp, rank r at
    + r."""
    return [(port + k * tp * pp + s * tp + r, (k, s, r))
            for k in range(dp) for s in range(pp) for r in range(tp)]


def _rank_label(where, tp, pp, dp):
    """" (DP engine k, PP stage s, TP rank r)", naming only the sizes over 1."""
    k, s, r = where
    parts = [f"DP engine {k}" if dp > 1 else "", f"PP stage {s}" if pp > 1 else "",
             f"TP rank {r}" if tp > 1 else ""]
    parts = [p for p in parts if p]
    return f" ({', '.join(parts)})" if parts else ""


def check_engine(rep, cfg, role, tp, pp=1, dp=1):
    local = _local_addrs()
    sides = {"prefill": cfg["prefill_url"], "decode": cfg["decode_url"]}
    resolved = {k: _resolve(_split_hp(v)[0]) for k, v in sides.items()}
    for k, v in sides.items():
        if not resolved[k]:
            rep.add("engine", f"{k}_url", FAIL, f"host of {v} does not resolve here",
                    f"use an IP address in {k}_url, or add the name to /etc/hosts / DNS")
    if role:
        mine = [role]
    else:
        mine = [k for k in sides if any(a in local for a in resolved[k])]
    if not mine:
        if all(resolved.values()):
            here = ", ".join(f"{a} ({i})" for a, i in sorted(local.items()) if not _is_loopback(a))
            rep.add("engine", "address", FAIL,
                    f"neither prefill_url ({sides['prefill']}) nor decode_url ({sides['decode']}) "
                    "is an address of this host",
                    f"run doctor on the prefill or decode host, or write this host's address into "
                    f"the URL for it (addresses here: {here or 'none but loopback'})")
        return
    for side in mine:
        other = "decode" if side == "prefill" else "prefill"
        host, port = _split_hp(sides[side])
        addr = next((a for a in resolved[side] if a in local), (resolved[side] or [host])[0])
        ifname = local.get(addr, "?")
        if addr not in local:
            rep.add("engine", f"{side}_url", FAIL, f"{host} ({addr}) is not an address of this host",
                    f"write an address of this host into {side}_url, or run doctor on {host} "
                    f"(addresses here: {', '.join(sorted(local))})")
            continue
        other_host = _split_hp(sides[other])[0]
        other_addrs = resolved[other]
        if _is_loopback(addr) and other_addrs and not any(a in local for a in other_addrs):
            src = _route_src(other_host)
            rep.add("engine", f"{side}_url", FAIL,
                    f"{host} is a loopback address, but the {other} engine ({other_host}) is on "
                    "another host and cannot reach it",
                    f"write this host's address towards {other_host} into {side}_url"
                    + (f" ({src}, on {local.get(src, '?')})" if src else ""))
            continue
        detail = f"{addr} on {ifname}"
        status, fix = OK, ""
        if other_addrs and not any(a in local for a in other_addrs):
            src = _route_src(other_host)
            if src and src != addr and not ipaddress.ip_address(addr).is_unspecified:
                status = WARN
                fix = (f"traffic to the {other} host {other_host} leaves from {src} "
                       f"({local.get(src, '?')}), not {addr} ({ifname}): use {src} in {side}_url "
                       "unless the other interface is meant (routing may be asymmetric)")
            detail += f"; route to {other} host {other_host} from {src or '?'}"
        rep.add("engine", f"{side}_url", status, detail, fix)
        _check_ports(rep, side, addr, port, tp, pp, dp)


def _check_ports(rep, side, addr, port, tp, pp, dp):
    """Every port of the server's engines (engine_ports) free to bind; with
    data parallelism first a row naming them."""
    ports = engine_ports(port, tp, pp, dp)
    last = ports[-1][0]
    item = f"{side} DP ports" if dp > 1 else f"{side} ports"
    sizes = f"vLLM data parallelism {dp} x TP {tp} x PP {pp}" if dp > 1 else f"TP {tp} x PP {pp}"
    if last > 65535:
        rep.add("engine", item, FAIL, f"{sizes}: ports {port}-{last}, past 65535",
                f"pick a port of at most {65536 - len(ports)} in {side}_url")
    elif dp > 1:
        firsts = ", ".join(f"engine {k} from {port + k * tp * pp}" for k in range(1, dp))
        rep.add("engine", item, OK, f"{sizes}: ports {port}-{last} (engine 0 from {port}, "
                f"{firsts})")
    hint = ("(data-parallel engine k's ranks use port + k x TP x PP + stage x TP + rank)"
            if dp > 1 else "(PP stages and TP ranks use port + stage x TP + rank)" if pp > 1
            else "(TP ranks use port + rank)" if tp > 1 else "")
    for p, where in ports:
        if p > 65535:
            return
        _check_bind(rep, side, addr, p, where[2], tp, _rank_label(where, tp, pp, dp), hint)


def _check_bind(rep, side, addr, port, rank, tp, label=None, hint=None):
    """Binds the way the engine's TCP transport will: MC_TCP_BIND_ADDRESS, else
    "::" for an IPv6 engine address, else 0.0.0.0 (every interface).  label:
    the port's ranks after its number; hint: how the server's ports are
    laid out, for the fix (defaults: TP only)."""
    if label is None:
        label = f" (TP rank {rank})" if tp > 1 else ""
    if hint is None:
        hint = "(TP ranks use port + rank)" if tp > 1 else ""
    item = f"{side} port {port}{label}"
    bind = os.environ.get("MC_TCP_BIND_ADDRESS") or ("::" if ":" in addr else "0.0.0.0")
    fam = socket.AF_INET6 if ":" in bind else socket.AF_INET
    addr = bind
    try:
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((bind, port))
            s.listen(1)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            fix = (f"another process listens on {port} (a running vLLM or engine? "
                   f"`ss -ltnp 'sport = :{port}'`): stop it, or pick a free port in {side}_url "
                   + hint)
        elif e.errno == errno.EACCES:
            fix = f"ports below 1024 need root: use a port of 1024 or more in {side}_url"
        else:
            fix = f"pick another address/port in {side}_url"
        rep.add("engine", item, FAIL, f"cannot bind {_hp(addr, port)}: {e.strerror}", fix.strip())
        return
    rep.add("engine", item, OK, f"{_hp(addr, port)} is free to bind")
