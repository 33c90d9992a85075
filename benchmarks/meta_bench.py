"""Metadata backends side by side: p50/p99 latency of register (PUT of a
segment descriptor), lookup (GET) and delete through the C client
(mooncake_connector.MetadataClient), for etcd, Redis and the embedded HTTP
server, all in one run; then the number of metadata requests a 10,000-block
batch between two peer processes causes on each backend (it should be
O(peers), not O(blocks): lookups are cached).

    .venv/bin/python benchmarks/meta_bench.py [--iters 2000] [--json out.json]

etcd and redis-server come from Debian (etcd-server, redis-server); each is
started on a free loopback port with a temporary data directory.  The HTTP
server runs in this process (its request counter is read directly).
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import mooncake_connector as mc  # noqa: E402
from conftest import Peer  # noqa: E402
from mooncake_connector.metadata_server import MetadataServer  # noqa: E402
from mooncake_connector.serving import free_port  # noqa: E402

BLOCKS = 10_000
BLOCK = 4096


def wait(pred, timeout=15):
    end = time.time() + timeout
    while time.time() < end:
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("server did not start")


class Etcd:
    name = "etcd"

    def __init__(self, tmp):
        self.port, peer = free_port(), free_port()
        u = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            ["etcd", "--data-dir", os.path.join(tmp, "etcd"), "--listen-client-urls", u,
             "--advertise-client-urls", u, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait(lambda: b"true" in urllib.request.urlopen(f"{u}/health", timeout=1).read())
        self.url = f"etcd://127.0.0.1:{self.port}"

    def requests(self):
        """gRPC calls served (the JSON gateway forwards every request)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics").read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("grpc_server_started_total{") and 'grpc_type="unary"' in line \
                    or line.startswith("grpc_server_msg_received_total{") and \
                    "LeaseKeepAlive" in line:
                method = line.split('grpc_method="')[1].split('"')[0]
                if method in ("Range", "Put", "DeleteRange", "LeaseGrant", "LeaseKeepAlive"):
                    out[method] = out.get(method, 0) + int(float(line.split()[-1]))
        return out

    def stop(self):
        self.proc.kill()
        self.proc.wait()


class Redis:
    name = "redis"

    def __init__(self, tmp):
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
        wait(lambda: self._cmd(b"PING\r\n").startswith(b"+PONG"))
        self.url = f"redis://127.0.0.1:{self.port}"

    def _cmd(self, raw):
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(raw)
            data = b""
            while not data.endswith(b"\r\n") or data.startswith(b"$") and data.count(b"\r\n") < 2:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            return data

    def requests(self):
        text = self._cmd(b"INFO commandstats\r\n").decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("cmdstat_") and not line.startswith("cmdstat_info"):
                name, rest = line[len("cmdstat_"):].split(":", 1)
                out[name.upper()] = int(rest.split("calls=")[1].split(",")[0])
        return out

    def stop(self):
        self.proc.kill()
        self.proc.wait()


class Http:
    name = "http"

    def __init__(self, tmp):
        self.srv = MetadataServer().start()
        self.url = self.srv.url

    def requests(self):
        return dict(self.srv.request_counts)

    def stop(self):
        self.srv.stop()


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def latency(url, iters):
    c = mc.MetadataClient(url)
    desc = json.dumps({"name": "10.0.0.1:15123", "protocol": "tcp",
                       "ip_or_host_name": "10.0.0.1", "rpc_port": 15123,
                       "tcp_data_port": 15123, "wire": "mooncake-connector/1",
                       "timestamp": 1764461234,
                       "buffers": [{"name": "cpu", "addr": 140234567680 + i * 2**30,
                                    "length": 2**30} for i in range(4)]})
    for i in range(50):  # warm-up: connections, leases
        c.put(f"mooncake/ram/warm{i}", desc)
        c.get(f"mooncake/ram/warm{i}")
        c.delete(f"mooncake/ram/warm{i}")
    res = {"register": [], "lookup": [], "delete": []}
    for i in range(iters):
        key = f"mooncake/ram/10.0.0.{i % 250}:{15000 + i}"
        t0 = time.perf_counter_ns()
        c.put(key, desc)
        t1 = time.perf_counter_ns()
        assert c.get(key) is not None
        t2 = time.perf_counter_ns()
        c.delete(key)
        t3 = time.perf_counter_ns()
        res["register"].append(t1 - t0)
        res["lookup"].append(t2 - t1)
        res["delete"].append(t3 - t2)
    c.close()
    return {op: {"p50_us": pct(v, 50) / 1e3, "p99_us": pct(v, 99) / 1e3}
            for op, v in res.items()}


def diff(after, before):
    return {k: after.get(k, 0) - before.get(k, 0) for k in after
            if after.get(k, 0) != before.get(k, 0)}


def batch_requests(srv, batches):
    env = {"MC_METADATA_TTL": "10"}
    a = Peer(metadata=srv.url, size=BLOCKS * BLOCK, env=env)
    b = Peer(metadata=srv.url, size=BLOCKS * BLOCK, env=env)
    try:
        blocks = [[i * BLOCK, b.addr + i * BLOCK, BLOCK] for i in range(BLOCKS)]
        out = []
        for n in range(batches):
            before = srv.requests()
            t0 = time.time()
            r = a.call(cmd="write", target=b.segment, blocks=blocks)
            dt = time.time() - t0
            assert r == {"ok": True}, r
            out.append({"batch": n + 1, "seconds": round(dt, 3),
                        "requests": diff(srv.requests(), before)})
        return out
    finally:
        a.close()
        b.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="mc-meta-bench-")
    servers = []
    try:
        for cls, binary in ((Etcd, "etcd"), (Redis, "redis-server"), (Http, None)):
            if binary and not shutil.which(binary):
                print(f"skipping {cls.name}: {binary} not installed")
                continue
            servers.append(cls(tmp))
        results = {}
        for s in servers:
            results[s.name] = {"latency": latency(s.url, args.iters),
                               "batch": batch_requests(s, args.batches)}
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nlatency, {args.iters} iterations each (us)")
    print(f"{'backend':8} " + " ".join(f"{op + ' p50':>13} {op + ' p99':>13}"
                                       for op in ("register", "lookup", "delete")))
    for name, r in results.items():
        lat = r["latency"]
        print(f"{name:8} " + " ".join(f"{lat[op]['p50_us']:13.1f} {lat[op]['p99_us']:13.1f}"
                                      for op in ("register", "lookup", "delete")))
    print(f"\nmetadata requests during a {BLOCKS}-block ({BLOCK} B) batch, 2 peers")
    for name, r in results.items():
        for b in r["batch"]:
            total = sum(b["requests"].values())
            print(f"{name:8} batch {b['batch']} ({b['seconds']} s): {total} requests "
                  f"{b['requests']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
