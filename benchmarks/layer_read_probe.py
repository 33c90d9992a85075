"""Layer read (push_layer_read) against the write-based layer load, real vLLM
servers on one host (docs/connector.md, "Layer read").

    python3 -P benchmarks/layer_read_probe.py --device cpu [--out DIR]

Starts (mooncake_connector.deployment) a prefill, a decode and a colocated
vLLM server and two push proxies: "write" (--push-layer-load on
--push-layer-read off: the prefill copies each layer into the decode's
blocks) and "read" (--push-layer-read on: the decode reads each layer the
prefill announces).  The same-host CPU path (MC_SAME_HOST_CPU=1).  The
decode: lease (push_layer_timeout_s) --lease-s, push_layer_read_stall_s
--stall-s, push_layer_load_max_batch 4 (a layer load beside a running
stream), flow_a off.

Checks (PASS/FAIL lines; exit 1 if any failed, 2 if the servers did not start):

* identical: --n prompts through each proxy, every answer (greedy,
  ignore_eos) token-identical to colocated; the decode loaded them (layer
  loads +2n, layer reads +n, no recompute); the prefill's same-host CPU bytes
  written rose for the write proxy's and not at all for the read proxy's;
* stall, per mode (write, then read): a long stream runs on the decode; the
  prefill's process group is SIGSTOPped and one request goes through the
  mode's proxy (the decode's layer load waits for the stopped producer):
  the stream's longest gap between tokens is that step's stall.  write: at
  least the lease (the decode waits lease + grace for the stopped process);
  read: the decode's read gave up (push_layer_read_gave_up +1: it waited
  --stall-s for a layer, not the lease) and the gap stayed below the lease
  (what write mode waits at least; the gap also holds the step that
  recomputes the prompt and whatever else shares the host's CPUs, so it is
  judged against the lease, not against --stall-s plus a guessed slack).
  Both answers token-identical (recomputed), the stream's too.  SIGCONT
  after each;
* killed: the prefill SIGKILLed, one request through the read proxy:
  answered token-identical (recomputed) within --kill-bound-s.
"""
import argparse
import concurrent.futures
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROXIES = {
    "write": {"flow": "push", "extra_args": ("--push-layerwise", "on", "--push-layer-load", "on",
                                             "--push-layer-read", "off")},
    "read": {"flow": "push", "extra_args": ("--push-layerwise", "on", "--push-layer-load", "on",
                                            "--push-layer-read", "on")},
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu"], default="cpu")
    ap.add_argument("--lease-s", type=float, default=3.0)
    ap.add_argument("--stall-s", type=float, default=0.5)
    ap.add_argument("--kill-bound-s", type=float, default=30.0)
    ap.add_argument("--n", type=int, default=4, help="prompts per proxy for the identical check")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=1800,
                    help="the running stream's tokens (it must outlast the write mode's stall)")
    ap.add_argument("--words", type=int, default=120)
    ap.add_argument("--http-timeout", type=float, default=180.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


class Run:
    def __init__(self, args, dep, log):
        self.args, self.dep, self.log = args, dep, log
        self.checks, self.ref, self.seed, self.info = [], {}, 0, {}

    def check(self, name, ok, detail):
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        self.log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")

    def prompt(self):
        from mooncake_connector.demo import _prompt
        self.seed += 1
        return _prompt(self.args.words, 70_000 + self.seed)

    def ask(self, url, p, max_tokens=None):
        from mooncake_connector.openai_client import request
        body = {"model": "tiny", "prompt": p, "temperature": 0.0, "ignore_eos": True,
                "max_tokens": max_tokens or self.args.max_tokens, "return_token_ids": True,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.monotonic()
        r = request(url, "/v1/completions", body, timeout=self.args.http_timeout)
        r.seconds = time.monotonic() - t0
        return r

    def same(self, r, p, max_tokens=None):
        key = (p, max_tokens)
        if key not in self.ref:
            c = self.ask(self.dep.reference_url, p, max_tokens)
            self.ref[key] = c.token_ids if c.status == 200 and not c.error else None
        return r.status == 200 and not r.error and self.ref[key] is not None and \
            r.token_ids == self.ref[key]

    def m(self, url=None):
        from mooncake_connector.deployment import scrape_metrics
        return scrape_metrics(url or self.dep.decode.url, 10.0) or {}

    def identical(self):
        d0, p0 = self.m(), self.m(self.dep.prefill.url)
        res, written = {}, {}
        for mode in PROXIES:
            pb = self.m(self.dep.prefill.url).get("vllm:mooncake_push_bytes_same_host_cpu_total",
                                                  0)
            rs = []
            for _ in range(self.args.n):
                p = self.prompt()
                rs.append(self.same(self.ask(self.dep.proxies[mode].url, p), p))
            time.sleep(1.5)  # the prefill's counters come with its next stats
            written[mode] = self.m(self.dep.prefill.url).get(
                "vllm:mooncake_push_bytes_same_host_cpu_total", 0) - pb
            res[mode] = rs
        d1 = self.m()
        k = "vllm:mooncake_push_layer_loads_total"
        kr = "vllm:mooncake_push_layer_reads_total"
        rec = sum(v for n, v in d1.items() if n.startswith("vllm:mooncake_recomputes_total")) - \
            sum(v for n, v in d0.items() if n.startswith("vllm:mooncake_recomputes_total"))
        loads, reads = d1.get(k, 0) - d0.get(k, 0), d1.get(kr, 0) - d0.get(kr, 0)
        n = self.args.n
        self.info["identical"] = {"answers": res, "layer_loads": loads, "layer_reads": reads,
                                  "recomputes": rec, "prefill_bytes_written": written}
        self.check("identical", all(all(v) for v in res.values()) and loads == 2 * n and
                   reads == n and rec == 0 and written["write"] > 0 and written["read"] == 0,
                   f"answers identical to colocated: write {sum(res['write'])}/{n}, read "
                   f"{sum(res['read'])}/{n}; decode layer loads +{loads:.0f}, layer reads "
                   f"+{reads:.0f}, recomputes +{rec:.0f}; prefill same-host CPU bytes written: "
                   f"write {written['write']:.0f}, read {written['read']:.0f}")
        del p0

    def rewarm(self, timeout=60.0):
        """After SIGCONT: requests through the read proxy until one is read
        (the decode's layer reads rise; the resumed prefill may need a
        moment to be found again, e.g. its segment on the metadata server)."""
        kr = "vllm:mooncake_push_layer_reads_total"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m0 = self.m().get(kr, 0)
            p = self.prompt()
            r = self.ask(self.dep.proxies["read"].url, p)
            if self.same(r, p) and self.m().get(kr, 0) > m0:
                return True
            time.sleep(1.0)
        return False

    def stall(self, mode):
        """The prefill stopped, then a stream straight to the decode, then
        (the stream running) the target through the mode's proxy: the
        target's layer load stalls the decode's step, i.e. the stream."""
        from mooncake_connector import serving
        a, dep = self.args, self.dep
        warm = self.rewarm()
        ps = self.prompt()
        pg = dep.prefill.proc.pid
        kg = "vllm:mooncake_push_layer_read_gave_up_total"
        g0 = self.m().get(kg, 0)
        serving._killpg(pg, signal.SIGSTOP)
        time.sleep(0.3)
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            fs = ex.submit(self.ask, dep.decode.url, ps, a.stream_tokens)
            time.sleep(0.3)  # the stream runs
            p = self.prompt()
            t0 = time.monotonic()
            r = self.ask(dep.proxies[mode].url, p)
            took = time.monotonic() - t0
            s = fs.result()
            t_end = s.seconds
        serving._killpg(pg, signal.SIGCONT)
        gave_up = self.gave_up_since(kg, g0) if mode == "read" else None
        gap = max(s.itl_s) if s.itl_s else None
        ok_t, ok_s = self.same(r, p), self.same(s, ps, a.stream_tokens)
        still = len(s.token_ids) == a.stream_tokens and t_end > 0.3 + took
        self.info[f"stall_{mode}"] = {"stream_max_gap_s": gap, "target_s": round(took, 3),
                                      "stream_s": round(t_end, 3), "warm": warm,
                                      "stream_tokens": len(s.token_ids),
                                      "stream_identical": ok_s, "target_identical": ok_t,
                                      "read_gave_up": gave_up}
        if mode == "write":
            bound_ok = gap is not None and gap >= a.lease_s
            bound = f">= lease {a.lease_s} s"
        else:
            bound_ok = gap is not None and gap < a.lease_s and gave_up >= 1
            bound = (f"< lease {a.lease_s} s, what write mode waits at least; the decode's "
                     f"read gave up after push_layer_read_stall_s {a.stall_s} s: "
                     f"push_layer_read_gave_up +{gave_up:.0f}")
        self.check(f"stall {mode}", warm and bound_ok and ok_t and ok_s and still,
                   f"the running stream's longest gap {gap if gap is None else round(gap, 3)} s "
                   f"({bound}; the stream took {t_end:.2f} s, ran past the target: {still}); "
                   f"the stopped producer's request answered in {took:.2f} s, identical {ok_t}; "
                   f"the stream identical {ok_s} ({len(s.token_ids)} tokens); read path warm "
                   f"before: {warm}")

    def gave_up_since(self, key, before, timeout=10.0):
        """The decode's layer-read give-ups since `before` (its counters come
        with its next stats: waits up to `timeout` for a rise)."""
        deadline = time.monotonic() + timeout
        while True:
            n = self.m().get(key, 0) - before
            if n >= 1 or time.monotonic() >= deadline:
                return n
            time.sleep(0.5)

    def before_kill(self):
        """Every check but "killed": identical, then the stall in each mode
        (the read path warm again at the end)."""
        self.identical()
        self.stall("write")
        self.stall("read")
        self.rewarm()

    def killed(self):
        self.dep.prefill.kill()
        p = self.prompt()
        r = self.ask(self.dep.proxies["read"].url, p)
        ok = self.same(r, p)
        self.info["killed"] = {"seconds": round(r.seconds, 3), "identical": ok,
                               "status": r.status, "error": str(r.error)[:300]}
        self.check("killed", ok and r.seconds <= self.args.kill_bound_s,
                   f"the read proxy's request with the prefill killed: status {r.status}, "
                   f"{r.seconds:.2f} s, identical {ok}" + (f" ({r.error})" if r.error else ""))


def stopped_producer_probe():
    """benchmarks/stopped_producer_probe.py, whose server helpers start this
    probe's servers too."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import stopped_producer_probe as sp
    return sp


def decode_config(args):
    """The decode's kv_connector_extra_config keys."""
    return {"load_timeout_s": args.lease_s, "push_layer_timeout_s": args.lease_s,
            "push_layer_read_stall_s": args.stall_s, "push_layer_load_max_batch": 4,
            "flow_a": False}


def write_summary(args, run, out, t_run, rc):
    """The RESULT line and --out's layer_read_probe.json; the exit status
    (1 if a check failed)."""
    failed = [c for c in run.checks if not c["ok"]]
    rc = rc or (1 if failed else 0)
    run.log(f"RESULT: {'PASS' if not failed else 'FAIL'} ({len(run.checks) - len(failed)}/"
            f"{len(run.checks)}) in {time.monotonic() - t_run:.0f} s")
    with open(os.path.join(out, "layer_read_probe.json"), "w") as f:
        json.dump({"checks": run.checks, "info": run.info, "settings": vars(args),
                   "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "load_avg": os.getloadavg()}, f, indent=1)
    return rc


def main(argv=None):
    args = parse_args(argv)
    sp = stopped_producer_probe()
    log = sp.logger([])
    workdir, out = sp.out_dirs(args, "mc-layer-read-")
    dep, _ = sp.deployment(workdir, PROXIES, decode_config(args))
    run = Run(args, dep, log)
    rc = 0
    t_run = time.monotonic()
    try:
        if not sp.start_servers(dep, args.start_timeout, log, run):
            rc = 2
        else:
            run.before_kill()
            run.killed()
    except Exception as e:  # noqa: BLE001 - a failed check, then the summary
        run.check("probe ran to its end", False, repr(e)[:2000])
        rc = rc or 1
    finally:
        sp.stop_servers(dep)
    return write_summary(args, run, out, t_run, rc)


if __name__ == "__main__":
    sys.exit(main())
