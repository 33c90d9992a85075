"""CPU a prefill (kv_producer) vLLM server burns while it holds a prompt's KV
that no consumer pulls, for each idle_wait_ms, against idle_wait_ms 0
(vLLM's own back-to-back empty steps) measured in the same run.

    .venv/bin/python benchmarks/producer_idle_bench.py [--waits 0,2,10] [--seconds 3]
    .venv/bin/python benchmarks/producer_idle_bench.py --tp 2 --waits 0,2,2:50

A setting is idle_wait_ms, or idle_wait_ms:idle_wait_max_ms (the cap the
wait doubles up to over consecutive idle steps; a bare number means no
growth, the behaviour before idle_wait_max_ms).  --tp N starts the prefill
server with --tensor-parallel-size N (multiprocessing workers).

Per setting: a fresh deployment (metadata server, prefill and decode
servers, tiny model), the prefill server's CPU (all its processes, from
/proc) while idle, then after one 500-word request whose KV it keeps
(nothing pulls it), over --seconds each.
"""
import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def tree_cpu_ticks(pid):
    """{pid: utime + stime} of pid and all its descendants."""
    kids, ticks = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    st = f.read().rsplit(")", 1)[1].split()
                kids.setdefault(int(st[1]), []).append(int(d))
                ticks[int(d)] = int(st[11]) + int(st[12])
            except OSError:
                pass
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        if p in ticks:
            out[p] = ticks[p]
        todo.extend(kids.get(p, ()))
    return out


def cpu_percent(pid, seconds):
    """CPU of the tree over `seconds`: per process, ticks at the end minus
    ticks at the start (a process started meanwhile counts from 0)."""
    c0 = tree_cpu_ticks(pid)
    time.sleep(seconds)
    c1 = tree_cpu_ticks(pid)
    used = sum(max(0, t - c0.get(p, 0)) for p, t in c1.items())
    return 100.0 * used / os.sysconf("SC_CLK_TCK") / seconds


def measure(wait_ms, seconds, max_ms=None, tp=1):
    import serving_bench as sb
    from mooncake_connector import tiny_model
    from mooncake_connector.deployment import Deployment
    from mooncake_connector.openai_client import request

    model = tiny_model.build(**sb.BENCH_SPEC)
    side = {"prefill": ["--tensor-parallel-size", str(tp), "--distributed-executor-backend",
                        "mp"]} if tp > 1 else None
    dep = Deployment(tempfile.mkdtemp(prefix="mc-idle-bench-"), model, flows=("a",),
                     colocated=False, side_args=side)
    cmd = dep.prefill.cmd
    i = cmd.index("--kv-transfer-config") + 1
    cfg = json.loads(cmd[i])
    extra = cfg.setdefault("kv_connector_extra_config", {})
    extra["idle_wait_ms"] = wait_ms
    extra["idle_wait_max_ms"] = wait_ms if max_ms is None else max_ms
    cmd[i] = json.dumps(cfg)
    dep.start(timeout=1200)
    try:
        pid = dep.prefill.proc.pid
        time.sleep(1)
        idle = cpu_percent(pid, seconds)
        body = {"model": "tiny", "prompt": sb.prompt_of(500, 4242 + int(wait_ms)), "max_tokens": 1,
                "temperature": 0.0}
        r = request(dep.prefill.url, "/v1/completions", body, timeout=120)
        if r.status != 200:
            raise RuntimeError(f"prefill answered {r.status}: {r.error}")
        holding = cpu_percent(pid, seconds)
    finally:
        dep.stop()
    return idle, holding


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waits", default="0,2,10", help="idle_wait_ms values; 0 is the reference")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--tp", type=int, default=1, help="prefill --tensor-parallel-size")
    args = ap.parse_args(argv)
    waits = []
    for x in args.waits.split(","):
        w, _, m = x.partition(":")
        waits.append((float(w), float(m) if m else None))
    if (0.0, None) not in waits:
        waits.insert(0, (0.0, None))
    res = {w: measure(w[0], args.seconds, w[1], args.tp) for w in waits}
    ref = res[(0.0, None)][1]
    for (w, m), (idle, holding) in res.items():
        name = f"{w:g}" + (f" (doubling to {m:g})" if m is not None and m != w else "")
        print(f"TP {args.tp} idle_wait_ms {name:>20}: prefill server idle {idle:5.1f}% of a "
              f"core, holding unpulled KV {holding:5.1f}%  ({holding / ref:4.2f}x of "
              f"idle_wait_ms 0)")
    print(f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
