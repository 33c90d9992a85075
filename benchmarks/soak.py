"""Chaos soak: many clients through our proxy while faults happen on a schedule.

    .venv/bin/python -P benchmarks/soak.py --duration 1800 --json soak.json --png soak.png
    .venv/bin/python -P benchmarks/soak.py --ci            # the short version CI runs

Deployment (all on this host, CPU backend, the tiny random-weight model):
etcd (the connectors' metadata server), two prefill servers (kv_producer; P2
with a small kv_buffer_size: eviction pressure) inside a network namespace
joined to the host by a veth pair, two decode servers (kv_consumer, flow A
pairs D1->P1 and D2->P2), and our proxies, one per flow (--flows): a, b,
and three push flows (both legs at once, the prefill writes the KV into the
decode's blocks): push (whole prompt after the forward), push-lw (layer by
layer as the prefill computes it), push-ll (layer by layer, the decode's
attention waiting per layer: push_layer_load).  The proxies, decode servers
and etcd reach the prefill servers only over the veth link, and the
prefills reach the decodes' engines over it (push: each decode's
decode_url is the host's veth address, the name its engine publishes), so
cutting it or putting `tc netem` loss/delay on it hits the prefill<->decode
KV traffic both ways (and the proxy's prefill leg).  The engines refuse
the same-host CPU path across network namespaces, so P1's and P2's KV
always moves over TCP.  P3, a third prefill on the host itself (outside
the namespace, as a user running prefill and decode on one host deploys
it), serves the host flows push-host, push-host-lw and push-host-ll (the
same three push modes, P3 alone): its pushes take the same-host CPU path
(process_vm_writev into the decode's blocks; with push-host-ll each
layer's copy on the engine's gate thread, off vLLM's forward thread).
Each server's vllm:mooncake_push_bytes_same_host_cpu_total and
..._push_gate_host_batches_total, summed over its lifetimes, are in the
JSON ("same_host_path"); a host flow whose path counter stayed 0 fails the
run (the coverage cannot vanish silently).

Clients (asyncio, --clients at once): prompts from a pool with shared
prefixes and mixed lengths, completions and chat, streamed and not, greedy;
some disconnect mid-stream, some abort before the answer.  Each prompt's
reference output comes from a server computing it all itself (prefill P1
asked directly, kv_transfer_params do_remote_decode false: no connector
involved), before the load starts.

Faults (--faults, in turn every --fault-period s): SIGKILL of prefill P1 and
its restart, SIGSTOP/SIGCONT of decode D2, the host prefill P3 SIGSTOPped
for --stop-s and, at its next turn, SIGKILLed and restarted (host_prefill,
in turn), an etcd restart, a cut veth link, netem loss+delay on it.  The
SIGKILL, the SIGSTOPs and the link cut each land mid-push: --burst push
requests with the pool's longest prompts start just before (push/push-lw
for P1's SIGKILL, every push flow for D2's SIGSTOP, the host flows for
P3's faults, push-ll for the cut: a decode step waiting per layer),
recorded per fault
("bursts" in the summary), and each fault's record has what it did to the
transfers in flight (the connector's counters before and after:
"connector_delta").

Invariants (each violation is listed in the JSON):
  hung       no request takes longer than --bound-s (the proxy's own limits are lower)
  wrong      every complete greedy answer equals the reference
  truncated  no 200 answer with an incomplete body (JSON that does not parse,
             a stream without [DONE] and without an error event)
  unclear    every non-200 answer carries a JSON error message
  leaked     after the load stops and faults are healed, every server's
             running/waiting requests, vLLM KV usage, our held bytes, lookup
             entries and loads in flight return to their baseline within
             hold_timeout_s + --drain-margin-s; each server's open files
             within --fd-growth-max of its baseline
  memory     (memwatch in every server, the default) no server leaks: its
             malloc in-use bytes (mallinfo2 uordblks + hblkhd) grow at most
             --mem-used-margin MiB/min and its Python allocated blocks at
             most --mem-blocks-margin a minute faster than R's (least squares
             per lifetime of the server, a restart beginning a new one, over
             the second half of the lifetime's time under load, summed over
             its processes; a lifetime whose window is shorter than
             --mem-min-window-s, 10 min, is printed as not judged), and the
             RSS it keeps after one malloc_trim(0) once the load is drained
             exceeds its RSS at the load's start by at most --mem-kept-margin
             MiB more than R's does.  The RSS slope is reported (rss_slope_mib_per_min): glibc
             keeps freed memory inside its heaps, so RSS grows for tens of
             minutes without a leak (benchmarks/JOURNAL.md, issue 31).
             With --no-memwatch: the old rule, no server's RSS grows faster
             than --rss-slope-max MiB/min (with --reference: than R's slope
             plus --rss-over-reference)

The harness itself (violations too): no link cut and no etcd restart
while a SIGKILLed server restarts, and no restart while one is on (Gate: a
restarting vLLM server must reach etcd; a fault that would wait moves
behind the next kinds of its round, every round injects every kind once);
a server that does not come back is retried (--restart-attempts) and then
a harness failure; fault_counts_by_target counts injections per kind per
server, and a planned kind injected 0 times fails the verdict.

--reference adds R, a plain vLLM server with no KV connector on the same
model, and sends it a copy of every client request (--reference-frac of
them) while the load runs: vLLM's own allocator warm-up on this backend
grows a server's memory for tens of minutes, so a connector server is
judged against R's growth, not against zero.
Exit status 0 when all hold.  Output: a progress line, --json results, a
--png timeline (requests, latency, RSS, held bytes, fault spans).
"""
import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from mooncake_connector import serving
from mooncake_connector.deployment import _port_pair, scrape_metrics
from mooncake_connector.proxy import forget_retry_for

FAULTS = ("kill_prefill", "stop_decode", "host_prefill", "etcd_restart", "link_cut", "netem")
# The push flows of P3, the prefill on the host (outside the namespace): the
# same-host CPU path (process_vm_writev into the decode's blocks; with
# push-host-ll the layers' copies on the engine's gate thread).
HOST_FLOWS = ("push-host", "push-host-lw", "push-host-ll")
FLOWS = ("a", "b", "push", "push-lw", "push-ll", *HOST_FLOWS)
# The producer counters that say which path pushes took (every lifetime of a
# server summed: a restart begins them at 0), and what each host flow must
# have moved by the end (same_host_verdict).
PATH_COUNTERS = ("vllm:mooncake_push_bytes_total", "vllm:mooncake_push_sends_total",
                 "vllm:mooncake_push_bytes_same_host_cpu_total",
                 "vllm:mooncake_push_gate_host_batches_total")
HOST_FLOW_NEEDS = {"push-host": ("vllm:mooncake_push_bytes_same_host_cpu_total",),
                   "push-host-lw": ("vllm:mooncake_push_bytes_same_host_cpu_total",),
                   "push-host-ll": ("vllm:mooncake_push_bytes_same_host_cpu_total",
                                    "vllm:mooncake_push_gate_host_batches_total")}
# Counters a fault's record shows the change of (what it did to transfers in flight).
WATCHED = ("push_", "recomputes", "loads_failed", "load_tokens_missed", "sends_expired")
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega red green blue yellow house river stone tree "
         "cloud light night day water fire earth wind north south east west one two three four "
         "five six seven eight nine ten").split()


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(*args, check=True):
    r = subprocess.run(args, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r


# ---------------------------------------------------------------- network

class Net:
    """A namespace for the prefill servers, joined to the host by a veth pair:
    host side HOST_IP, namespace side NS_IP (/30)."""

    def __init__(self, tag, enabled=True):
        self.enabled = enabled
        self.ns = f"soakh-{tag}"
        self.veth, self.peer = f"mcsk{tag}h", f"mcsk{tag}n"
        octet = 16 + os.getpid() % 200
        self.host_ip, self.ns_ip = f"10.219.{octet}.1", f"10.219.{octet}.2"
        if not enabled:
            self.host_ip = self.ns_ip = "127.0.0.1"
        self.netem_on = False

    def up(self):
        if not self.enabled:
            return
        self.down()
        try:
            sh("ip", "netns", "add", self.ns)
            sh("ip", "link", "add", self.veth, "type", "veth", "peer", "name", self.peer)
            sh("ip", "link", "set", self.peer, "netns", self.ns)
            sh("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.veth)
            sh("ip", "-n", self.ns, "addr", "add", f"{self.ns_ip}/30", "dev", self.peer)
            sh("ip", "link", "set", self.veth, "up")
            sh("ip", "-n", self.ns, "link", "set", self.peer, "up")
            sh("ip", "-n", self.ns, "link", "set", "lo", "up")
            # A cut link must leave the namespace unreachable: without this
            # route, traffic to it follows the default route once the link's
            # own route goes with the link (on this VM to a gateway that
            # answered the proxy's prefill leg with an empty 404).
            sh("ip", "route", "add", "blackhole", self.net(), "metric", "4242")
        except RuntimeError:
            self.down()
            raise

    def net(self):
        return self.ns_ip.rsplit(".", 1)[0] + ".0/30"

    def down(self):
        if not self.enabled:
            return
        sh("ip", "route", "del", "blackhole", self.net(), "metric", "4242", check=False)
        sh("ip", "link", "del", self.veth, check=False)
        sh("ip", "netns", "del", self.ns, check=False)

    def prefix(self):
        return ["ip", "netns", "exec", self.ns] if self.enabled else []

    def cut(self):
        sh("ip", "link", "set", self.veth, "down")

    def heal(self):
        sh("ip", "link", "set", self.veth, "up")

    def netem(self, delay_ms, loss_pct):
        """Loss and delay on the link, both directions: `tc netem`, or where
        the kernel has no sch_netem (this development VM's has not), a token
        bucket with a short queue (tbf: queueing delay, tail-drop loss).
        Returns what was set."""
        for dev, ns in ((self.veth, []), (self.peer, ["-n", self.ns])):
            r = sh("tc", *ns, "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                   f"{delay_ms}ms", "loss", f"{loss_pct}%", check=False)
            if r.returncode:
                if "unknown" not in r.stderr:
                    raise RuntimeError(f"tc netem on {dev}: {r.stderr.strip()}")
                sh("tc", *ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", "4mbit",
                   "burst", "8kb", "latency", f"{delay_ms}ms")
                what = f"tbf rate 4mbit burst 8kb latency {delay_ms}ms (no sch_netem here)"
            else:
                what = f"netem delay {delay_ms}ms loss {loss_pct}%"
        self.netem_on = True
        return what

    def clear_netem(self):
        sh("tc", "qdisc", "del", "dev", self.veth, "root", check=False)
        sh("tc", "-n", self.ns, "qdisc", "del", "dev", self.peer, "root", check=False)
        self.netem_on = False


def have_netns():
    return (os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
            and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0)


# ---------------------------------------------------------------- servers

def rss_of_group(pgid):
    """Resident bytes of every process in group pgid (a server and its children)."""
    return usage_of_group(pgid)[0]


def usage_of_group(pgid):
    """(resident bytes, open file descriptors) of every process in group pgid."""
    total = fds = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            fields = st[st.rindex(")") + 2:].split()
            if int(fields[2]) == pgid:  # pgrp
                total += int(fields[21]) * 4096  # rss pages
                fds += len(os.listdir(f"/proc/{d}/fd"))
        except (OSError, ValueError, IndexError):
            continue
    return total, fds


def memwatch_env(args):
    """A server's environment for benchmarks/memwatch (the memory verdict): its
    sitecustomize on PYTHONPATH, sampling into args.memwatch_dir; {} when off."""
    if not getattr(args, "memwatch_dir", None):
        return {}
    path = [MEMWATCH_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    return {"MC_MEMWATCH": args.memwatch_dir, "MC_MEMWATCH_S": str(args.memwatch_s),
            "PYTHONPATH": ":".join(path)}


class Launcher:
    """Starts processes from one thread that lives as long as the soak:
    serving.Process sets PR_SET_PDEATHSIG, which fires when the *thread*
    that forked the child exits, so a server restarted from a short-lived
    thread would get SIGTERM when that thread ends."""

    def __init__(self):
        import concurrent.futures
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                          thread_name_prefix="launcher")

    def start_all(self, procs, timeout):
        def start():
            for p in procs:
                if not p.alive:
                    p.start()
        self.pool.submit(start).result()
        serving.start_all(procs, timeout)  # only waits now: every one is alive

    def close(self):
        self.pool.shutdown(wait=True)


class Cluster:
    def __init__(self, workdir, model, net, args):
        self.launcher = Launcher()
        self.workdir, self.net, self.args = workdir, net, args
        logs = os.path.join(workdir, "logs")
        os.makedirs(logs, exist_ok=True)
        self.etcd_dir = os.path.join(workdir, "etcd-data")
        ep, pp = serving.free_port(), serving.free_port()
        eu = f"http://{net.host_ip}:{ep}"
        self.etcd = serving.Process("etcd", [
            "etcd", "--name", "mc-soak", "--data-dir", self.etcd_dir,
            "--listen-client-urls", eu, "--advertise-client-urls", eu,
            "--listen-peer-urls", f"http://127.0.0.1:{pp}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{pp}",
            "--initial-cluster", f"mc-soak=http://127.0.0.1:{pp}", "--log-level", "error"],
            os.path.join(logs, "etcd.log"), health_url=f"{eu}/health")
        meta = f"etcd://{net.host_ip}:{ep}"
        self.servers = {}
        engines = {}
        for i in (1, 2):
            p, d = _port_pair()
            engines[i] = (f"{net.ns_ip}:{p}", f"{net.host_ip}:{d}")
        # P3: a prefill on the host itself (outside the namespace), what a
        # user running prefill and decode on one host deploys: its pushes to
        # D1/D2 (named by their veth address, local here) take the same-host
        # CPU path; the link faults do not touch it.
        roles = [("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)]
        if any(f in args.flows for f in HOST_FLOWS):
            p, _ = _port_pair()
            engines[3] = (f"127.0.0.1:{p}", engines[1][1])
            roles.append(("prefill", 3))
        common = {"kv_connector": "MooncakeConnector",
                  "kv_connector_module_path": "mooncake_connector"}
        knobs = {"hold_timeout_s": args.hold_timeout_s, "load_timeout_s": args.load_timeout_s}
        for role, i in roles:
            name = f"{role[0].upper()}{i}"
            cfg_path = os.path.join(workdir, f"mooncake-{name}.json")
            pre, dec = engines[i]
            with open(cfg_path, "w") as f:
                json.dump({"prefill_url": pre, "decode_url": dec, "metadata_server": meta,
                           "protocol": "tcp", "device_name": ""}, f, indent=1)
            buf = args.small_kv_buffer if name == "P2" else 2e9
            extra = dict(knobs, **(args.decode_extra if role == "decode" else {}))
            ktc = dict(common, kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                       kv_buffer_size=buf, kv_connector_extra_config=extra)
            port = serving.free_port()
            host = net.ns_ip if role == "prefill" and i < 3 else "127.0.0.1"
            srv = serving.vllm_server(name, model, port, os.path.join(logs, f"{name}.log"),
                                      kv_transfer_config=ktc,
                                      env={"MOONCAKE_CONFIG_PATH": cfg_path,
                                           # a deployment's default (the path on), not an
                                           # inherited switch: the tests' conftest sets
                                           # MC_SAME_HOST_CPU=0, and --ci under pytest
                                           # (tests/test_soak.py, MC_SOAK=1) had P3's pushes
                                           # all over TCP
                                           "MC_SAME_HOST_CPU": "1",
                                           **memwatch_env(args), **args.env_of.get(name, {})},
                                      kv_cache_bytes=args.kv_cache_bytes)
            srv.cmd[srv.cmd.index("--host") + 1] = host
            if role == "prefill" and i < 3:
                srv.cmd = net.prefix() + srv.cmd
            srv.url = f"http://{host}:{port}"
            srv.health_url = srv.url + "/health"
            srv.role = role
            self.servers[name] = srv
        if args.reference:  # no connector: the RSS reference
            port = serving.free_port()
            srv = serving.vllm_server("R", model, port, os.path.join(logs, "R.log"),
                                      env={**memwatch_env(args), **args.env_of.get("R", {})},
                                      kv_cache_bytes=args.kv_cache_bytes)
            srv.role = "reference"
            self.servers["R"] = srv
        pre = [self.servers["P1"].url, self.servers["P2"].url]
        # a decode that does not answer a forget is asked again only while
        # the prefills still hold the prompt (proxy.forget_retry_for)
        forget = ("--forget-retry-s", f"{forget_retry_for(args.hold_timeout_s):g}")
        self.proxies = {
            # flow a: the proxy's two round robins move together: P1+D1, P2+D2
            # (each decode's prefill_url); flow b crosses them: P1+D2, P2+D1.
            "a": serving.proxy(pre, [self.servers["D1"].url, self.servers["D2"].url],
                               serving.free_port(), os.path.join(logs, "proxy-a.log"), flow="a",
                               timeout_s=args.proxy_timeout_s, extra_args=forget),
            "b": serving.proxy(pre, [self.servers["D2"].url, self.servers["D1"].url],
                               serving.free_port(), os.path.join(logs, "proxy-b.log"), flow="b",
                               timeout_s=args.proxy_timeout_s, extra_args=forget),
        }
        # The push flows: both legs at once, the prefill (in the namespace)
        # writes the KV into the decode's blocks over the veth link.  Each
        # proxy names the prefills' engines (their prefill_url) so the decode
        # leg's target goes to the producer that runs its prefill leg; the
        # prefill reaches the decode's engine at its decode_url (the host's
        # veth address: what a user writes for a decode host whose prefill
        # sits behind another interface; the engine listens on every address).
        peng = [engines[1][0], engines[2][0]]
        for flow, lw, ll, dec in (("push", "off", "off", ("D1", "D2")),
                                  ("push-lw", "on", "off", ("D2", "D1")),
                                  ("push-ll", "on", "on", ("D1", "D2"))):
            if flow in args.flows:
                self.proxies[flow] = serving.proxy(
                    pre, [self.servers[d].url for d in dec], serving.free_port(),
                    os.path.join(logs, f"proxy-{flow}.log"), flow="push",
                    timeout_s=args.proxy_timeout_s,
                    extra_args=("--prefill-engine", *peng, "--push-layerwise", lw,
                                "--push-layer-load", ll))
        # The host flows: P3 alone, so that a fault's burst on them lands on
        # the same-host CPU path (P3 reaches the decodes' engines at the
        # names they publish, the host's veth address: local traffic).
        for flow, lw, ll, dec in (("push-host", "off", "off", ("D2", "D1")),
                                  ("push-host-lw", "on", "off", ("D1", "D2")),
                                  ("push-host-ll", "on", "on", ("D2", "D1"))):
            if flow in args.flows:
                self.proxies[flow] = serving.proxy(
                    [self.servers["P3"].url], [self.servers[d].url for d in dec],
                    serving.free_port(), os.path.join(logs, f"proxy-{flow}.log"), flow="push",
                    timeout_s=args.proxy_timeout_s,
                    extra_args=("--prefill-engine", engines[3][0], "--push-layerwise", lw,
                                "--push-layer-load", ll))
        for f in [f for f in self.proxies if f not in args.flows]:
            del self.proxies[f]
        for p in self.proxies.values():
            p.cmd += ["--idle-timeout", str(args.proxy_idle_timeout_s)]
        self.restarting = set()

    def all(self):
        return [self.etcd, *self.servers.values(), *self.proxies.values()]

    def start(self, timeout):
        self.launcher.start_all([self.etcd], 60)
        self.launcher.start_all(list(self.servers.values()) + list(self.proxies.values()),
                                timeout)

    def stop(self):
        for s in self.servers.values():
            if s.proc is not None:
                serving._killpg(s.proc.pid, signal.SIGCONT)
        serving.stop_all([*self.proxies.values(), *self.servers.values()])
        serving.stop_all([self.etcd])
        self.launcher.close()


# ---------------------------------------------------------------- faults

def counter_delta(before, after):
    """{counter: increase} of the connector's WATCHED counters (scrape() rows)."""
    out = {}
    for k, v in after.items():
        if (k.startswith("vllm:mooncake_") and k.endswith(("_total", "}")) and "bucket" not in k
                and "_created" not in k and any(w in k for w in WATCHED)
                and v - before.get(k, 0) > 0):
            out[k.replace("vllm:mooncake_", "").replace("_total", "")] = round(
                v - before.get(k, 0))
    return out


# What each fault kind hits (the summary counts injections per kind per target).
FAULT_TARGET = {"kill_prefill": "P1", "stop_decode": "D2", "host_prefill": "P3",
                "etcd_restart": "etcd", "link_cut": "veth (P1+P2)", "netem": "veth (P1+P2)"}


class Gate:
    """Keeps a server's restart apart from the faults that cut it off the
    metadata server (a link cut, an etcd restart): a restarting vLLM server
    must publish its segment to etcd, and one that cannot exits with the
    designed "etcd unreachable" error (session 16: P1's restart fell into a
    link cut and never came back).  restart(name) waits for any disruption
    to end; disruption(kind) waits for every restart to end.  Each wait is
    bounded (TimeoutError names what it waited for) and ends early when
    stop_evt is set (InterruptedError)."""

    def __init__(self, stop_evt=None):
        self.cv = threading.Condition()
        self.disrupting = set()   # fault kinds in progress
        self.restarting = set()   # server names
        self.stop_evt = stop_evt or threading.Event()

    def _wait_for(self, pred, timeout, what):
        deadline = time.monotonic() + timeout
        while not pred():
            if self.stop_evt.is_set():
                raise InterruptedError(f"soak stopping while waiting for {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"still waiting for {what} after {timeout:.0f} s")
            self.cv.wait(min(left, 0.5))

    @contextlib.contextmanager
    def restart(self, name, timeout):
        with self.cv:
            self._wait_for(lambda: not self.disrupting, timeout,
                           f"{sorted(self.disrupting)} to end before restarting {name}")
            self.restarting.add(name)
        try:
            yield
        finally:
            with self.cv:
                self.restarting.discard(name)
                self.cv.notify_all()

    @contextlib.contextmanager
    def disruption(self, kind, timeout):
        with self.cv:
            self._wait_for(lambda: not self.restarting, timeout,
                           f"the restart of {sorted(self.restarting)} to end before {kind}")
            self.disrupting.add(kind)
        try:
            yield
        finally:
            with self.cv:
                self.disrupting.discard(kind)
                self.cv.notify_all()

    def busy(self, name):
        with self.cv:
            return name in self.restarting


def restart_with_retries(start, attempts, on_failure=None):
    """Calls start() until it returns (at most `attempts` times); each
    failure goes to on_failure(attempt, exc).  Returns (attempt that
    succeeded or None, [error strings])."""
    errors = []
    for k in range(1, attempts + 1):
        try:
            start()
            return k, errors
        except Exception as e:  # noqa: BLE001 - reported, retried
            errors.append(f"attempt {k}: {e!r}"[:600])
            if on_failure is not None:
                on_failure(k, e)
    return None, errors


def fault_verdict(kinds, events, errors, harness_failures):
    """(counts {kind: {target: n}}, violations): a planned fault kind that
    was never injected, a fault that could not be injected and a server
    that did not come back are violations of the harness (a soak that
    silently stops injecting a fault proves less than it says)."""
    counts = {k: {FAULT_TARGET.get(k, "?"): 0} for k in kinds}
    for e in events:
        tgt = e.get("target") or FAULT_TARGET.get(e["fault"], "?")
        counts.setdefault(e["fault"], {}).setdefault(tgt, 0)
        counts[e["fault"]][tgt] += 1
    v = []
    never = [k for k in kinds if not sum(counts[k].values())]
    if never:
        v.append(f"harness: planned fault kinds injected 0 times: {never}")
    if errors:
        v.append(f"harness: faults not injected: {errors}")
    if harness_failures:
        v.append(f"harness: {harness_failures}")
    return counts, v


class Faults(threading.Thread):
    def __init__(self, cluster, net, args, t0):
        super().__init__(daemon=True)
        self.c, self.net, self.args, self.t0 = cluster, net, args, t0
        self.events = []       # {"fault", "start", "end", "detail"}
        self.stop_evt = threading.Event()
        self.gate = Gate(self.stop_evt)
        self.errors = []
        self.harness_failures = []   # a server that did not come back
        self.restarts = {}           # {server: {"ok": n, "retried": n, "failed": n}}
        kinds = [f for f in args.faults.split(",") if f]
        if not net.enabled:
            kinds = [f for f in kinds if f not in ("link_cut", "netem")]
        if "P3" not in cluster.servers:   # no host flow: no host prefill
            kinds = [f for f in kinds if f != "host_prefill"]
        self.kinds = kinds
        self.host_faults = 0   # host_prefill injections: SIGSTOP, SIGKILL, SIGSTOP, ...
        self.restart_threads = []
        self.load = None       # set before start: bursts of push requests (mid-push faults)
        self.rnd = random.Random(args.seed + 2)
        self.watchers = []

    def now(self):
        return time.monotonic() - self.t0

    def _event(self, name, detail):
        ev = {"fault": name, "start": round(self.now(), 2), "end": None, "detail": detail}
        self.events.append(ev)
        log(f"fault {name}: {detail}")
        return ev

    def _sleep(self, s):
        return self.stop_evt.wait(s)

    def blocked(self, kind):
        """True while `kind` would have to wait for a restart (the gate)."""
        if kind in ("link_cut", "etcd_restart"):
            with self.gate.cv:
                return bool(self.gate.restarting)
        return ((kind == "kill_prefill" and self.gate.busy("P1"))
                or (kind == "host_prefill" and self.gate.busy("P3")))

    def next_kind(self, pending):
        """The next fault: the first of `pending` (this round's kinds not yet
        injected, in --faults order; refilled when empty) that need not wait
        for a restart, else the first (it waits).  Each round injects every
        kind once; a restart only reorders a round."""
        if not pending:
            pending.extend(self.kinds)
        kind = next((k for k in pending if not self.blocked(k)), pending[0])
        pending.remove(kind)
        return kind

    def run(self):
        pending = []
        if self._sleep(self.args.first_fault_s):
            return
        while not self.stop_evt.is_set() and self.kinds:
            kind = self.next_kind(pending)
            t = time.monotonic()
            try:
                getattr(self, kind)()
            except InterruptedError:
                return  # the soak is stopping (a gate's wait ended early)
            except Exception as e:  # noqa: BLE001 - a fault that cannot be injected is reported
                self.errors.append(f"{kind}: {e!r}")
                log(f"fault {kind} could not be injected: {e!r}")
            if self._sleep(max(0.0, self.args.fault_period - (time.monotonic() - t))):
                return

    def _mid_push(self, flows, tag):
        """Starts a burst of push requests (the pool's longest prompts, on
        `flows`) and returns after a short random delay, so that the fault
        injected next lands while their KV is being pushed.  Returns the
        words for the fault's detail ('' without push flows)."""
        load = self.load
        flows = [f for f in flows if load is not None and f in load.proxies]
        if not flows or load.loop is None:
            return ""
        delay = self.rnd.uniform(*self.args.burst_delay_s)
        load.burst(flows, self.args.burst, tag)
        time.sleep(delay)
        return (f", {self.args.burst} requests on {'+'.join(flows)} started "
                f"{delay * 1000:.0f} ms before (mid-push)")

    def _watch(self, ev, servers, wait_end=True):
        """The connector's counters of `servers` now, and again once the
        fault is over plus load_timeout_s + 5 s: what the fault did to the
        transfers in flight (ev["connector_delta"])."""
        before = {n: scrape(self.c.servers[n].url) or {} for n in servers
                  if self.c.servers[n].alive}

        def after():
            while wait_end and ev["end"] is None and not self.stop_evt.is_set():
                time.sleep(0.5)
            self.stop_evt.wait(self.args.load_timeout_s + 5)
            ev["connector_delta"] = {
                n: counter_delta(b, scrape(self.c.servers[n].url) or {})
                for n, b in before.items()}
        th = threading.Thread(target=after, daemon=True)
        th.start()
        self.watchers.append(th)

    def _wait_s(self):
        return self.args.start_timeout * self.args.restart_attempts + 60

    def kill_prefill(self):
        self._kill("kill_prefill", "P1", ("push", "push-lw"), ("D1", "D2", "P2", "P3"))

    def _kill(self, kind, name, flows, watch):
        """SIGKILL of prefill `name` mid-push (a burst on `flows` just before),
        then its restart on its own thread (the gate held)."""
        srv = self.c.servers[name]
        if self.gate.busy(name):  # still coming back from the last SIGKILL: wait, do not skip
            with self.gate.disruption(f"{kind} wait", self._wait_s()):
                pass
        if not srv.alive:
            raise RuntimeError(f"{name} is down (its last restart failed): SIGKILL not injected")
        mid = self._mid_push(flows, kind)
        ev = self._event(kind, f"SIGKILL to {name}'s process group, then restart" + mid)
        ev["target"] = name
        self._watch(ev, [n for n in watch if n in self.c.servers], wait_end=False)
        srv.kill()
        self.c.restarting.add(name)
        started = threading.Event()
        th = threading.Thread(target=self._restart, args=(name, srv, ev, started), daemon=True)
        th.start()
        self.restart_threads.append(th)
        started.wait(self._wait_s())   # the gate is held: no cut begins before the restart

    def host_prefill(self):
        """P3, the prefill on the host (the same-host CPU path), mid-push on
        the host flows: SIGSTOP for --stop-s (its gate thread's copies and
        its notes stop with it; the decodes wait), then on the next turn
        SIGKILL and restart (the decodes lose the producer mid-copy), in
        turn."""
        self.host_faults += 1
        flows = HOST_FLOWS
        if self.host_faults % 2 == 0:
            self._kill("host_prefill", "P3", flows, ("D1", "D2", "P1", "P2"))
            return
        srv = self.c.servers["P3"]
        if self.gate.busy("P3"):
            with self.gate.disruption("host_prefill wait", self._wait_s()):
                pass
        if not srv.alive:
            raise RuntimeError("P3 is down (its last restart failed): SIGSTOP not injected")
        self._sigstop("host_prefill", "P3", srv, flows)

    def _sigstop(self, kind, name, srv, flows):
        """SIGSTOP `name`'s process group (`srv`) for --stop-s, mid-push on
        `flows` where it can, watched from every server there is; SIGCONT
        after, whatever happens meanwhile."""
        mid = self._mid_push(flows, kind)
        ev = self._event(kind, f"SIGSTOP {name} for {self.args.stop_s} s" + mid)
        ev["target"] = name
        self._watch(ev, [n for n in ("D1", "D2", "P1", "P2", "P3") if n in self.c.servers])
        serving._killpg(srv.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(self.args.stop_s)
        finally:
            serving._killpg(srv.proc.pid, signal.SIGCONT)
            ev["end"] = round(self.now(), 2)

    def _restart(self, name, srv, ev, started):
        rec = self.restarts.setdefault(name, {"ok": 0, "retried": 0, "failed": 0})

        def failed(k, e):
            rec["retried"] += 1
            log(f"{name} restart attempt {k} failed: {e!r}"[:400])
            try:
                srv.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        try:
            with self.gate.restart(name, self._wait_s()):
                started.set()
                try:
                    k, errs = restart_with_retries(
                        lambda: self.c.launcher.start_all([srv], self.args.start_timeout),
                        self.args.restart_attempts, failed)
                finally:
                    # stamped before the gate lets a waiting link cut or
                    # etcd restart begin: the report's order is the gate's
                    ev["end"] = round(self.now(), 2)
            if k is None:
                rec["failed"] += 1
                self.harness_failures.append(
                    f"{name} did not come back after {self.args.restart_attempts} attempts: "
                    f"{errs}")
                ev["detail"] += f" (NOT back after {self.args.restart_attempts} attempts)"
            else:
                rec["ok"] += 1
                ev["detail"] += (f" (ready again after {srv.ready_s:.0f} s"
                                 + (f", attempt {k}" if k > 1 else "") + ")")
        except Exception as e:  # noqa: BLE001 - the gate's wait: reported
            rec["failed"] += 1
            self.harness_failures.append(f"{name} restart: {e!r}")
        finally:
            started.set()
            if ev["end"] is None:  # the gate's wait failed
                ev["end"] = round(self.now(), 2)
            self.c.restarting.discard(name)

    def stop_decode(self):
        srv = self.c.servers["D2"]
        self._sigstop("stop_decode", "D2", srv, ("push", "push-lw", "push-ll", *HOST_FLOWS))

    def etcd_restart(self):
        with self.gate.disruption("etcd_restart", self._wait_s()):
            ev = self._event("etcd_restart", "SIGTERM etcd, down 3 s, restart (same data dir)")
            ev["target"] = "etcd"
            self.c.etcd.stop(grace=10)
            time.sleep(3)
            self.c.launcher.start_all([self.c.etcd], 60)
            ev["end"] = round(self.now(), 2)

    def link_cut(self):
        with self.gate.disruption("link_cut", self._wait_s()):
            mid = self._mid_push(("push-ll",), "link_cut")
            ev = self._event("link_cut", f"veth down for {self.args.cut_s} s" + mid)
            ev["target"] = FAULT_TARGET["link_cut"]
            self._watch(ev, ("D1", "D2", "P1", "P2"))
            self.net.cut()
            try:
                time.sleep(self.args.cut_s)
            finally:
                self.net.heal()
                ev["end"] = round(self.now(), 2)

    def netem(self):
        ev = self._event("netem", f"loss+delay on the link for {self.args.netem_s} s")
        ev["target"] = FAULT_TARGET["netem"]
        ev["detail"] += ": " + self.net.netem(40, 3)
        try:
            time.sleep(self.args.netem_s)
        finally:
            self.net.clear_netem()
            ev["end"] = round(self.now(), 2)

    def heal_all(self):
        self.stop_evt.set()
        if self.is_alive():
            self.join(timeout=self.args.stop_s + self.args.netem_s + 90)
        if self.net.enabled:
            self.net.heal()
            self.net.clear_netem()
        for srv in self.c.servers.values():
            if srv.proc is not None:
                serving._killpg(srv.proc.pid, signal.SIGCONT)
        for th in self.restart_threads:
            th.join(timeout=self.args.start_timeout + 30)
        for th in self.watchers:
            th.join(timeout=self.args.load_timeout_s + 30)
        if not self.c.etcd.alive:
            self.c.launcher.start_all([self.c.etcd], 60)


# ---------------------------------------------------------------- load

def make_pool(seed, n_prefix, n_suffix, max_words):
    rnd = random.Random(seed)
    prefixes = [" ".join(rnd.choice(WORDS) for _ in range(rnd.choice((0, 40, 120, max_words))))
                for _ in range(n_prefix)]
    pool = []
    for pi, pre in enumerate(prefixes):
        for si in range(n_suffix):
            n = rnd.randrange(3, max_words // 2)
            text = (pre + " " if pre else "") + " ".join(rnd.choice(WORDS) for _ in range(n))
            pool.append({"id": f"p{pi}s{si}", "text": text, "max_tokens": 3 + rnd.randrange(12)})
    return pool


def body_for(item, chat, stream):
    b = {"model": "tiny", "temperature": 0, "max_tokens": item["max_tokens"], "stream": stream}
    if chat:
        b["messages"] = [{"role": "user", "content": item["text"]}]
    else:
        b["prompt"] = item["text"]
    return b


def answer_text(obj, chat):
    c = obj["choices"][0]
    return c["message"]["content"] if chat else c["text"]


def parse_stream(raw, chat):
    """(text, state) with state "complete", "error" (an error event), or
    "truncated" (no [DONE])."""
    text, err, done = [], None, False
    for ev in raw.decode("utf-8", "replace").split("\n\n"):
        ev = ev.strip()
        if not ev.startswith("data:"):
            continue
        data = ev[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            return "".join(text), "truncated"
        if "error" in obj:
            err = obj["error"]
            continue
        for c in obj.get("choices") or ():
            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
            if piece:
                text.append(piece)
    if err is not None:
        return "".join(text), "error"
    return "".join(text), "complete" if done else "truncated"


class Load:
    def __init__(self, proxies, pool, refs, args, t0):
        self.proxies, self.pool, self.refs, self.args, self.t0 = proxies, pool, refs, args, t0
        self.records = []   # one per request
        self.sink = open(args.json + ".records.jsonl", "w") if args.json else None
        self.stop = False
        self.rnd = random.Random(args.seed + 1)
        self.reference = None       # R's base URL: each request is mirrored there
        self.mirror = {"sent": 0, "ok": 0, "failed": 0}
        self._mirrors = set()
        self.loop = self.session = None   # while run() runs
        self._bursts = set()
        self.longest = sorted(pool, key=lambda it: -len(it["text"]))[:max(1, len(pool) // 6)]

    def burst(self, flows, n, tag):
        """From another thread: n requests at once on `flows` in turn (the
        pool's longest prompts, no client abort), recorded with burst=tag."""
        def go():
            for k in range(n):
                t = asyncio.ensure_future(self.one(
                    self.session, -1, flow=flows[k % len(flows)],
                    item=self.rnd.choice(self.longest), tag=tag))
                self._bursts.add(t)
                t.add_done_callback(self._bursts.discard)
        self.loop.call_soon_threadsafe(go)

    async def one(self, session, n, flow=None, item=None, tag=None):
        import aiohttp
        r = self.rnd
        item = item or r.choice(self.pool)
        flow = flow or r.choice(sorted(self.proxies))
        chat, stream = r.random() < 0.4, r.random() < 0.5
        u = r.random()
        behaviour = ("normal" if tag else
                     "disconnect" if stream and u < self.args.disconnect_frac else
                     "abort" if u > 1 - self.args.abort_frac else "normal")
        rec = {"n": n, "prompt": item["id"], "flow": flow, "chat": chat, "stream": stream,
               "behaviour": behaviour, "start": round(time.monotonic() - self.t0, 3)}
        if tag:
            rec["burst"] = tag
        url = self.proxies[flow] + ("/v1/chat/completions" if chat else "/v1/completions")
        t = time.monotonic()
        if self.reference and r.random() < self.args.reference_frac:
            task = asyncio.create_task(self.mirror_to_reference(session, item, chat, stream))
            self._mirrors.add(task)
            task.add_done_callback(self._mirrors.discard)

        async def go():
            async with session.post(url, json=body_for(item, chat, stream)) as resp:
                rec["status"] = resp.status
                if behaviour == "disconnect" and resp.status == 200:
                    await resp.content.readany()
                    resp.close()
                    return "client_abort", None
                raw = await resp.read()
            if rec["status"] != 200:
                try:
                    msg = json.loads(raw)["error"]["message"]
                    rec["error"] = str(msg)[:300]
                    return "error", None
                except (ValueError, KeyError, TypeError):
                    rec["error"] = raw[:300].decode("utf-8", "replace")
                    return "unclear", None
            if stream:
                text, state = parse_stream(raw, chat)
                if state == "error":
                    rec["error"] = "error event in a 200 stream"
                    return "error", None
                if state == "truncated":
                    return "truncated", None
                return "done", text
            try:
                return "done", answer_text(json.loads(raw), chat)
            except (ValueError, KeyError, IndexError, TypeError):
                return "truncated", None

        try:
            if behaviour == "abort":
                try:
                    outcome, text = await asyncio.wait_for(go(), r.uniform(0.05, 1.5))
                except asyncio.TimeoutError:
                    outcome, text = "client_abort", None
            else:
                outcome, text = await asyncio.wait_for(go(), self.args.bound_s)
        except asyncio.TimeoutError:
            outcome, text = "hung", None
        except (aiohttp.ClientError, OSError) as e:
            outcome, text = "error", None   # the connection failed: a clear client-side error
            rec["error"] = f"connection: {e!r}"[:300]
        if outcome == "done":
            ref = self.refs[(item["id"], chat)]
            outcome = "ok" if text == ref else "wrong"
            if outcome == "wrong":
                rec["got"], rec["want"] = text, ref
        rec["outcome"] = outcome
        rec["secs"] = round(time.monotonic() - t, 3)
        self.records.append(rec)
        if self.sink is not None:  # as they end: a long soak can be watched
            self.sink.write(json.dumps(rec) + "\n")
            self.sink.flush()

    async def mirror_to_reference(self, session, item, chat, stream):
        """The same request to R (whole answer read; only counted)."""
        import aiohttp
        self.mirror["sent"] += 1
        url = self.reference + ("/v1/chat/completions" if chat else "/v1/completions")
        try:
            async with session.post(url, json=body_for(item, chat, stream)) as resp:
                await asyncio.wait_for(resp.read(), self.args.bound_s)
                self.mirror["ok" if resp.status == 200 else "failed"] += 1
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            self.mirror["failed"] += 1

    async def client(self, session, k):
        n = k
        while not self.stop:
            await self.one(session, n)
            n += self.args.clients
            await asyncio.sleep(self.rnd.uniform(0, self.args.think_s))

    async def run(self, duration, progress):
        import aiohttp
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=conn,
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            self.loop, self.session = asyncio.get_running_loop(), session
            tasks = [asyncio.create_task(self.client(session, k))
                     for k in range(self.args.clients)]
            end = time.monotonic() + duration
            while time.monotonic() < end:
                await asyncio.sleep(1)
                progress()
            self.stop = True
            await asyncio.gather(*tasks)
            while self._bursts:
                await asyncio.gather(*list(self._bursts))
            self.loop = None
            if self._mirrors:
                await asyncio.gather(*list(self._mirrors), return_exceptions=True)


async def references(url, pool, concurrency=4):
    """Each prompt's greedy answer from a server that computes it itself."""
    import aiohttp
    sem = asyncio.Semaphore(concurrency)
    out = {}

    async def one(session, item, chat):
        body = dict(body_for(item, chat, False),
                    kv_transfer_params={"do_remote_decode": False})
        async with sem:
            async with session.post(url + ("/v1/chat/completions" if chat else
                                           "/v1/completions"), json=body) as r:
                raw = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"reference for {item['id']}: {r.status} {raw[:300]}")
                out[(item["id"], chat)] = answer_text(json.loads(raw), chat)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(one(s, it, c) for it in pool for c in (False, True)))
    return out


# ---------------------------------------------------------------- monitoring

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:mooncake_held_bytes", "vllm:mooncake_lookup_entries",
          "vllm:mooncake_loads_in_flight")


scrape = scrape_metrics  # (url, timeout=3.0): {metric or metric{reason}: value} or None


class Monitor(threading.Thread):
    def __init__(self, cluster, t0, period=2.0):
        super().__init__(daemon=True)
        self.c, self.t0, self.period = cluster, t0, period
        self.samples = []   # {"t", "server", "pid", "rss", gauges...}
        self.counters = {}  # {server: {pid: {PATH_COUNTERS name: last value}}}
        self.stop_evt = threading.Event()

    def sample(self):
        t = round(time.monotonic() - self.t0, 2)
        out = {}

        def one(name, srv):
            row = {"t": t, "server": name, "pid": None, "rss": None}
            if srv.alive:
                m = scrape(srv.url)
                if m is not None:  # RSS of serving servers only (not while starting)
                    row["pid"] = srv.proc.pid
                    row["rss"], row["fds"] = usage_of_group(srv.proc.pid)
                    row.update({g: m.get(g) for g in GAUGES if g in m})
                    self.counters.setdefault(name, {})[srv.proc.pid] = {
                        k: m.get(k, 0) for k in PATH_COUNTERS}
            out[name] = row
        ths = [threading.Thread(target=one, args=(n, s)) for n, s in self.c.servers.items()]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        self.samples.extend(out.values())
        return out

    def run(self):
        while not self.stop_evt.wait(self.period):
            self.sample()


def _short(counter):
    return counter.replace("vllm:mooncake_", "").replace("_total", "")


def path_totals(counters):
    """{server: {counter: total}} from Monitor.counters: each lifetime's
    (pid's) last value seen, summed over the server's lifetimes (a SIGKILL
    and restart begin its counters at 0), with the same-host share of the
    pushed bytes ("same_host_share": push_bytes_same_host_cpu / push_bytes)."""
    out = {}
    for name, by_pid in sorted(counters.items()):
        row = out[name] = {_short(k): 0 for k in PATH_COUNTERS}
        for vals in by_pid.values():
            for k, v in vals.items():
                row[_short(k)] += int(round(v or 0))
        row["lifetimes"] = len(by_pid)
        if row["push_bytes"]:
            row["same_host_share"] = round(row["push_bytes_same_host_cpu"] / row["push_bytes"],
                                           3)
    return out


def same_host_verdict(totals, flows, server="P3"):
    """Violations: a host flow in the run (HOST_FLOW_NEEDS) whose prefill's
    counter stayed 0 -- the flow never took the same-host CPU path (or,
    push-host-ll, never had a layer copied on the engine's gate thread), so
    the soak did not cover what it claims."""
    row = totals.get(server) or {}
    v = []
    for f in flows:
        for k in HOST_FLOW_NEEDS.get(f, ()):
            if not row.get(_short(k)):
                v.append(f"flow {f}: {server}'s {_short(k)} stayed 0 over the run (the "
                         f"same-host CPU path{' gate thread' if 'gate' in k else ''} never "
                         f"used: coverage lost)")
    return v


def rss_slope(samples, server, t_from, t_to, born_by=None):
    """MiB/min by least squares for each lifetime (pid) of server within
    [t_from, t_to] that began by born_by (default t_from); the steepest of
    those with >= 8 samples spanning at least a quarter of the window (None:
    no such lifetime, e.g. restarted inside the window).  The soak passes
    the load's start as born_by: a server its faults restarted is warming
    up, not trending (a P1 restarted 20 s before the window of a 2-minute
    soak grew 110 MiB/min).  (The 30-minute reference
    soak counted a P1 lifetime that began before the window and was killed
    20 s into it: 14 MiB/min of start-up growth, read as a trend.)"""
    born_by = t_from if born_by is None else born_by
    born = {}
    for s in samples:
        if s["server"] == server and s["rss"]:
            born.setdefault(s["pid"], s["t"])
    by_pid = {}
    for s in samples:
        # A process restarted inside the window is warming up, not trending.
        if (s["server"] == server and s["rss"] and t_from <= s["t"] <= t_to
                and born[s["pid"]] <= born_by):
            by_pid.setdefault(s["pid"], []).append((s["t"], s["rss"] / 2**20))
    slopes = []
    for pts in by_pid.values():
        if len(pts) < 8 or pts[-1][0] - pts[0][0] < (t_to - t_from) / 4:
            continue
        n = len(pts)
        mx = sum(p[0] for p in pts) / n
        my = sum(p[1] for p in pts) / n
        sxx = sum((p[0] - mx) ** 2 for p in pts)
        if sxx > 0:
            slopes.append(60 * sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx)
    return round(max(slopes), 3) if slopes else None


# ---------------------------------------------------------------- memory verdict
#
# RSS alone does not say whether a server leaks: glibc keeps freed memory
# inside its heaps (the 15-minute memwatch soak of issue 31: in-use heap
# flat at 0.0-0.4 MiB/min while RSS grew 13-16 MiB/min, and malloc_trim(0)
# after the load gave 255-455 MiB back).  With memwatch in every server
# (benchmarks/memwatch/sitecustomize.py, on unless --no-memwatch) the soak
# judges what a leak grows: the bytes malloc hands out (heap and mmapped
# chunks: C and C++ objects, Python objects over 512 B, buffers) and the
# Python objects pymalloc holds (allocated blocks), each as a slope against
# the reference R's, per lifetime of a server (a restart begins a new
# series) over the second half of that lifetime's time under load (the
# first half is its warm-up), judged only when that window is at least
# --mem-min-window-s long (the lifetimes too short are printed as not
# judged); and the RSS each server keeps after one malloc_trim(0) once the
# load is drained, as growth since the load began against R's growth.  The
# RSS slope is still reported (rss_slope_mib_per_min).

MEMWATCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memwatch")


def trim_memwatch(d, server_of_pgid, results, wait_s=20.0):
    """Ask every memwatch process for one malloc_trim(0) (RSS before and
    after); wait until each live server process answered (or wait_s)."""
    open(os.path.join(d, "trim-now"), "w").close()
    results["memwatch_trim_t"] = time.time()
    log(f"malloc_trim(0) in every server process ({d}/trim-now)")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(1)
        waiting = []
        for pid, recs in read_memwatch(d).items():
            if recs[0].get("pgid") in server_of_pgid and not any(r.get("trim") for r in recs):
                try:
                    os.kill(pid, 0)
                except OSError:
                    continue  # gone (a fault's kill)
                waiting.append(pid)
        if not waiting:
            return
    log(f"no malloc_trim answer from {waiting} within {wait_s:g} s")


def read_memwatch(d):
    """{pid: [record, ...]} from a MC_MEMWATCH directory (one JSON line per sample)."""
    out = {}
    if not d or not os.path.isdir(d):
        return out
    for name in os.listdir(d):
        if not name.endswith(".jsonl"):
            continue
        recs = []
        with open(os.path.join(d, name)) as f:
            for ln in f:
                try:
                    recs.append(json.loads(ln))
                except ValueError:
                    continue  # a line cut by a SIGKILL
        if recs:
            out[recs[0]["pid"]] = recs
    return out


def memory_series(recs_by_pid, server_of_pgid):
    """{server: {pgid: {pid: [{"t", "rss", "used", "blocks"}, ...]}}} (MiB, MiB,
    blocks; t unix time) for the processes whose group is a server's
    (server_of_pgid: {pgid: name}).  A pgid is one lifetime of the server: the
    processes of one start (the API process, its EngineCore); a restart's
    processes are a new group.  "used" is malloc's in-use bytes (mallinfo2
    uordblks + hblkhd).  A record with a malloc_trim result adds
    {"trim_before", "trim_after"} (MiB) to that process."""
    out = {}
    for pid, recs in recs_by_pid.items():
        pgid = recs[0].get("pgid")
        srv = server_of_pgid.get(pgid)
        if srv is None:
            continue
        rows = []
        for r in recs:
            if "mall" not in r or "VmRSS" not in r:
                continue
            row = {"t": r["t"], "rss": r["VmRSS"] / 1024,
                   "used": (r["mall"]["uordblks"] + r["mall"]["hblkhd"]) / 2**20,
                   "blocks": r.get("py_blocks", 0)}
            if r.get("trim"):
                row["trim_before"] = r["trim"]["rss_before_kb"] / 1024
                row["trim_after"] = r["trim"]["rss_after_kb"] / 1024
            rows.append(row)
        if rows:
            out.setdefault(srv, {}).setdefault(pgid, {})[pid] = rows
    return out


def _per_min(pts):
    """Least-squares slope of [(t s, v)] per minute; None under 4 points."""
    n = len(pts)
    if n < 4:
        return None
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    den = sum((t - mt) ** 2 for t, _ in pts)
    return None if den == 0 else 60 * sum((t - mt) * (v - mv) for t, v in pts) / den


# The shortest window a lifetime is judged over (the second half of its time
# under load), 10 minutes.  Under load the EngineCores' malloc in-use bytes
# climb for 4-15 minutes before their plateau (session 29's 25-minute soak:
# the prefills in 4-5 min to 577 MiB, the decodes in ~15 to 590; the
# 10-minute run of 2026-12-06 08:08 was still climbing in its second half), and on
# the plateau they step by up to ~13 MiB (that soak's P3: 577 -> 584-590 in
# its last 2 minutes).  A step of A MiB in the middle of a window of W
# minutes reads as a slope of 1.5 A / W MiB/min: that P3, SIGKILLed 16.2
# minutes into the load, read +3.6 MiB/min over the 3.6 minutes of the
# load's second half it lived (the old rule's window) and +1.3 over the
# second half of its life (8.1 min); 10 minutes leaves such lifetimes out
# (printed as not judged) and still judges every lifetime that spends 20
# minutes under load (the 20-30-minute soaks' servers).  It bounds that
# noise, it does not remove it: a 13 MiB step in the middle of a 10-minute
# window still reads 2 MiB/min (1.3 over the 15 minutes of a 30-minute soak's
# second half).  --ci (2 minutes, gross margins): 30 s.
MEM_MIN_WINDOW_S = 600.0


def memory_of_lifetime(procs, t_load, t_end, min_window_s=MEM_MIN_WINDOW_S):
    """One lifetime of a server (procs: {pid: rows}, the processes of one start)
    over the load [t_load, t_end] (unix times): its slopes (per minute, summed
    over its processes) over the second half of its time under load, from
    max(its birth, t_load) to min(its last sample, t_end), when that window is
    at least min_window_s (the first half is its warm-up); each process
    counted must have at least 4 samples spanning a quarter of the window.
    Not judged (a "not_judged" reason in the row, no slopes) when the window
    is shorter or no process spans it.  The trim row (a lifetime serving when
    the load began and alive at the trim: each of its processes with a trim
    record) is the RSS after malloc_trim(0) minus the RSS of the last sample
    before the load began, summed over them."""
    born = min(rows[0]["t"] for rows in procs.values())
    start = max(born, t_load)
    end = min(max(rows[-1]["t"] for rows in procs.values()), t_end)
    t_from = (start + end) / 2
    out = {"pids": sorted(procs), "born": round(born, 1), "window": [round(t_from, 1),
                                                                    round(end, 1)],
           "window_min": round(max(0.0, end - t_from) / 60, 1)}
    if end - t_from < min_window_s:
        out["not_judged"] = (f"the second half of its time under load is {out['window_min']} "
                             f"min (< {min_window_s / 60:g})")
        return out
    slopes = {"rss": 0.0, "used": 0.0, "blocks": 0.0}
    judged = []
    for pid, rows in procs.items():
        win = [r for r in rows if t_from <= r["t"] <= end]
        if len(win) < 4 or win[-1]["t"] - win[0]["t"] < (end - t_from) / 4:
            continue
        judged.append(pid)
        for k in slopes:
            slopes[k] += _per_min([(r["t"], r[k]) for r in win]) or 0.0
    if not judged:
        out["not_judged"] = "no process sampled through its window"
        return out
    out.update({k: round(v, 3 if k != "blocks" else 1) for k, v in slopes.items()})
    if born > t_load:
        return out  # a restart: its RSS at the load's start is not its own
    trims = []
    for pid in judged:
        rows = procs[pid]
        tr = [r for r in rows if "trim_after" in r]
        # The last sample before the load began (RSS ramps fast in its first
        # minute: a sample 20 s in would hide that growth).
        before = [r for r in rows if r["t"] <= t_load]
        if not tr or not before:
            return out
        trims.append((before[-1]["rss"], tr[-1]["trim_before"], tr[-1]["trim_after"]))
    out["rss_load_start"] = round(sum(a for a, _, _ in trims), 1)
    out["rss_before_trim"] = round(sum(b for _, b, _ in trims), 1)
    out["rss_after_trim"] = round(sum(c for _, _, c in trims), 1)
    out["kept_after_trim"] = round(out["rss_after_trim"] - out["rss_load_start"], 1)
    return out


def lifetime_name(server, lives, i):
    """How the verdict names lifetime i (0-based) of server's lives (rows in
    order of birth): the server's name when it had one."""
    if len(lives) == 1:
        return server
    born = time.strftime("%H:%M:%S", time.gmtime(lives[i]["born"]))
    return f"{server} (lifetime {i + 1} of {len(lives)}, born {born} UTC)"


def memory_verdict(series, t_load, t_end, ref="R", used_margin=1.0, blocks_margin=3000.0,
                   kept_margin=64.0, min_window_s=MEM_MIN_WINDOW_S):
    """(table, violations, not_judged) of the memory invariant (the comment
    above).  series: memory_series' output; t_load and t_end the load's start
    and end (unix times); table {server: [memory_of_lifetime's row per
    lifetime, in order of birth]}; not_judged: a line per lifetime too short
    to judge (printed: not judged is not "ok").  A judged lifetime fails when,
    beyond the reference's (ref's first judged lifetime; none: beyond zero),
    its malloc in-use bytes grow more than used_margin MiB/min, its Python
    blocks more than blocks_margin per minute, or it keeps more than
    kept_margin MiB of RSS after malloc_trim(0) (growth since the load began;
    judged only against a reference: a server warming up keeps hundreds of
    MiB)."""
    table = {}
    for n, lives in series.items():
        by_birth = sorted(lives.values(), key=lambda p: min(r[0]["t"] for r in p.values()))
        table[n] = [memory_of_lifetime(p, t_load, t_end, min_window_s) for p in by_birth]
    base = next((r for r in table.get(ref, []) if "not_judged" not in r), {})
    v, not_judged = [], []

    def limit(key, margin):
        if key in base:
            return base[key] + margin, f"{ref}'s {base[key]} + {margin:g}"
        return margin, f"0 + {margin:g}"
    for n, lives in sorted(table.items()):
        for i, row in enumerate(lives):
            who = lifetime_name(n, lives, i)
            if "not_judged" in row:
                not_judged.append(f"{who}: not judged, {row['not_judged']}")
                continue
            if n == ref:
                continue
            for key, margin, what, unit in (("used", used_margin, "malloc in-use bytes grow",
                                             "MiB/min"),
                                            ("blocks", blocks_margin, "Python blocks grow",
                                             "/min")):
                lim, why = limit(key, margin)
                if row[key] > lim:
                    v.append(f"{who}: {what} {row[key]} {unit} (> {why})")
            if "kept_after_trim" in row and "kept_after_trim" in base:  # warm-up: R's measure
                lim, why = limit("kept_after_trim", kept_margin)
                if row["kept_after_trim"] > lim:
                    v.append(f"{who}: RSS after malloc_trim(0) is {row['kept_after_trim']} MiB "
                             f"above the load's start (> {why})")
    return table, v, not_judged


# ---------------------------------------------------------------- report

def summarize(load, t_load):
    recs = load.records
    out = {"requests": len(recs)}
    for k in ("ok", "wrong", "error", "unclear", "truncated", "hung", "client_abort"):
        out[k] = sum(1 for r in recs if r["outcome"] == k)
    done = sorted(r["secs"] for r in recs if r["outcome"] in ("ok", "wrong"))
    if done:
        out["latency_s"] = {"p50": done[len(done) // 2],
                            "p99": done[min(len(done) - 1, int(0.99 * len(done)))],
                            "max": done[-1]}
    out["max_request_s"] = max((r["secs"] for r in recs), default=0)
    out["by_flow"] = {}
    for f in sorted({r["flow"] for r in recs}):
        row = out["by_flow"][f] = {"requests": sum(1 for r in recs if r["flow"] == f),
                                   "ok": 0}
        for r in recs:
            if r["flow"] == f:
                row[r["outcome"]] = row.get(r["outcome"], 0) + 1
    out["bursts"] = {}   # the requests started right before a mid-push fault
    for r in recs:
        if r.get("burst"):
            row = out["bursts"].setdefault(r["burst"], {"requests": 0})
            row["requests"] += 1
            row[r["outcome"]] = row.get(r["outcome"], 0) + 1
    errs = {}
    for r in recs:
        if r["outcome"] == "error":
            key = r.get("error", "")[:90]
            errs[key] = errs.get(key, 0) + 1
    out["errors_by_message"] = dict(sorted(errs.items(), key=lambda kv: -kv[1])[:15])
    out["requests_per_s"] = round(len(recs) / t_load, 2) if t_load else None
    return out


def plot(path, load, monitor, faults, t_load_end, drained_at):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(13, 11), sharex=True)
    colors = {"ok": "tab:green", "error": "tab:orange", "client_abort": "tab:gray",
              "wrong": "red", "truncated": "magenta", "hung": "black", "unclear": "brown"}
    ax = axes[0]
    for outcome, col in colors.items():
        pts = [(r["start"] + r["secs"], r["secs"]) for r in load.records
               if r["outcome"] == outcome]
        if pts:
            ax.scatter(*zip(*pts), s=6, color=col, label=f"{outcome} ({len(pts)})")
    ax.set_ylabel("request s (at its end)")
    ax.set_yscale("log")
    ax.legend(loc="upper left", fontsize=7, ncol=4)
    ax = axes[1]
    bins = {}
    for r in load.records:
        b = int((r["start"] + r["secs"]) // 10) * 10
        bins.setdefault(r["outcome"], {}).setdefault(b, 0)
        bins[r["outcome"]][b] += 1
    for outcome, per in bins.items():
        xs = sorted(per)
        ax.plot(xs, [per[x] / 10 for x in xs], color=colors.get(outcome), label=outcome)
    ax.set_ylabel("answers/s (10 s bins)")
    ax.legend(loc="upper left", fontsize=7, ncol=4)
    for ax, key, label, scale in ((axes[2], "rss", "RSS MiB", 2**20),
                                  (axes[3], "vllm:mooncake_held_bytes", "held KiB (producers)",
                                   1024)):
        for name in sorted({s["server"] for s in monitor.samples}):
            pts = [(s["t"], s[key] / scale) for s in monitor.samples
                   if s["server"] == name and s.get(key) is not None]
            if pts and (key == "rss" or name.startswith("P")):
                ax.plot(*zip(*pts), label=name, lw=1)
        ax.set_ylabel(label)
        ax.legend(loc="upper left", fontsize=7, ncol=4)
    fcol = {"kill_prefill": "red", "stop_decode": "orange", "host_prefill": "green",
            "etcd_restart": "purple", "link_cut": "black", "netem": "blue"}
    for ev in faults.events:
        end = ev["end"] if ev["end"] is not None else ev["start"] + 1
        for ax in axes:
            ax.axvspan(ev["start"], max(end, ev["start"] + 0.5), color=fcol.get(ev["fault"]),
                       alpha=0.12)
        axes[0].annotate(ev["fault"], (ev["start"], 1), xycoords=("data", "axes fraction"),
                         fontsize=6, rotation=90, va="top")
    for ax in axes:
        ax.axvline(t_load_end, color="k", ls="--", lw=0.8)
        if drained_at is not None:
            ax.axvline(drained_at, color="g", ls=":", lw=0.8)
    axes[-1].set_xlabel("s since load start (dashed: load stops; dotted: back to baseline)")
    fig.suptitle("mooncake-connector chaos soak")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def at_baseline(row, base):
    """[(gauge, value, baseline)] that are not back at the baseline."""
    bad = []
    for g in GAUGES:
        v, b = row.get(g), base.get(g, 0) or 0
        if v is None:
            continue
        if v > b + 1e-9:
            bad.append((g, v, b))
    return bad


# ---------------------------------------------------------------- main

def build_parser():
    """The command line: every flag and its default."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1800, help="seconds of load")
    ap.add_argument("--ci", action="store_true",
                    help="the short version CI runs: --duration 130, every fault once, fewer "
                         "clients")
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--think-s", type=float, default=0.5, help="max pause between a client's "
                    "requests")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"subset of {','.join(FAULTS)}")
    ap.add_argument("--flows", default=",".join(FLOWS),
                    help=f"proxies the clients use, subset of {','.join(FLOWS)} (push: whole "
                         "prompt after the forward; push-lw: layer by layer; push-ll: layer by "
                         "layer with the decode's attention waiting per layer; push-host*: the "
                         "same three from P3, the prefill on the host: the same-host CPU path; "
                         "without them P3 is not started)")
    ap.add_argument("--burst", type=int, default=8,
                    help="push requests started right before SIGKILL of P1, SIGSTOP of D2 and "
                         "a link cut, so that each lands mid-push (0: none)")
    ap.add_argument("--burst-delay-s", type=float, nargs=2, default=(0.01, 0.12),
                    metavar=("MIN", "MAX"), help="the fault follows the burst after this long")
    ap.add_argument("--fd-growth-max", type=int, default=64,
                    help="open files a server (its process group) may hold after the drain "
                         "beyond its baseline (peer connections; a per-request leak is 1000s)")
    ap.add_argument("--fault-period", type=float, default=60.0)
    ap.add_argument("--first-fault-s", type=float, default=20.0)
    ap.add_argument("--stop-s", type=float, default=6.0, help="SIGSTOP length")
    ap.add_argument("--cut-s", type=float, default=6.0, help="link cut length")
    ap.add_argument("--restart-attempts", type=int, default=3,
                    help="tries to bring a SIGKILLed server back (each up to --start-timeout); "
                         "one that never comes back is a harness failure in the verdict")
    ap.add_argument("--netem-s", type=float, default=20.0)
    ap.add_argument("--disconnect-frac", type=float, default=0.1)
    ap.add_argument("--abort-frac", type=float, default=0.07)
    ap.add_argument("--bound-s", type=float, default=180.0,
                    help="a request longer than this is hung (the proxy's limits are lower)")
    ap.add_argument("--proxy-timeout-s", type=float, default=120.0)
    ap.add_argument("--proxy-idle-timeout-s", type=float, default=60.0)
    ap.add_argument("--hold-timeout-s", type=float, default=30.0)
    ap.add_argument("--load-timeout-s", type=float, default=10.0)
    ap.add_argument("--drain-margin-s", type=float, default=60.0)
    ap.add_argument("--small-kv-buffer", type=float, default=1 << 20,
                    help="P2's kv_buffer_size (bytes): eviction pressure")
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    ap.add_argument("--rss-slope-max", type=float, default=None,
                    help="MiB/min; default 8 (30 min soak), 100 with --ci (2 minutes of a "
                         "warming server are noisy: a gross leak only)")
    ap.add_argument("--reference", action="store_true",
                    help="add R, a vLLM server without a connector, sent a copy of the load: "
                         "the RSS invariant compares each server's slope with R's")
    ap.add_argument("--reference-frac", type=float, default=1.0,
                    help="share of the client requests mirrored to R")
    ap.add_argument("--rss-over-reference", type=float, default=4.0,
                    help="MiB/min a server's RSS may grow beyond R's (with --reference)")
    ap.add_argument("--no-memwatch", action="store_true",
                    help="no memwatch in the servers: the memory invariant falls back to the "
                         "RSS slope (--rss-slope-max, --rss-over-reference)")
    ap.add_argument("--memwatch-s", type=float, default=None,
                    help="memwatch's sampling period in each server (default 20 s, 5 with --ci)")
    ap.add_argument("--mem-used-margin", type=float, default=None,
                    help="MiB/min a server's malloc in-use bytes may grow beyond R's (second "
                         "half of the load; without --reference beyond 0); default 1, 100 with "
                         "--ci (2 minutes of fresh servers: a gross leak only)")
    ap.add_argument("--mem-blocks-margin", type=float, default=None,
                    help="Python allocated blocks per minute a server may grow beyond R's; "
                         "default 3000, 200000 with --ci")
    ap.add_argument("--mem-min-window-s", type=float, default=None,
                    help="the shortest window a server's lifetime is judged over by the memory "
                         "verdict (the second half of its time under load; a shorter one is "
                         "printed as not judged); default 600, 30 with --ci")
    ap.add_argument("--mem-kept-margin", type=float, default=None,
                    help="MiB of RSS a server may keep after malloc_trim(0) (growth since the "
                         "load began) beyond R's (judged with --reference only); default 64, "
                         "1024 with --ci")
    ap.add_argument("--start-timeout", type=float, default=900.0,
                    help="vLLM servers: 30-150 s each alone, several at once on a shared 2-core "
                         "host take minutes")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-netns", action="store_true", help="no network namespace (no link "
                    "faults); also the default when not root")
    ap.add_argument("--server-env", action="append", default=[], metavar="NAME:KEY=VALUE",
                    help="extra environment of one server (P1, P2, P3, D1, D2, R), e.g. "
                    "D2:MALLOC_ARENA_MAX=2 or D1:PYTHONTRACEMALLOC=4 (diagnosis runs; "
                    "repeatable)")
    ap.add_argument("--decode-extra-c", action="append", default=[], metavar="KEY=VALUE",
                    help="the decode servers' (D1, D2) kv_connector_extra_config with KEY set to "
                    "VALUE (JSON), e.g. load_failure_policy=fail: vLLM then fails a request "
                    "whose KV load failed and the proxies take it again (decode_retakes in "
                    "the summary; repeatable)")
    ap.add_argument("--workdir")
    ap.add_argument("--json", help="results file")
    ap.add_argument("--png", help="timeline image")
    return ap


def parse_args(argv=None):
    """The command line parsed and checked (--flows, --server-env: args.flows
    a list, args.env_of {server: {key: value}}), the defaults applied."""
    ap = build_parser()
    args = ap.parse_args(argv)
    args.flows = [f for f in args.flows.split(",") if f]
    args.env_of = {}
    for item in args.server_env:
        name, _, kv = item.partition(":")
        key, eq, val = kv.partition("=")
        if name not in ("P1", "P2", "P3", "D1", "D2", "R") or not key or not eq:
            ap.error(f"--server-env {item!r}: expected NAME:KEY=VALUE with NAME one of "
                     "P1, P2, P3, D1, D2, R (e.g. D2:MALLOC_ARENA_MAX=2)")
        args.env_of.setdefault(name, {})[key] = val
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from bench_stats import parse_extra_config
    finally:
        sys.path.pop(0)
    args.decode_extra = parse_extra_config(ap, args.decode_extra_c, "--decode-extra-c")
    bad = [f for f in args.flows if f not in FLOWS]
    if bad or not args.flows:
        ap.error(f"--flows {bad or 'empty'}: expected a subset of {','.join(FLOWS)}")
    apply_defaults(args)
    return args


def apply_defaults(args):
    """--ci's short schedule, then the limits whose default depends on --ci."""
    if args.ci:
        args.duration = min(args.duration, 130)
        args.clients = min(args.clients, 8)
        # every kind once in the 130 s (5 s, then a fault each period; one
        # period spare): 6 kinds with the host prefill's
        args.fault_period = 18.0 if any(f in args.flows for f in HOST_FLOWS) else 22.0
        args.first_fault_s = 5.0
        args.netem_s = 10.0
        args.stop_s = args.cut_s = 5.0
        args.hold_timeout_s = min(args.hold_timeout_s, 20.0)
        args.prompts = min(args.prompts, 24)
    if args.rss_slope_max is None:
        args.rss_slope_max = 100.0 if args.ci else 8.0
    if args.memwatch_s is None:
        args.memwatch_s = 5.0 if args.ci else 20.0
    for key, full, ci in (("mem_used_margin", 1.0, 100.0), ("mem_blocks_margin", 3000.0, 2e5),
                          ("mem_kept_margin", 64.0, 1024.0),
                          ("mem_min_window_s", MEM_MIN_WINDOW_S, 30.0)):
        if getattr(args, key) is None:
            setattr(args, key, ci if args.ci else full)


def set_up(args):
    """The work directory, memwatch's (args.memwatch_dir; None with
    --no-memwatch), the network (up) and the cluster (not started yet), and
    the results the run fills in: (workdir, net, cluster, results)."""
    from mooncake_connector import tiny_model
    tag = f"{os.getpid() % 100000}"
    workdir = args.workdir or tempfile.mkdtemp(prefix="mc-soak-")
    args.memwatch_dir = None
    if not args.no_memwatch:
        args.memwatch_dir = os.environ.get("MC_MEMWATCH") or os.path.join(workdir, "memwatch")
        os.makedirs(args.memwatch_dir, exist_ok=True)
    use_netns = not args.no_netns and have_netns()
    net = Net(tag, enabled=use_netns)
    results = {"args": vars(args), "workdir": workdir, "netns": use_netns, "violations": []}
    model = tiny_model.build()
    net.up()
    cluster = Cluster(workdir, model, net, args)
    return workdir, net, cluster, results


def start_deployment(args, cluster, net, workdir, results):
    """Start etcd, the servers and the proxies; the reference answers; the
    baseline sample; the monitor and the fault schedule running, the load
    built but not started: (t0, mon, base, faults, load)."""
    t_start = time.monotonic()
    log(f"starting etcd, P1 P2 (netns {net.ns if results['netns'] else 'off'}), D1 D2, "
        f"proxies; logs in {workdir}/logs")
    cluster.start(args.start_timeout)
    results["startup_s"] = round(time.monotonic() - t_start, 1)
    log(f"all up in {results['startup_s']} s")
    pool = make_pool(args.seed, max(2, args.prompts // 8), 8, 300)[:args.prompts]
    refs = asyncio.run(references(cluster.servers["P1"].url, pool))
    log(f"{len(refs)} reference answers (P1, computed locally)")
    t0 = time.monotonic()
    results["t0_unix"] = time.time()
    mon = Monitor(cluster, t0)
    base = {n: r for n, r in mon.sample().items()}
    results["baseline"] = base
    mon.start()
    faults = Faults(cluster, net, args, t0)
    load = Load({f: p.url for f, p in cluster.proxies.items()}, pool, refs, args, t0)
    if "R" in cluster.servers:
        load.reference = cluster.servers["R"].url
    if args.burst > 0:
        faults.load = load
    faults.start()
    return t0, mon, base, faults, load


def run_load(args, load, faults, t0):
    """The clients for --duration while the faults happen, with a progress
    line (redrawn on a terminal, logged every 30 s otherwise); when the load
    stopped (s since t0)."""
    last = [0]

    def progress():
        el = time.monotonic() - t0
        recs = load.records
        bad = sum(1 for r in recs if r["outcome"] in ("wrong", "truncated", "hung",
                                                        "unclear"))
        frac = min(1.0, el / args.duration)
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        line = (f"\r[{bar}] {el:6.0f}/{args.duration:.0f} s  {len(recs)} req  "
                f"ok {sum(1 for r in recs if r['outcome'] == 'ok')}  "
                f"err {sum(1 for r in recs if r['outcome'] == 'error')}  "
                f"violations {bad}  faults {len(faults.events)}")
        if sys.stdout.isatty():
            sys.stdout.write(line)
            sys.stdout.flush()
        elif el - last[0] >= 30:
            last[0] = el
            log(line.strip())
    asyncio.run(load.run(args.duration, progress))
    t_load_end = time.monotonic() - t0
    print()
    log(f"load stopped after {t_load_end:.0f} s; healing faults")
    return t_load_end


def heal_and_drain(args, faults, mon, base, t0):
    """Heal every fault, then sample until every server is back at its
    baseline or hold_timeout_s + drain_margin_s have passed: (t_heal,
    drained_at (None: never), left {server: what is not back}, the last
    sample's rows)."""
    faults.heal_all()
    # Back to baseline within hold_timeout_s (+ margin) of the heal.
    t_heal = time.monotonic() - t0
    deadline = time.monotonic() + args.hold_timeout_s + args.drain_margin_s
    drained_at, left = None, {}
    while True:
        rows = mon.sample()
        left = {n: at_baseline(rows[n], base.get(n, {})) for n in rows}
        left = {n: v for n, v in left.items() if v}
        missing = [n for n, r in rows.items() if r.get("vllm:kv_cache_usage_perc") is None]
        if not left and not missing:
            drained_at = time.monotonic() - t0
            break
        if time.monotonic() > deadline:
            left.update({n: "no /metrics answer" for n in missing})
            break
        time.sleep(2)
    return t_heal, drained_at, left, rows


def collect_results(args, results, cluster, mon, faults, load, rows, t_load_end):
    """The run's record in results: faults, requests, RSS slopes, paths,
    counters; the harness's violations (fault_verdict's)."""
    results["faults"] = faults.events
    results["decode_extra_config"] = args.decode_extra
    results["proxies"] = {f: " ".join(p.cmd[p.cmd.index("--flow"):])
                          for f, p in cluster.proxies.items()}
    results["fault_counts"] = {k: sum(1 for e in faults.events if e["fault"] == k)
                               for k in FAULTS}
    results["fault_errors"] = faults.errors
    results["harness_failures"] = faults.harness_failures
    results["restarts"] = faults.restarts
    results["fault_counts_by_target"], harness_v = fault_verdict(
        faults.kinds, faults.events, faults.errors, faults.harness_failures)
    results["summary"] = summarize(load, t_load_end)
    results["final"] = {n: rows[n] for n in rows}
    # Lifetimes serving when the load began (a restarted P1 warms up).
    t_born = min((x["t"] for x in mon.samples), default=0.0) + 10
    results["rss_slope_mib_per_min"] = {
        n: rss_slope(mon.samples, n, t_load_end / 2, t_load_end, t_born)
        for n in cluster.servers}
    # Warm-up or leak: the slope in each quarter of the load (a warm-up
    # flattens, a leak does not), and the samples themselves.
    t_first = min((x["t"] for x in mon.samples), default=0.0)
    results["rss_slope_by_quarter"] = {
        n: [rss_slope(mon.samples, n, max(t_first, q * t_load_end / 4),
                      (q + 1) * t_load_end / 4, t_born) for q in range(4)]
        for n in cluster.servers}
    results["rss_samples"] = [[x["t"], x["server"], x["pid"],
                               round(x["rss"] / 2**20, 1)]
                              for x in mon.samples if x["rss"]]
    results["same_host_path"] = path_totals(mon.counters)
    results["connector"] = {n: {k: v for k, v in (scrape(s.url) or {}).items()
                                if k.startswith("vllm:mooncake_") and "bucket" not in k}
                            for n, s in cluster.servers.items()}
    results["proxy_metrics"] = {f: {k: v for k, v in (scrape(p.url) or {}).items()
                                    if k.startswith("mooncake_proxy_responses")
                                    or k.endswith(("_errors_total", "_failovers_total",
                                                   "_retakes_total"))}
                                for f, p in cluster.proxies.items()}
    return harness_v


def memory_violations(args, results, servers, server_of_pgid, t_load_end, ref):
    """The memory invariant: memwatch's verdict (results["memory"]) or,
    without memwatch, each server's RSS slope against R's (ref) or
    --rss-slope-max."""
    v = []
    t0_unix = results["t0_unix"]
    if args.memwatch_dir:
        try:
            series = memory_series(read_memwatch(args.memwatch_dir), server_of_pgid)
            table, mv, not_judged = memory_verdict(
                series, t0_unix, t0_unix + t_load_end, used_margin=args.mem_used_margin,
                blocks_margin=args.mem_blocks_margin, kept_margin=args.mem_kept_margin,
                min_window_s=args.mem_min_window_s)
        except (OSError, ValueError, KeyError, TypeError) as e:  # keep the run's results
            table, mv, not_judged = {}, [f"memory verdict failed: {e!r}"], []
        results["memory"] = table
        results["memory_not_judged"] = not_judged
        v.extend(mv)
        for n in servers:
            if not table.get(n):
                v.append(f"{n}: no memwatch samples over the load (memory not judged)")
    for n, sl in results["rss_slope_mib_per_min"].items():
        if sl is None or n == "R" or args.memwatch_dir:
            continue  # with memwatch: reported, the memory verdict judges
        if ref is not None:
            if sl > ref + args.rss_over_reference:
                v.append(f"{n}: RSS grows {sl} MiB/min (> the reference server R's "
                         f"{ref} + {args.rss_over_reference})")
        elif sl > args.rss_slope_max:
            v.append(f"{n}: RSS grows {sl} MiB/min (> {args.rss_slope_max})")
    return v


def judge(args, results, cluster, load, base, rows, left, server_of_pgid, harness_v,
          t_load_end):
    """The invariants: results["violations"] filled in (and the mirror, memory,
    fds and examples records)."""
    s = results["summary"]
    v = results["violations"]
    for k in ("hung", "wrong", "truncated", "unclear"):
        if s[k]:
            v.append(f"{s[k]} {k} requests")
    if left:
        v.append(f"not back at baseline within hold_timeout_s+{args.drain_margin_s:g} s: "
                 f"{left}")
    ref = results["rss_slope_mib_per_min"].get("R")
    results["mirror"] = dict(load.mirror) if load.reference else None
    v.extend(memory_violations(args, results, cluster.servers, server_of_pgid, t_load_end,
                               ref))
    results["fds"] = {n: {"baseline": base.get(n, {}).get("fds"), "end": rows[n].get("fds")}
                      for n in rows}
    for n, fd in results["fds"].items():
        if fd["baseline"] and fd["end"] and fd["end"] > fd["baseline"] + args.fd_growth_max:
            v.append(f"{n}: {fd['end']} open files after the drain, baseline "
                     f"{fd['baseline']} (+{args.fd_growth_max} allowed)")
    for f in args.flows:
        if not s["by_flow"].get(f, {}).get("ok"):
            v.append(f"flow {f}: no request succeeded")
    v.extend(same_host_verdict(results["same_host_path"], args.flows))
    if args.reference and ref is None and not args.memwatch_dir:
        v.append("the reference server R has no RSS slope (down during the load?)")
    v.extend(harness_v)
    if not s["ok"]:
        v.append("no request succeeded")
    results["examples"] = [r for r in load.records
                           if r["outcome"] in ("wrong", "truncated", "hung", "unclear")][:20]


def report(results):
    """Log the run's summary and its violations: the exit code (1: a violation)."""
    s = results.get("summary", {})
    log(f"requests {s.get('requests')}  ok {s.get('ok')}  errors {s.get('error')}  client "
        f"aborts {s.get('client_abort')}  hung {s.get('hung')}  wrong {s.get('wrong')}  "
        f"truncated {s.get('truncated')}  faults {results.get('fault_counts')}")
    log(f"faults per kind per target {results.get('fault_counts_by_target')}; restarts "
        f"{results.get('restarts')}")
    log(f"by flow {s.get('by_flow')}; mid-push bursts {s.get('bursts')}")
    log(f"push paths (per server, every lifetime) {results.get('same_host_path')}")
    retakes = {f: m.get("mooncake_proxy_decode_retakes_total")
               for f, m in (results.get("proxy_metrics") or {}).items()}
    log(f"decode legs taken again per flow's proxy (decode_retakes) {retakes}; the decodes' "
        f"extra config {results.get('decode_extra_config')}")
    log(f"RSS slope MiB/min {results.get('rss_slope_mib_per_min')}; drained in "
        f"{results.get('drain_s')} s")
    for n, lives in sorted((results.get("memory") or {}).items()):
        for i, row in enumerate(lives):
            if "not_judged" not in row:
                log(f"memory {lifetime_name(n, lives, i)}: the second half of its time under "
                    f"load ({row['window_min']} min), MiB/min RSS {row['rss']}, malloc in use "
                    f"{row['used']}, Python blocks {row['blocks']}/min; RSS load start "
                    f"{row.get('rss_load_start')} -> before trim {row.get('rss_before_trim')} "
                    f"-> after trim {row.get('rss_after_trim')} MiB (kept "
                    f"{row.get('kept_after_trim')})")
    for line in results.get("memory_not_judged") or ():
        log(f"memory {line}")
    if results["violations"]:
        log("VIOLATIONS:\n  " + "\n  ".join(results["violations"]))
        return 1
    log("all invariants hold")
    return 0


def main(argv=None):
    args = parse_args(argv)
    workdir, net, cluster, results = set_up(args)
    try:
        t0, mon, base, faults, load = start_deployment(args, cluster, net, workdir, results)
        t_load_end = run_load(args, load, faults, t0)
        t_heal, drained_at, left, rows = heal_and_drain(args, faults, mon, base, t0)
        mon.stop_evt.set()
        mon.join(timeout=10)
        server_of_pgid = {x["pid"]: x["server"] for x in mon.samples if x["pid"]}
        if args.memwatch_dir:
            try:
                trim_memwatch(args.memwatch_dir, server_of_pgid, results)
            except OSError as e:
                log(f"malloc_trim round failed: {e!r}")
        results["load_s"] = round(t_load_end, 1)
        results["drain_s"] = None if drained_at is None else round(drained_at - t_heal, 1)
        harness_v = collect_results(args, results, cluster, mon, faults, load, rows, t_load_end)
        judge(args, results, cluster, load, base, rows, left, server_of_pgid, harness_v,
              t_load_end)
        if args.png:
            plot(args.png, load, mon, faults, t_load_end, drained_at)
        if load.sink is not None:
            load.sink.close()
    finally:
        cluster.stop()
        net.down()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return report(results)


if __name__ == "__main__":
    sys.exit(main())
