"""metadata: the metadata server's reach, a scratch key's put/get/delete and
latency; on failure, what actually listens there and the URL that would work."""
from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.error
import urllib.request
import uuid

from .config import _mask
from .hosts import _hp
from .report import FAIL, OK, WARN


SLOW_METADATA_MS = 200.0


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
