"""Stopped-producer fault probe: real vLLM servers, the push flow, the
prefill (producer) SIGSTOPped while the decode lends it blocks.

    python3 -P benchmarks/stopped_producer_probe.py --device cpu|cuda [--gpu-path on|off]
        [--phases cont:push,cont:push_layer_load,kill:push] [--lease-s 3] [--out DIR]

One run starts (mooncake_connector.deployment) the metadata server, a
prefill, a decode and a colocated vLLM server on one host, and two push
proxies in front of prefill and decode: whole-prompt push (--push-layerwise
off) and push_layer_load (layer by layer, the decode's attention waits per
layer).  Producer and decode share the host, so the producer copies into the
decode's KV memory itself: CUDA IPC on --device cuda (the same-host GPU
path), the same-host CPU path (process_vm_writev, MC_SAME_HOST_CPU=1) on
--device cpu; neither has a connection of ours that a cut would stop.  The
decode gets a short lease (kv_connector_extra_config load_timeout_s and
push_layer_timeout_s = --lease-s) and flow_a off (a request without
kv_transfer_params is computed there, never looked up at the producer).

After warm-up pushes through both proxies (the decode learns the producer
is a process on this host; the push path is seen to load KV), each phase
(--phases, END:MODE[+MODE]):

1. SIGSTOP to the prefill server's process group (every member seen
   stopped), then one push request per MODE through its proxy (the "target":
   the decode admits it, lends it blocks and sends the stopped producer the
   target), with one plain decode request sent while the target waits;
2. more plain requests straight to the decode while the producer stays
   stopped (computed there: they take blocks from vLLM's free queue);
3. the decode idle, producer still stopped: its /metrics read;
4. END: SIGCONT (cont) or SIGKILL (kill) to the prefill's group; the decode
   watched until the held blocks are back;
5. more requests through the proxies and straight to the decode.

Every answer (greedy, temperature 0, ignore_eos) is compared with the
colocated server's for the same prompt.  Checks (one PASS/FAIL line each;
exit status 1 if any failed, 2 if the servers did not start):

* bound: each target ended, answered (recomputed), within lease + grace
  (push.PUSH_GRACE_S) + --slack-s, and not before lease + grace - 0.5 s
  (it did wait for the stopped producer); the decode counted a recompute
  (vllm:mooncake_recomputes_total) per target;
* held: the decode's vllm:mooncake_push_fence_holds_total rose by at least
  one per target, no "blocks go back" line in its log while the producer was
  stopped, and vllm:kv_cache_usage_perc > 0 with the decode idle (the held
  blocks are still taken from vLLM's pool);
* identical: every answer of the run (warm-up, targets, requests while
  stopped, after SIGCONT/SIGKILL) token-identical to colocated (no late
  write of the resumed producer landed in blocks given to another request);
* released: after SIGCONT / SIGKILL the decode logged "its blocks go back to
  vLLM" once per hold and vllm:kv_cache_usage_perc went back to 0 (idle),
  within --release-s;
* retaken (only with --extra-c load_failure_policy=fail, under which vLLM
  fails a request whose load failed instead of computing its prompt): the
  proxies counted a decode_retakes per target (mooncake_connector.
  proxy_retake: the proxy sends such a leg once more, so "identical" holds);
* no hang: every request answered 200 within its HTTP timeout, the phase's
  plain requests within --other-bound-s, and at the end the decode (and a
  resumed prefill) answer /health with no request running or waiting.

Plus setup checks: the warm-up pushes loaded KV through each proxy.  The
SIGSTOP lands before the target is sent (deterministic), so the producer
never starts a copy; a copy stopped midway (the case the holds exist for)
is what benchmarks/soak.py's host_prefill fault aims at, by timing.  Results:
--out DIR/stopped_producer_probe.json and .txt (the summary), DIR/logs.tar.xz
(the servers' logs).  docs/vllm-gpu.md, "Stopped-producer probe", has the
GPU machine's command; tests/test_stopped_producer_probe.py runs it on CPU
(benchmarks/fault_probes.py: with benchmarks/layer_read_probe.py, one server
set for both).
"""
import argparse
import concurrent.futures
import json
import os
import re
import signal
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

#: The push proxies: mode -> (Deployment proxy name, serving.proxy keyword arguments).
MODES = {"push": ("push", {"flow": "push", "extra_args": ("--push-layerwise", "off")}),
         "push_layer_load": ("push-layer-load", {
             "flow": "push", "extra_args": ("--push-layerwise", "on",
                                            "--push-layer-load", "on")})}
ENDS = ("cont", "kill")
RELEASE_LINE = "its blocks go back to vLLM"
HOLD_LINE = "are not given back to vLLM until that process"
HOLDS = "vllm:mooncake_push_fence_holds_total"
CUTS = "vllm:mooncake_push_fence_cuts_total"
RECOMPUTES = "vllm:mooncake_recomputes_total"
USAGE = "vllm:kv_cache_usage_perc"
LAYER_LOADS = "vllm:mooncake_push_layer_loads_total"
LAYER_LOADS_ASYNC = "vllm:mooncake_push_layer_load_async_sched_total"
LAYER_LOADS_RUNNER = "vllm:mooncake_push_layer_load_runner_total"


def parse_phases(text):
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        end, _, modes = item.partition(":")
        modes = [m for m in modes.split("+") if m]
        if end not in ENDS or not modes or any(m not in MODES for m in modes):
            raise ValueError(f"--phases item {item!r}: expected END:MODE[+MODE], END one of "
                             f"{ENDS}, MODE one of {tuple(MODES)}")
        out.append((end, modes))
    if not out:
        raise ValueError("--phases: no phase")
    if any(end == "kill" for end, _ in out[:-1]):
        raise ValueError("--phases: a kill phase can only be the last (the prefill is not "
                         "restarted)")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the vLLM servers run: cpu (vLLM's CPU backend; the producer "
                         "writes through the same-host CPU path) or cuda (all on GPU 0: "
                         "mooncake_connector.vllm_gpu)")
    ap.add_argument("--gpu-path", choices=["on", "off"], default="on",
                    help="--device cuda: the engine's same-host GPU path (CUDA IPC; on) or "
                         "TCP with GPU staging (MC_GPU_IPC=0; off)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="--device cuda: the servers' dtype")
    ap.add_argument("--attention-backend", default="TRITON_ATTN",
                    help="--device cuda: vLLM's --attention-backend (auto: vLLM's choice)")
    ap.add_argument("--kv32k", action="store_true",
                    help="the KV-heavy tiny model of serving_bench.py (32 KiB of KV per token) "
                         "instead of the default tiny model")
    ap.add_argument("--kv-cache-mib", type=int, default=64, help="each server's KV cache")
    ap.add_argument("--phases", default="cont:push,cont:push_layer_load,kill:push",
                    help="END:MODE[+MODE],... END: cont (SIGCONT) or kill (SIGKILL, last "
                         "phase only); MODE: push or push_layer_load (one target each)")
    ap.add_argument("--lease-s", type=float, default=3.0,
                    help="the decode's load_timeout_s and push_layer_timeout_s (> 1)")
    ap.add_argument("--slack-s", type=float, default=8.0,
                    help="a target may end this long after lease + grace")
    ap.add_argument("--release-s", type=float, default=20.0,
                    help="held blocks must be back this long after SIGCONT / SIGKILL")
    ap.add_argument("--other-bound-s", type=float, default=60.0,
                    help="bound on each plain request's time (they never wait for the producer)")
    ap.add_argument("--others", type=int, default=3,
                    help="plain decode requests while the producer is stopped, per phase")
    ap.add_argument("--after", type=int, default=2,
                    help="requests per path after SIGCONT / SIGKILL, per phase")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--words", type=int, default=120, help="words per prompt")
    ap.add_argument("--http-timeout", type=float, default=120.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--decode-no-async-scheduling", action="store_true",
                    help="--device cuda: the decode server with --no-async-scheduling (vLLM's "
                         "GPU default is on, and under it the connector takes a layer load as "
                         "the whole-prompt push; off, a push_layer_load target really waits per "
                         "layer and its failure takes vLLM's in-step recovery)")
    ap.add_argument("--extra-c", action="append", default=[], metavar="KEY=VALUE",
                    help="the decode's kv_connector_extra_config with KEY set to VALUE (JSON: "
                         "true, 5, \"x\"; a bare word is a string; repeatable), e.g. "
                         "early_recv=true")
    ap.add_argument("--out", default=None, help="directory for the JSON, the summary and logs")
    args = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    from bench_stats import parse_extra_config
    args.extra_config = parse_extra_config(ap, args.extra_c)
    try:
        args.phase_list = parse_phases(args.phases)
    except ValueError as e:
        ap.error(str(e))
    if args.lease_s <= 1.0:
        ap.error("--lease-s must be > 1 (push_layer_timeout_s's rule)")
    if args.device == "cpu" and (args.gpu_path != "on" or args.dtype != "float32"
                                 or args.attention_backend != "TRITON_ATTN"):
        ap.error("--gpu-path, --dtype and --attention-backend are for --device cuda")
    if args.device == "cpu" and args.decode_no_async_scheduling:
        ap.error("--decode-no-async-scheduling is for --device cuda (vLLM's CPU backend has "
                 "asynchronous scheduling off already)")
    return args


def scrape(url, timeout=10.0):
    """{metric name (reason label appended as name{reason}): summed value}, or None."""
    from mooncake_connector.deployment import scrape_metrics
    return scrape_metrics(url, timeout)


RECOMPUTE_PREFIX = RECOMPUTES + "{"
#: A plain request (no kv_transfer_params, flow_a off) counts a recompute of
#: this reason; the targets' are the others.
PLAIN_REASON = RECOMPUTE_PREFIX + "no_kv_transfer_params}"
RELEASE_RE = re.compile(r"\(process \d+\) (ran [0-9.]+ s without being stopped|answered \w+|"
                        r"exited) after ([0-9.]+) s; " + re.escape(RELEASE_LINE))


def recomputes(m):
    """The decode's recomputes of loads that failed (any reason but a plain request's)."""
    return sum(v for k, v in (m or {}).items()
               if k.startswith(RECOMPUTE_PREFIX) and k != PLAIN_REASON)


def release_reasons(path, since):
    """[(why, seconds held)] of the decode's "blocks go back" lines from byte since."""
    try:
        with open(path, "rb") as f:
            f.seek(since)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [(m.group(1), float(m.group(2))) for m in RELEASE_RE.finditer(text)]


def group_states(pgid):
    """{pid: /proc state letter} of the members of process group pgid."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                st = f.read()
            rest = st[st.rindex(b")") + 2:].split()
            if int(rest[2]) == pgid:
                out[int(d)] = rest[0].decode()
        except (OSError, ValueError, IndexError):
            continue
    return out


def count_lines(path, since, text):
    try:
        with open(path, "rb") as f:
            f.seek(since)
            return f.read().decode("utf-8", "replace").count(text)
    except OSError:
        return 0


class Probe:
    def __init__(self, args, dep, log):
        self.args, self.dep, self.log = args, dep, log
        self.ref = {}        # prompt -> colocated token ids
        self.requests = []   # every request of the run
        self.checks = []     # {"check", "ok", "detail"}
        self.phases = []
        self.seed = 0

    # -------------------------------------------------------------- requests

    def prompt(self):
        from mooncake_connector.demo import _prompt
        self.seed += 1
        return _prompt(self.args.words, 90_000 + self.seed)

    def body(self, p):
        return {"model": "tiny", "prompt": p, "temperature": 0.0,
                "max_tokens": self.args.max_tokens, "ignore_eos": True,
                "return_token_ids": True, "stream": True,
                "stream_options": {"include_usage": True}}

    def ask(self, kind, url, p, phase=None, bound=None):
        """One streamed greedy completion; recorded with its colocated check."""
        from mooncake_connector.openai_client import request
        t0 = time.monotonic()
        rec = {"kind": kind, "phase": phase, "prompt": p[:60] + "..."}
        try:
            r = request(url, "/v1/completions", self.body(p), timeout=self.args.http_timeout)
            rec.update(status=r.status, error=r.error, tokens=r.token_ids,
                       cached_tokens=r.cached_tokens)
        except Exception as e:  # noqa: BLE001 - a timeout or reset is a finding
            rec.update(status=0, error=repr(e)[:500], tokens=None, cached_tokens=None)
        rec["seconds"] = round(time.monotonic() - t0, 3)
        rec["bound_s"] = bound
        rec["in_bound"] = bound is None or rec["seconds"] <= bound
        rec["ok"] = rec["status"] == 200 and not rec["error"]
        if p not in self.ref:
            c = request(self.dep.reference_url, "/v1/completions", self.body(p),
                        timeout=self.args.http_timeout)
            self.ref[p] = c.token_ids if c.status == 200 and not c.error else None
        rec["identical"] = rec["ok"] and self.ref[p] is not None and rec["tokens"] == self.ref[p]
        self.requests.append(rec)
        self.log(f"  {kind:<28} {rec['seconds']:7.2f} s  status {rec['status']}  "
                 f"{'identical' if rec['identical'] else 'DIFFERENT/FAILED'}"
                 f"{'' if rec['ok'] else ' error ' + str(rec['error'])[:200]}"
                 f"  cached {rec['cached_tokens']}")
        return rec

    def proxy_url(self, mode):
        return self.dep.proxies[MODES[mode][0]].url

    def retakes(self, modes):
        """The proxies' decode_retakes (a decode leg taken again after it
        failed before its first token), summed over modes' proxies."""
        from mooncake_connector.deployment import proxy_stats
        return sum(proxy_stats(self.proxy_url(m)).get("decode_retakes", 0) for m in modes)

    def check(self, name, ok, detail):
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        self.log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")

    def metrics(self, url=None):
        return scrape(url or self.dep.decode.url) or {}

    def wait_metric(self, pred, timeout):
        """Decode /metrics until pred(m) (vLLM's stat logger feeds the
        connector's counters per step), at most timeout s; the last read."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if pred(m) or time.monotonic() >= deadline:
                return m
            time.sleep(0.25)

    # ---------------------------------------------------------------- phases

    def loads_since(self, m0, n):
        """Decode /metrics once its push loads rose by n since m0 (at most
        15 s): (push loads, tokens loaded, failed-load recomputes) since m0."""
        k = "vllm:mooncake_push_loads_total"
        m = self.wait_metric(lambda m: m.get(k, 0) - m0.get(k, 0) >= n, 15)
        return (m.get(k, 0) - m0.get(k, 0),
                m.get("vllm:mooncake_load_tokens_total", 0)
                - m0.get("vllm:mooncake_load_tokens_total", 0),
                recomputes(m) - recomputes(m0))

    def warm_up(self):
        """Two pushes per mode: the decode learns who the producer is (its
        first message to it), and each mode is seen to load KV (tokens
        loaded, fewer recomputes than requests: the decode's counters, as
        push_layer_load reports its prompt as cached even when recomputed)."""
        loaded, info = {}, {}
        for mode in MODES:
            m0 = self.metrics()
            rs = [self.ask(f"warm-up {mode}", self.proxy_url(mode), self.prompt(), "warm-up")
                  for _ in range(2)]
            n, toks, rec = self.loads_since(m0, len(rs))
            info[mode] = {"push_loads": n, "tokens_loaded": toks, "recomputes": rec}
            loaded[mode] = all(r["ok"] for r in rs) and n >= len(rs) and toks > 0 \
                and rec < len(rs)
        pre = self.metrics(self.dep.prefill.url)
        info["prefill_push_bytes"] = pre.get("vllm:mooncake_push_bytes_total")
        info["prefill_push_bytes_same_host_cpu"] = pre.get(
            "vllm:mooncake_push_bytes_same_host_cpu_total")
        self.warm = info
        self.check("setup: warm-up pushes loaded KV", all(loaded.values()),
                   "decode, per mode (2 requests each): "
                   + "; ".join(f"{m} {info[m]['push_loads']:.0f} push loads, "
                               f"{info[m]['tokens_loaded']:.0f} tokens loaded, "
                               f"{info[m]['recomputes']:.0f} recomputed" for m in MODES)
                   + f"; prefill pushed {info['prefill_push_bytes']} B"
                   + (f" ({info['prefill_push_bytes_same_host_cpu']} B of them on the same-host "
                      "CPU path)" if self.args.device == "cpu" else ""))

    def stop_prefill(self):
        from mooncake_connector import serving
        pg = self.dep.prefill.proc.pid
        serving._killpg(pg, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while True:
            st = group_states(pg)
            if st and all(s in "Tt" for s in st.values()):
                return st
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the prefill's group {pg} is not all stopped: {st}")
            time.sleep(0.05)

    def phase(self, i, end, modes):
        from mooncake_connector import serving
        from mooncake_connector.connector.push import PUSH_GRACE_S
        from mooncake_connector.deployment import log_size
        a, dep = self.args, self.dep
        sig = "SIGCONT" if end == "cont" else "SIGKILL"
        name = f"phase {i + 1} ({'+'.join(modes)}, then {sig})"
        self.log(f"{name}:")
        ph = {"phase": i + 1, "end": end, "modes": modes}
        self.phases.append(ph)
        lo = a.lease_s + PUSH_GRACE_S - 0.5
        hi = a.lease_s + PUSH_GRACE_S + a.slack_s
        mark = log_size(dep.decode.log_path)
        m0 = self.metrics()
        r0 = self.retakes(modes)
        states = self.stop_prefill()
        ph["stopped_pids"] = sorted(states)
        t_stop = time.monotonic()
        self.log(f"  prefill group stopped: {states}")
        targets = []
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            for mode in modes:
                fut = ex.submit(self.ask, f"target {mode}", self.proxy_url(mode), self.prompt(),
                                i + 1, hi)
                time.sleep(min(1.0, a.lease_s / 3))  # the target waits at the decode by now
                side = self.ask("plain, during target", dep.decode.url, self.prompt(), i + 1,
                                hi + a.other_bound_s)
                targets.append(fut.result())
                side["during"] = mode
        took = [t["seconds"] for t in targets]
        m1 = self.wait_metric(lambda m: m.get(HOLDS, 0) - m0.get(HOLDS, 0) >= len(modes)
                              and recomputes(m) - recomputes(m0) >= len(modes), 15)
        holds = m1.get(HOLDS, 0) - m0.get(HOLDS, 0)
        recs = recomputes(m1) - recomputes(m0)
        by_reason = {k[len(RECOMPUTE_PREFIX):-1]: v - m0.get(k, 0) for k, v in m1.items()
                     if k.startswith(RECOMPUTE_PREFIX) and k != PLAIN_REASON
                     and v - m0.get(k, 0)}
        # How the decode took the targets: layer loads that waited per layer
        # in the step, or whole-prompt pushes (vLLM's asynchronous scheduling
        # on; vLLM's V2 model runner on a GPU under "recompute").
        ph.update(target_seconds=took, bound_s=[lo, hi], holds=holds, recomputes=by_reason,
                  fence_cuts=m1.get(CUTS, 0) - m0.get(CUTS, 0),
                  layer_loads=m1.get(LAYER_LOADS, 0) - m0.get(LAYER_LOADS, 0),
                  layer_loads_as_whole=m1.get(LAYER_LOADS_ASYNC, 0) - m0.get(LAYER_LOADS_ASYNC, 0),
                  layer_loads_as_whole_runner=m1.get(LAYER_LOADS_RUNNER, 0)
                  - m0.get(LAYER_LOADS_RUNNER, 0))
        self.log(f"  decode: in-step layer loads +{ph['layer_loads']:.0f}, layer loads taken as "
                 f"the whole-prompt push (async scheduling) +{ph['layer_loads_as_whole']:.0f}, "
                 f"(the V2 runner on a GPU) +{ph['layer_loads_as_whole_runner']:.0f}")
        if self.args.extra_config.get("load_failure_policy") == "fail":
            # vLLM fails a request whose load failed (no recompute there):
            # the proxy takes each target again (proxy_retake)
            got = self.retakes(modes) - r0
            ph["decode_retakes"] = got
            self.check(f"{name}: retaken", got >= len(modes),
                       f"the proxies' decode_retakes +{got} (targets {len(modes)}; the "
                       "decode's load_failure_policy is 'fail')")
        self.check(f"{name}: bound",
                   all(t["ok"] and lo <= t["seconds"] <= hi for t in targets)
                   and recs >= len(modes),
                   f"targets answered in {took} s (bound {lo:.1f}-{hi:.1f}: lease {a.lease_s} + "
                   f"grace {PUSH_GRACE_S} + slack {a.slack_s}); decode recomputes of failed loads "
                   f"+{recs:.0f} {by_reason}")
        for _ in range(a.others):
            self.ask("plain, producer stopped", dep.decode.url, self.prompt(), i + 1,
                     a.other_bound_s)
        # Idle, producer still stopped: the held blocks are still taken.
        # (vLLM steps on while blocks are held, has_pending_push_work, so its
        # gauges are fresh; without holds they keep the last step's values.)
        self.wait_metric(lambda m: m.get("vllm:num_requests_running", 1) == 0
                         and m.get("vllm:num_requests_waiting", 1) == 0, 5)
        time.sleep(1.0)
        idle = self.metrics()
        released_early = count_lines(dep.decode.log_path, mark, RELEASE_LINE)
        hold_lines = count_lines(dep.decode.log_path, mark, HOLD_LINE)
        still = all(s in "Tt" for s in group_states(dep.prefill.proc.pid).values())
        ph.update(idle_usage=idle.get(USAGE), hold_log_lines=hold_lines,
                  released_while_stopped=released_early,
                  stopped_s=round(time.monotonic() - t_stop, 2))
        self.check(f"{name}: held",
                   holds >= len(modes) and released_early == 0 and (idle.get(USAGE) or 0) > 0
                   and still,
                   f"push_fence_holds +{holds:.0f} (targets {len(modes)}), fence cuts "
                   f"+{ph['fence_cuts']:.0f}, hold WARN lines {hold_lines}; {released_early} "
                   f"released while stopped; decode idle at "
                   f"{ph['stopped_s']} s stopped: kv_cache_usage_perc {idle.get(USAGE)}"
                   + ("" if still else "; the prefill was no longer stopped"))
        # The end of the stop.
        t_end = time.monotonic()
        if end == "cont":
            serving._killpg(dep.prefill.proc.pid, signal.SIGCONT)
        else:
            dep.prefill.kill()
        deadline = t_end + a.release_s
        back_s = None
        while time.monotonic() < deadline:
            n = count_lines(dep.decode.log_path, mark, RELEASE_LINE)
            m = self.metrics()
            if n >= max(1, hold_lines) and m.get(USAGE) == 0 and \
                    m.get("vllm:num_requests_running", 1) == 0:
                back_s = round(time.monotonic() - t_end, 2)
                break
            time.sleep(0.2)
        m2 = self.metrics()
        n = count_lines(dep.decode.log_path, mark, RELEASE_LINE)
        why = release_reasons(dep.decode.log_path, mark)
        ph.update(release_lines=n, released_after_s=back_s, usage_after=m2.get(USAGE),
                  release_reasons=why)
        self.check(f"{name}: released",
                   back_s is not None,
                   f"{n} \"{RELEASE_LINE}\" line(s) for {hold_lines} hold(s) "
                   f"(the producer: {'; '.join(f'{w} after {t:g} s held' for w, t in why) or '-'})"
                   f" and "
                   f"kv_cache_usage_perc {m2.get(USAGE)} "
                   + (f"{back_s} s after {sig}"
                      if back_s is not None else f"(not both within {a.release_s} s)"))
        m3 = self.metrics()
        for _ in range(a.after):
            for mode in modes:
                self.ask(f"after, {mode}", self.proxy_url(mode), self.prompt(), i + 1,
                         a.other_bound_s + (hi if end == "kill" else 0))
            self.ask("after, plain", dep.decode.url, self.prompt(), i + 1, a.other_bound_s)
        mine = [r for r in self.requests if r["phase"] == i + 1]
        n, toks, rec = self.loads_since(m3, a.after * len(modes) if end == "cont" else 0)
        ph["after"] = {"push_loads": n, "tokens_loaded": toks, "recomputes": rec}
        bad = [r for r in mine if not r["identical"]]
        n_after = sum(r["kind"].startswith("after") for r in mine)
        self.check(f"{name}: identical", not bad,
                   f"{len(mine) - len(bad)}/{len(mine)} answers token-identical to colocated "
                   f"({len(modes)} target(s), {len(mine) - len(modes) - n_after} plain while "
                   f"stopped, {n_after} after; after {sig}: decode push loads {n:.0f}, "
                   f"tokens loaded {toks:.0f}, recomputed {rec:.0f})"
                   + (f"; differing/failed: {[(r['kind'], r['status'], r['error']) for r in bad]}"
                      if bad else ""))
        hung = [r for r in mine if not r["ok"] or not r["in_bound"]]
        self.check(f"{name}: no hang", not hung,
                   f"{len(mine)} requests, all answered within their bounds (slowest "
                   f"{max(r['seconds'] for r in mine):.2f} s)" if not hung else
                   "over bound or failed: "
                   + str([(r["kind"], r["seconds"], r["bound_s"], r["error"]) for r in hung]))

    def run(self):
        """Warm-up, every phase of --phases, the end checks."""
        self.warm_up()
        for i, (end, modes) in enumerate(self.args.phase_list):
            self.phase(i, end, modes)
        self.final()

    def final(self):
        dep = self.dep
        out = {}
        for name, srv in (("decode", dep.decode), ("prefill", dep.prefill)):
            if not srv.alive:
                out[name] = "exited (killed)"
                continue
            from mooncake_connector import serving
            status, _ = serving.http_get(srv.url + "/health", timeout=10)
            m = self.metrics(srv.url)
            out[name] = {"health": status, "running": m.get("vllm:num_requests_running"),
                         "waiting": m.get("vllm:num_requests_waiting"), "usage": m.get(USAGE)}
        ok = all(isinstance(v, str) or (v["health"] == 200 and v["running"] == 0
                                        and v["waiting"] == 0) for v in out.values())
        ok = ok and isinstance(out["decode"], dict)
        self.final_state = out
        self.check("end: nothing hangs", ok, f"servers at the end: {out}")
        bad = [r for r in self.requests if not r["identical"]]
        self.check("end: identical (whole run)", not bad,
                   f"{len(self.requests) - len(bad)}/{len(self.requests)} answers token-identical "
                   "to the colocated server's")


def pack_logs(logs, out):
    try:
        with tarfile.open(os.path.join(out, "logs.tar.xz"), "w:xz") as t:
            t.add(logs, arcname="logs")
    except OSError as e:
        print(f"logs not packed: {e}", flush=True)


class Interrupted(Exception):
    pass


def _on_sigterm(signum, frame):
    # timeout(1) or a lease's end: the servers are stopped (a SIGSTOPped
    # prefill continued first: it would not act on its parent-death SIGTERM)
    # and what was measured is written, as for any failure.
    raise Interrupted(f"signal {signum} (SIGTERM) during the run")


def decode_config(args):
    """The decode's kv_connector_extra_config keys: the lease, flow_a off."""
    return {"load_timeout_s": args.lease_s, "push_layer_timeout_s": args.lease_s,
            "flow_a": False, **args.extra_config}


def deployment(workdir, proxies, decode_extra_config, device="cpu", gpu_path="on",
               dtype="float32", attention_backend="TRITON_ATTN", kv32k=False, kv_cache_mib=64,
               decode_args=(), reference_url=None):
    """The probes' servers, not started (mooncake_connector.deployment): the
    metadata server, a prefill, a decode and a colocated vLLM server on one
    host (--device cpu: the same-host CPU path, MC_SAME_HOST_CPU=1), the push
    proxies {name: serving.proxy keyword arguments} in front of prefill and
    decode; decode_extra_config merged into the decode's
    kv_connector_extra_config, decode_args its extra vLLM arguments;
    reference_url: a colocated server already running (the same model and
    vLLM arguments as this one's would have) as the reference instead of a
    colocated server of its own.  dep.reference_url is the reference's URL
    either way.  (Deployment, the model's description.)  benchmarks/layer_read_probe.py
    and benchmarks/fault_probes.py start theirs here too."""
    from mooncake_connector import tiny_model
    from mooncake_connector.deployment import Deployment
    from mooncake_connector.vllm_gpu import bench_settings
    dev_env, dev_args = bench_settings(device, gpu_path, dtype, servers=3,
                                      attention_backend=attention_backend)
    if device == "cpu":
        dev_env = dict(dev_env, MC_SAME_HOST_CPU="1")  # the path that plays CUDA IPC's role
    overrides = {}
    if kv32k:
        sys.path.insert(0, HERE)
        from serving_bench import KV32K_SPEC
        overrides = dict(KV32K_SPEC)
    model = tiny_model.build(**overrides)
    dep = Deployment(workdir, model, connector="mooncake", flows=(), extra_proxies=proxies,
                     side_args={"decode": list(decode_args)} if decode_args else None,
                     kv_cache_bytes=kv_cache_mib << 20, env=dev_env,
                     extra_vllm_args=dev_args, decode_extra_config=decode_extra_config,
                     colocated=reference_url is None)
    dep.reference_url = reference_url or dep.colocated.url
    return dep, model


def logger(lines):
    """A log function: each line printed and kept in lines."""
    def log(s):
        lines.append(s)
        print(s, flush=True)
    return log


def out_dirs(args, prefix):
    """(workdir, out): --workdir or a new temporary directory (prefix), and
    --out or workdir/out, made."""
    workdir = args.workdir or tempfile.mkdtemp(prefix=prefix)
    out = args.out or os.path.join(workdir, "out")
    os.makedirs(out, exist_ok=True)
    return workdir, out


def start_servers(dep, timeout, log, *probes):
    """Starts dep's servers: True, or False after each of probes (objects
    with .check) recorded the failed check "setup: servers started"."""
    from mooncake_connector.serving import StartError
    t0 = time.monotonic()
    try:
        dep.start(timeout=timeout)
    except StartError as e:
        for probe in probes:
            probe.check("setup: servers started", False, str(e)[-3000:])
        return False
    log(f"servers up in {time.monotonic() - t0:.0f} s")
    return True


def stop_servers(dep):
    """Stops dep's servers, a SIGSTOPped prefill continued first (it would
    not act on its parent-death SIGTERM; stop() needs it running)."""
    if dep.prefill.proc is not None and dep.prefill.alive:
        from mooncake_connector import serving
        serving._killpg(dep.prefill.proc.pid, signal.SIGCONT)
    dep.stop()


def describe(args):
    """Where the probe's servers run, in words."""
    where = ("vLLM CPU backend, same-host CPU path" if args.device == "cpu" else
             f"GPU 0, {args.dtype}, attention {args.attention_backend}, "
             + ("same-host GPU path (CUDA IPC)" if args.gpu_path == "on"
                else "TCP with GPU staging (MC_GPU_IPC=0)")
             + ("; decode --no-async-scheduling" if args.decode_no_async_scheduling else ""))
    if args.extra_config:
        where += f"; decode extra config {json.dumps(args.extra_config)}"
    return where


def write_summary(args, probe, lines, dep, out, where, model, t_run, rc):
    """The RESULT line, --out's stopped_producer_probe.json and .txt and the
    servers' logs (dep stopped); the exit status (1 if a check failed)."""
    failed = [c for c in probe.checks if not c["ok"]]
    if failed and not rc:
        rc = 1
    verdict = (f"RESULT: {'PASS' if not failed else 'FAIL'} ({len(probe.checks) - len(failed)}/"
               f"{len(probe.checks)} checks passed) in {time.monotonic() - t_run:.0f} s")
    probe.log(verdict)
    summary = {"result": "PASS" if not failed else "FAIL", "checks": probe.checks,
               "phases": probe.phases, "warm_up": getattr(probe, "warm", None),
               "final": getattr(probe, "final_state", None), "requests": probe.requests,
               "settings": {k: v for k, v in vars(args).items() if k != "phase_list"},
               "where": where, "model": model,
               "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "command": " ".join(sys.argv)}
    with open(os.path.join(out, "stopped_producer_probe.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "stopped_producer_probe.txt"), "w") as f:
        f.write("\n".join([ln for ln in lines if not ln.startswith("  ")] + [""]))
    pack_logs(dep.logs, out)
    print(f"wrote {out}/stopped_producer_probe.json, .txt, logs.tar.xz", flush=True)
    return rc


def main(argv=None):
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    t_run = time.monotonic()
    lines = []
    log = logger(lines)
    workdir, out = out_dirs(args, "mc-stopped-producer-")
    dep, model = deployment(workdir, {name: kw for name, kw in MODES.values()},
                            decode_config(args), args.device, args.gpu_path, args.dtype,
                            args.attention_backend, args.kv32k, args.kv_cache_mib,
                            ["--no-async-scheduling"] if args.decode_no_async_scheduling else ())
    where = describe(args)
    log(f"stopped-producer probe: {where}; model {model}; lease {args.lease_s} s; phases "
        f"{args.phases}; logs {dep.logs}")
    probe = Probe(args, dep, log)
    rc = 0
    try:
        if not start_servers(dep, args.start_timeout, log, probe):
            rc = 2
        else:
            probe.run()
    except Exception as e:  # noqa: BLE001 - recorded as a failed check, then the summary
        probe.check("probe ran to its end", False, repr(e)[:2000])
        rc = rc or 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop below runs to its end
        stop_servers(dep)
    return write_summary(args, probe, lines, dep, out, where, model, t_run, rc)


if __name__ == "__main__":
    sys.exit(main())
