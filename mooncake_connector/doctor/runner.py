"""doctor's command line: parses the arguments, runs the checks in order (one
broken check does not hide the others) and prints the report."""
from __future__ import annotations

import argparse
import os
import socket
import sys

from .auth import check_auth
from .config import check_config, check_kv_transfer_config
from .engine import check_engine
from .gpu import check_gpu
from .hosts import _hp, _is_loopback, _local_addrs, _resolve, _split_hp
from .metadata import check_metadata
from .peer import check_peer, serve
from .rdma import check_rdma
from .report import FAIL, Report
from .same_host import check_same_host
from .vllm_plugin import check_vllm


ROLE_SIDES = {"kv_producer": "prefill", "kv_consumer": "decode"}  # kv_role -> --role


def build_parser():
    ap = argparse.ArgumentParser(prog="mooncake-connector doctor",
                                 description="Checks this host's mooncake-connector setup.")
    ap.add_argument("--config", help="mooncake.json (default: $MOONCAKE_CONFIG_PATH)")
    ap.add_argument("--kv-transfer-config", metavar="JSON", default=None,
                    help="the JSON given to vLLM's --kv-transfer-config: checked with the "
                    "mooncake.json as the server's start takes them; its kv_role is --role's "
                    "default")
    ap.add_argument("--peer", metavar="HOST:PORT",
                    help="run a 64 MiB transfer each way against `doctor --serve` there")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--role", choices=("prefill", "decode"),
                    help="which engine runs here (default: whichever URL is an address here)")
    # vLLM's own spellings too, so its serve arguments can be given as they are.
    ap.add_argument("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                    help="tensor-parallel size: ports port..port+tp-1")
    ap.add_argument("--pp", "-pp", "--pipeline-parallel-size", dest="pp", type=int, default=1,
                    help="pipeline-parallel size: stage s's ranks from port + s*tp")
    ap.add_argument("--dp", "-dp", "--data-parallel-size", dest="dp", type=int, default=1,
                    help="vLLM data-parallel engines of this server (its --data-parallel-size, "
                         "or --data-parallel-size-local where set): engine k's ports from "
                         "port + k*tp*pp")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds for the peer handshake")
    ap.add_argument("--serve", action="store_true",
                    help="be the peer for another host's `doctor --peer`")
    ap.add_argument("--listen", default=None, metavar="HOST:PORT",
                    help="with --serve: engine address (default: this host's prefill/decode URL "
                         "from --config, else its first non-loopback address, a free port)")
    ap.add_argument("--seconds", type=float, default=0, help="with --serve: stop after this long")
    return ap


def _default_listen(cfg, role):
    """This host's engine URL from the config, else its first non-loopback
    address (port picked by the kernel)."""
    local = _local_addrs()
    if cfg:
        for side in ([role] if role else ["prefill", "decode"]):
            host, port = _split_hp(cfg[f"{side}_url"])
            if any(a in local for a in _resolve(host)):
                return _hp(host, port)
    addrs = [a for a in local if not _is_loopback(a) and ":" not in a]
    # No port: the engine takes a free one ("host:0" is refused as a name).
    return addrs[0] if addrs else "127.0.0.1"


def _example_addr(addrs):
    """An address of this host for an example: a routable IPv4 one, else a
    routable IPv6 one (not link-local: it would need its interface), else
    loopback (127.0.0.1, or ::1 on an IPv6-only host)."""
    import ipaddress
    ips = []
    for a in addrs:
        try:
            ips.append(ipaddress.ip_address(a))
        except ValueError:
            pass
    for want in ((4, False), (6, False), (4, True), (6, True)):
        for ip in ips:
            if ip.version == want[0] and ip.is_loopback == want[1] and not ip.is_link_local:
                return str(ip)
    return "127.0.0.1"


def _listen_host_problem(listen):
    """Why --listen's host cannot be served at (it does not resolve), or
    None.  The engine listens on 0.0.0.0 and advertises the name as given,
    so an unresolvable one "served" where no peer could reach it.  The
    address's form (port range, brackets) is the engine's to check."""
    if listen.startswith("["):
        host = listen[1:].partition("]")[0]
    elif listen.count(":") > 1:
        return None  # IPv6 without brackets: the engine says how to write it
    else:
        host = listen.partition(":")[0]
    if not host:
        return None
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        why = e.strerror if isinstance(e, socket.gaierror) else str(e)
        example = _hp(_example_addr(_local_addrs()), 17000)
        return (f'host "{host}" does not resolve ({why}); give an address of this host '
                f"(e.g. --listen {example}) or add the name to /etc/hosts / DNS")
    return None


def _listen_not_here(listen):
    """A note when --listen's host resolves to no address of this host
    (the engine listens on every address of this host but tells peers that
    name: "serving at 8.8.8.8" went on without a word, and every peer then
    reached another machine), else None.  A note, not a refusal: behind a
    1:1 NAT the address peers reach is not on any interface here."""
    host = listen[1:].partition("]")[0] if listen.startswith("[") else listen.partition(":")[0]
    if not host or listen.count(":") > 1 and not listen.startswith("["):
        return None
    addrs = set(_resolve(host))
    local = _local_addrs()
    if not addrs or addrs & set(local) or any(_is_loopback(a) for a in addrs):
        return None
    mine = [a for a in local if not _is_loopback(a) and ":" not in a][:4]
    return (f'host "{host}" ({", ".join(sorted(addrs))}) is no address of this host '
            f"(it has {', '.join(mine) or 'only loopback addresses'}); the peer is told to "
            "connect there: right only behind a NAT that forwards it here, else give "
            "--listen an address of this host")


#: --tp at most (vLLM's tensor-parallel sizes are far below; ports port..port+tp-1)
MAX_TP = 1024
#: --timeout at most: the engine's bound on a handshake's timeout
MAX_TIMEOUT_S = 86400


def run(argv=None, out=sys.stdout):
    args = build_parser().parse_args(argv)
    for flag in ("tp", "pp", "dp"):
        if getattr(args, flag) < 1:
            print(f"doctor: --{flag} must be >= 1", file=sys.stderr)
            return 2
    if args.tp * args.pp * args.dp > MAX_TP:
        # --tp 100000 bound-checked 65,535 ports, printed a line each, then
        # failed with "the check itself failed: OverflowError" past the last
        print(f"doctor: --tp x --pp x --dp must be at most {MAX_TP} (one port each), not "
              f"{args.tp * args.pp * args.dp}", file=sys.stderr)
        return 2
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # also NaN
        # 1e308 was "the check itself failed: ValueError", "report this"
        print(f"doctor: --timeout must be a number of seconds in (0, {MAX_TIMEOUT_S}], not "
              f"{args.timeout}", file=sys.stderr)
        return 2
    if not 0 <= args.seconds < float("inf"):
        print(f"doctor: --seconds must be a number of seconds >= 0 (0: until Ctrl-C), not "
              f"{args.seconds}", file=sys.stderr)
        return 2
    rep = Report()
    cfg = None
    if args.config or os.environ.get("MOONCAKE_CONFIG_PATH") or not (args.serve or args.peer):
        cfg = check_config(rep, args.config)
    if args.serve:
        if rep.failed:
            print(rep.table(), file=out)
            return 1
        if args.listen:
            problem = _listen_host_problem(args.listen)
            if problem:
                print(f"doctor: --listen {args.listen}: {problem}", file=sys.stderr)
                return 2
            note = _listen_not_here(args.listen)
            if note:
                print(f"doctor: warning: --listen {args.listen}: {note}", file=sys.stderr)
        listen = args.listen or _default_listen(cfg, args.role)
        try:
            return serve(listen, cfg, args.seconds, out)
        except Exception as e:  # MooncakeError: bad --listen, port taken, no NIC...
            print(f"doctor --serve: cannot serve at {listen}: {e}", file=sys.stderr)
            return 1
    role = args.role
    if args.kv_transfer_config is not None:
        ktc = check_kv_transfer_config(rep, args.kv_transfer_config, args.config)
        if ktc and role is None and ktc["role"] in ROLE_SIDES:
            role = ROLE_SIDES[ktc["role"]]
    origin = cfg["origin"] if cfg else ""
    checks = []
    if cfg:
        checks += [("auth", lambda: check_auth(rep, cfg)),
                   ("metadata", lambda: check_metadata(rep, cfg, origin)),
                   ("engine", lambda: check_engine(rep, cfg, role, args.tp, args.pp,
                                                   args.dp)),
                   ("rdma", lambda: check_rdma(rep, cfg))]
    checks += [("gpu", lambda: check_gpu(rep, cfg)),
               ("same-host", lambda: check_same_host(rep, cfg)),
               ("vllm", lambda: check_vllm(rep))]
    if args.peer:
        checks.append(("peer", lambda: check_peer(rep, args.peer, cfg, args.timeout)))
    for name, check in checks:
        try:
            check()
        except Exception as e:  # one broken check must not hide the others' results
            rep.add(name, "-", FAIL, f"the check itself failed: {e!r}",
                    "report this with the output of `mooncake-connector doctor --json`")
    print(rep.as_json() if args.json else rep.table(), file=out, flush=True)
    return 1 if rep.failed else 0


def main(argv=None):
    sys.exit(run(argv))
