"""The layer-read probe and the stopped-producer probe on one server set
(vLLM's CPU backend, the same-host CPU path).

    python3 -P benchmarks/fault_probes.py [--lease-s 3] [--sp "ARGS"] [--lr "ARGS"]
        [--start-timeout S] [--workdir DIR] [--out DIR] [--reference-url URL]

Each probe alone starts its own metadata server, prefill, decode and
colocated vLLM server; this runs both on one such set (the server start-up,
most of either probe's time on a small host, once).  The decode gets both
probes' kv_connector_extra_config keys (the same lease; the layer read's
push_layer_read_stall_s and push_layer_load_max_batch 4, a layer load beside
a running stream), and the four push proxies of both are started (push,
push-layer-load; write, read).  The order:

1. benchmarks/layer_read_probe.py's checks but "killed" (identical, stall
   write, stall read) on the fresh servers, as it runs alone;
2. the decode settles: every block hold of the stalls given back (as many
   "blocks go back" lines as holds in its log, kv_cache_usage_perc 0), so
   none is given back during the next probe's phases;
3. benchmarks/stopped_producer_probe.py, all of it (warm-up, --phases, its
   last phase SIGKILLs the prefill, the end checks);
4. the layer read's "killed": one request through the read proxy with the
   prefill killed (here in step 3, not just before it, and after the push
   proxies' requests of that phase: the read proxy's first request since).

--reference-url: a colocated vLLM server already running (the tiny model,
the arguments mooncake_connector.deployment gives a colocated server, 64 MiB
of KV cache: e.g. the tests' session deployment's) as both probes' reference,
instead of a colocated server of their own (one vLLM server's start less).

--sp and --lr: more arguments for each probe (its own options; --device,
--lease-s, --start-timeout, --workdir and --out are this script's).  Writes
each probe's outputs in --out as it does alone (stopped_producer_probe.json,
.txt, logs.tar.xz; layer_read_probe.json), and fault_probes.json with each
probe's exit status.  Exit status: 2 if the servers did not start, 1 if a
check of either failed, else 0.  tests/test_stopped_producer_probe.py runs it.
"""
import argparse
import json
import os
import shlex
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def modules():
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import layer_read_probe as lr
    import stopped_producer_probe as sp
    return sp, lr


def parse_args(argv=None):
    sp, lr = modules()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lease-s", type=float, default=3.0,
                    help="the decode's load_timeout_s and push_layer_timeout_s (both probes)")
    ap.add_argument("--sp", default="", help="stopped_producer_probe.py's other arguments")
    ap.add_argument("--lr", default="", help="layer_read_probe.py's other arguments")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--reference-url", default=None,
                    help="a running colocated server as the reference (none started)")
    args = ap.parse_args(argv)
    own = ("--device", "--lease-s", "--start-timeout", "--workdir", "--out")
    for name in ("sp", "lr"):
        extra = shlex.split(getattr(args, name))
        if any(a.split("=")[0] in own for a in extra):
            ap.error(f"--{name}: {', '.join(own)} are this script's options")
        setattr(args, name + "_argv", extra)
    lease = ["--lease-s", str(args.lease_s)]
    args.sp_args = sp.parse_args(["--device", "cpu"] + lease + args.sp_argv)
    if args.reference_url and args.sp_args.kv32k:
        ap.error("--reference-url: the reference must serve the probes' model (not with --kv32k)")
    args.lr_args = lr.parse_args(lease + args.lr_argv)
    cfg = lr.decode_config(args.lr_args)
    for k, v in sp.decode_config(args.sp_args).items():
        if cfg.setdefault(k, v) != v:
            ap.error(f"the probes want the decode's {k} {v!r} and {cfg[k]!r}")
    args.decode_config = cfg
    return args


def settle(dep, log, timeout=30.0):
    """Until the decode gave back every block hold (a "blocks go back" line
    per hold line in its log, KV usage 0 with nothing running)."""
    sp, _ = modules()
    deadline = time.monotonic() + timeout
    while True:
        holds = sp.count_lines(dep.decode.log_path, 0, sp.HOLD_LINE)
        back = sp.count_lines(dep.decode.log_path, 0, sp.RELEASE_LINE)
        m = sp.scrape(dep.decode.url) or {}
        if back >= holds and m.get(sp.USAGE) == 0 and m.get("vllm:num_requests_running") == 0:
            log(f"decode settled: {holds} hold(s), all given back")
            return True
        if time.monotonic() >= deadline:
            log(f"decode not settled after {timeout:g} s: {holds} hold(s), {back} given back, "
                f"kv_cache_usage_perc {m.get(sp.USAGE)}")
            return False
        time.sleep(0.5)


def main(argv=None):
    args = parse_args(argv)
    sp, lr = modules()
    signal.signal(signal.SIGTERM, sp._on_sigterm)
    t_run = time.monotonic()
    sp_lines = []
    sp_log, lr_log = sp.logger(sp_lines), sp.logger([])
    workdir, out = sp.out_dirs(args, "mc-fault-probes-")
    a = args.sp_args
    dep, model = sp.deployment(workdir, dict({n: kw for n, kw in sp.MODES.values()},
                                             **lr.PROXIES),
                               args.decode_config, kv32k=a.kv32k, kv_cache_mib=a.kv_cache_mib,
                               reference_url=args.reference_url)
    where = sp.describe(a)
    sp_log(f"stopped-producer probe: {where}; model {model}; lease {a.lease_s} s; phases "
           f"{a.phases}; logs {dep.logs}; with the layer-read probe on these servers (decode "
           f"extra config {json.dumps(args.decode_config)}); reference {dep.reference_url}"
           + (" (running already)" if args.reference_url else ""))
    probe, run = sp.Probe(a, dep, sp_log), lr.Run(args.lr_args, dep, lr_log)
    rc = {"stopped_producer_probe": 0, "layer_read_probe": 0}
    steps = [("layer_read_probe", run, run.before_kill),
             ("stopped_producer_probe", probe, lambda: settle(dep, sp_log)),
             ("stopped_producer_probe", probe, probe.run),
             ("layer_read_probe", run, run.killed)]
    try:
        if not sp.start_servers(dep, args.start_timeout, sp_log, probe, run):
            rc = dict.fromkeys(rc, 2)
        else:
            failed = set()
            for name, owner, step in steps:
                if name in failed:
                    continue
                try:
                    step()
                except sp.Interrupted as e:
                    for o in (probe, run):
                        o.check("probe ran to its end", False, repr(e)[:2000])
                    rc = {k: v or 1 for k, v in rc.items()}
                    break
                except Exception as e:  # noqa: BLE001 - a failed check, then the summaries
                    owner.check("probe ran to its end", False, repr(e)[:2000])
                    rc[name] = rc[name] or 1
                    failed.add(name)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop below runs to its end
        sp.stop_servers(dep)
    rc["layer_read_probe"] = lr.write_summary(args.lr_args, run, out, t_run,
                                              rc["layer_read_probe"])
    rc["stopped_producer_probe"] = sp.write_summary(a, probe, sp_lines, dep, out, where, model,
                                                    t_run, rc["stopped_producer_probe"])
    with open(os.path.join(out, "fault_probes.json"), "w") as f:
        json.dump({"rc": rc, "seconds": round(time.monotonic() - t_run, 1),
                   "decode_extra_config": args.decode_config}, f, indent=1)
    return max(rc.values())


if __name__ == "__main__":
    sys.exit(main())
