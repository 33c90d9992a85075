"""peer: a 64 MiB WRITE and READ against `doctor --serve` on the other host,
byte-checked, with GB/s each way; and serve(), that other side."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import time

from mooncake_connector import json_in

from .auth import _secret
from .hosts import _route_src, _split_hp
from .report import FAIL, OK


PEER_BYTES = 64 << 20
HELLO = b"mooncake-doctor-hello"


def _engine(host, cfg):
    import mooncake_connector as mc

    eng = mc.TransferEngine()
    proto = cfg["protocol"] if cfg else "tcp"
    dev = cfg["device_name"] if cfg else ""
    eng.initialize(host, "P2PHANDSHAKE", proto, dev, auth_secret=_secret(cfg)[0] or None)
    return eng


def serve(listen, cfg, seconds, out=sys.stdout):
    """The peer side of --peer: an engine at `listen` (P2P) with a 64 MiB
    buffer; answers each hello with the buffer's address."""
    eng = _engine(listen, cfg)
    buf = ctypes.create_string_buffer(PEER_BYTES)
    addr = ctypes.addressof(buf)
    eng.register_memory(addr, PEER_BYTES)
    seg = eng.get_segment_name()
    print(f"doctor serving at {seg} (64 MiB); on the other host run: "
          f"mooncake-connector doctor --peer {seg}", file=out, flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    end = time.monotonic() + seconds if seconds else None
    try:
        while not stop and (end is None or time.monotonic() < end):
            for sender, msg in eng.get_notifies():
                if msg == HELLO:
                    reply = json.dumps({"addr": addr, "size": PEER_BYTES}).encode()
                    try:
                        eng.send_notify(sender, reply)
                    except Exception as e:  # that client went away
                        print(f"doctor: reply to {sender} failed: {e}", file=out, flush=True)
            time.sleep(0.01)
    except KeyboardInterrupt:
        pass
    finally:
        eng.close()
    return 0


def _answer(msg):
    """The buffer address in `doctor --serve`'s answer to the hello
    ({"addr": A, "size": 67108864}), or ValueError saying what came."""
    try:
        reply = json_in.loads(msg)
    except ValueError as e:  # UnicodeDecodeError too
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(reply, dict) or type(reply.get("addr")) is not int or \
            reply.get("size") != PEER_BYTES or not 0 < reply["addr"] < 1 << 64:
        raise ValueError(f"not a doctor's answer: {msg[:80]!r}")
    return reply["addr"]


def check_peer(rep, peer, cfg, timeout):
    import mooncake_connector as mc

    try:
        host, _ = _split_hp(peer)
    except ValueError as e:
        rep.add("peer", peer, FAIL, f"not HOST:PORT ({e})", "give --peer the address `doctor "
                "--serve` printed on the other host")
        return
    try:
        local = _route_src(host) or "127.0.0.1"
    except (socket.gaierror, UnicodeError) as e:
        why = e.strerror if isinstance(e, socket.gaierror) else str(e)
        rep.add("peer", peer, FAIL, f'host "{host}" does not resolve ({why})',
                "give --peer the address `doctor --serve` printed on the other host, or add "
                "the name to /etc/hosts / DNS")
        return
    try:
        eng = _engine(local, cfg)
    except mc.MooncakeError as e:
        rep.add("peer", peer, FAIL, f"cannot start a local engine on {local}: {e}",
                "fix the engine checks above first")
        return
    buf = ctypes.create_string_buffer(PEER_BYTES)
    back = ctypes.create_string_buffer(PEER_BYTES)
    try:
        try:
            eng.send_notify(peer, HELLO, timeout)
            addr, bad, end = None, None, time.monotonic() + timeout
            while addr is None and bad is None and time.monotonic() < end:
                for _, msg in eng.get_notifies():
                    try:
                        addr = _answer(msg)
                    except ValueError as e:
                        bad = e
                time.sleep(0.01)
            if addr is None and bad is not None:
                rep.add("peer", peer, FAIL, f"handshake: {peer} answered {bad}",
                        f"give --peer the address `mooncake-connector doctor --serve` printed "
                        f"on {host} (another program listens there), with the same package "
                        "version on both hosts")
                return
            if addr is None:
                raise mc.TransferTimeout(f"no answer from {peer} within {timeout:.0f} s")
        except mc.MooncakeError as e:
            if getattr(e, "code_name", "") == "MC_EAUTH" or "authenticat" in str(e).lower():
                rep.add("peer", peer, FAIL, f"handshake: {e}",
                        "the two hosts use different shared secrets (or only one has one): set "
                        'the same "auth_secret" in mooncake.json (or MC_AUTH_SECRET) on both, and '
                        "restart `doctor --serve`")
                return
            rep.add("peer", peer, FAIL, f"handshake: {e}",
                    f"run `mooncake-connector doctor --serve --listen {peer}` on {host} and open "
                    f"TCP port {peer.rsplit(':', 1)[1]} (and the engine's ports) between the hosts")
            return
        ctypes.memmove(buf, os.urandom(PEER_BYTES), PEER_BYTES)
        eng.batch_register_memory([ctypes.addressof(buf), ctypes.addressof(back)],
                                  [PEER_BYTES, PEER_BYTES])
        for op in ("write", "read"):
            local_buf = buf if op == "write" else back
            t0 = time.perf_counter()
            try:
                getattr(eng, f"transfer_sync_{op}")(peer, ctypes.addressof(local_buf),
                                                    addr, PEER_BYTES)
            except mc.MooncakeError as e:
                rep.add("peer", f"{op} 64 MiB", FAIL, str(e),
                        "the handshake worked but the data path did not: check the RDMA/TCP "
                        "checks above on both hosts (MTU, GID, firewall for the data ports)")
                return
            dt = time.perf_counter() - t0
            rep.add("peer", f"{op} 64 MiB", OK,
                    f"{'to' if op == 'write' else 'from'} {peer}: {PEER_BYTES / dt / 1e9:.2f} GB/s "
                    f"({dt * 1e3:.1f} ms, {cfg['protocol'] if cfg else 'tcp'})")
        if back.raw != buf.raw:
            rep.add("peer", "data", FAIL, "bytes read back differ from the bytes written",
                    "a NIC, driver or the peer's memory corrupts data: report it with both "
                    "hosts' `doctor --json`")
        else:
            rep.add("peer", "data", OK, "64 MiB written and read back byte for byte")
    finally:
        eng.close()
