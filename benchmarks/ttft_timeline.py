"""Where a push layer-load request's time to first token goes (issue 31).

    MC_SAME_HOST_CPU=0 PYTHONPATH=. .venv/bin/python -P benchmarks/ttft_timeline.py \\
        [--lengths 128,1024,1900] [--requests 8] [--pin prefill=0,decode=1,colocated=0] \\
        [--out build/ttft_timeline.json]

Starts the metadata server, prefill, decode and colocated vLLM CPU servers
(the KV-heavy model of serving_bench.py --kv32k: 8 layers, 32 KiB of KV per
token), a push proxy with layer load (--push-layerwise on --push-layer-load
on) and a pass-through proxy in front of the colocated server, all with
MC_TRACE (mooncake_connector/trace.py) set.  It sends each prompt through
colocated (direct), colocated (via the pass-through proxy) and push layer
load, in a fresh random order per prompt, one request at a time, and
reads the trace back: per push request the monotonic time of every traced
point from the proxy's receipt, p50 per length, next to colocated's TTFT
and the colocated server's own queue / prefill time (vLLM's histograms,
scraped around each request), and every server thread's CPU time and
run-queue wait around each request (/proc/<pid>/task/<tid>/schedstat:
rows' "cpu_ms", keys "pid:tid:name" and "rq:pid:tid:name").  --whole also
sends each prompt through a whole-prompt push proxy (push_whole: the
decode computes nothing until the prefill is done), so the prefill's
forward can be read with and without the decode's concurrent per-layer
work.  --pin puts each server's processes (and all
their threads) on one CPU with taskset (a 2-vCPU host: do the two servers
contend?).

Same-lease A/B of two code trees (issue 31, run 20): --tree-b PATH starts a
second prefill + decode + push layer-load proxy whose processes import the
connector from PATH (PYTHONPATH), beside the first tree's; its mode is
push_ll_<--label-b> (with --whole also its whole-prompt push,
push_whole_<--label-b>).  --noasync adds a third set from this tree with vLLM's
asynchronous scheduling off (--no-async-scheduling) on its decode and on
its own colocated server (modes push_ll_na, colocated_na).  Every prompt
goes through every mode (one request at a time, fresh random order), so
the variants share the colocated reference and the host's drift.
--no-trace leaves MC_TRACE unset (the bars without the trace's own cost).
Issue 31's bars per push mode, as serving_bench.py's summarize: TTFT p50 <=
its colocated TTFT p50 + the proxy hop (pass-through - direct, p50,
floored at 0) + 2 ms + one layer's transfer (--one-layer-ms, 0: stricter),
gap 1->2 p50 <= its colocated ITL p50 + 2 ms.
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_stats import parse_extra_config, pct_known as _pct  # noqa: E402
from serving_bench import KV32K_SPEC, prompt_of  # noqa: E402

SETTLE_S = 0.05

#: Points of a push layer-load request, in the order they normally happen:
#: (column, side, event, filter).  side "d": the decode, "p": the prefill,
#: "x": the proxy.  The first matching event counts, except where noted.
POINTS = (
    ("proxy_dispatch", "x", "proxy_dispatch", None),
    ("d_arrival", "d", None, None),
    ("p_arrival", "p", None, None),
    ("d_sched", "d", "sched_match", None),
    ("d_fwd_start", "d", "fwd_start", None),
    ("d_target_sent", "d", "notify_sent", "target"),
    ("p_sched", "p", "sched_publish", None),
    ("p_step_bound", "p", "step_bound", None),
    ("p_target_recv", "p", "p_recv", "target"),
    ("p_layer0_saved", "p", "layer_saved", 0),
    ("p_last_saved", "p", "layer_saved", "last"),
    ("p_fwd_end", "p", "fwd_end", None),
    ("p_last_landed", "p", "write_seen_landed", "last"),
    ("p_last_told", "p", "notify_sent", "last"),
    # layer read (push_layer_read): the producer announces a layer once its
    # kernels completed (queued in its engine's gate, or its waiter thread),
    # the decode READs it
    ("p_last_announced", "p", "layer_announced", "last"),
    ("d_last_wait", "d", "layer_wait", "last"),
    ("d_last_recv", "d", "c_recv", "last"),
    ("d_last_read", "d", "read_issued", "last"),
    ("d_last_go", "d", "layer_go", "last"),
    ("d_fwd_end", "d", "fwd_end", None),
    # a whole-prompt push (the decode computes once all KV is in): the
    # producer's "done", the decode's worker counting the load over, vLLM's
    # scheduler learning it (finished_recving), the request's first step
    ("p_done_told", "p", "notify_sent", "done"),
    ("d_done_recv", "d", "c_recv", "done"),
    ("d_recv_done", "d", "recv_done", None),
    ("d_sched_seen", "d", "sched_recv_seen", None),
    ("d_sched_compute", "d", "sched_compute", None),
    ("d_api_first", "d", None, None),
    ("d_chunk_in", "x", "proxy_chunk_in", None),
    ("d_chunk_out", "x", "proxy_chunk_out", None),
    ("p_answer", "x", "proxy_prefill_answer", None),
)


#: The stretches of a push layer-load request's time to first token, each
#: from one point to the next (per request, then p50): (label, from, to).
STRETCHES = (
    ("proxy in -> prefill step bound", None, "p_step_bound"),
    ("prefill forward to last layer saved", "p_step_bound", "p_last_saved"),
    ("last layer's write (saved -> landed)", "p_last_saved", "p_last_landed"),
    ("told: landed -> decode has it", "p_last_landed", "d_last_recv"),
    ("decode: last layer + rest of forward", "d_last_recv", "d_fwd_end"),
    ("decode: sample + output -> API server", "d_fwd_end", "d_api_first"),
    ("decode API server -> proxy", "d_api_first", "d_chunk_in"),
    ("proxy -> client (+ client -> proxy in)", "d_chunk_in", "client_ttft"),
    ("(prefill's tail: last save -> forward end)", "p_last_saved", "p_fwd_end"),
    ("(prefill forward: step bound -> forward end)", "p_step_bound", "p_fwd_end"),
    ("(last layer saved -> decode has it: write + tell)", "p_last_saved", "d_last_recv"),
    ("(prefill's forward thread in save_kv_layer, all layers)", None, "p_save_total"),
    ("(read: last layer saved -> announced, the producer's waiter thread)", "p_last_saved",
     "p_last_announced"),
    ("(read: announced -> sent, the producer's outbox thread)", "p_last_announced",
     "p_last_told"),
    ("(read: sent -> the decode has it)", "p_last_told", "d_last_recv"),
    ("(read: announced -> the decode has it; the engine sends it, no outbox thread)",
     "p_last_announced", "d_last_recv"),
    ("(read: the decode has it -> its READ issued)", "d_last_recv", "d_last_read"),
    ("(read: READ issued -> the layer's wait ends)", "d_last_read", "d_last_go"),
    ("(whole push: prefill's \"done\" sent -> decode has it)", "p_done_told", "d_done_recv"),
    ("(whole push: decode has \"done\" -> its worker counts the load over)", "d_done_recv",
     "d_recv_done"),
    ("(whole push: load over -> vLLM's scheduler learns it)", "d_recv_done", "d_sched_seen"),
    ("(whole push: scheduler learns it -> the request's first step scheduled)", "d_sched_seen",
     "d_sched_compute"),
    ("(whole push: first step scheduled -> decode API server's first token)",
     "d_sched_compute", "d_api_first"),
    ("(whole push: prefill answer at the proxy -> decode's 1st chunk there)", "p_answer",
     "d_chunk_in"),
)


def timelines(events, nlayers):
    """{proxy request id: {column: ms after the proxy received it}} for push
    requests, from a trace's events."""
    by_k = {}
    for e in events:
        by_k.setdefault(e["k"], []).append(e)
    out = {}
    for e in events:
        if e["ev"] != "proxy_dispatch":
            continue
        rid, tid = e["rid"], e["k"]
        evs = by_k.get(tid, [])
        pin = [x for x in by_k.get(rid, []) if x["ev"] == "proxy_in"]
        if not pin:
            continue
        t0 = pin[0]["t"]
        # Which process is which side: the decode's worker waits for layers,
        # the prefill's saves them (the scheduler may run in another process).
        dpids = {x["pid"] for x in evs if x["ev"] in ("layer_wait", "sched_match",
                                                       "target_queued", "c_recv")}
        ppids = {x["pid"] for x in evs if x["ev"] in ("layer_saved", "sched_publish",
                                                       "p_recv", "write_issued")}
        row = {}
        for col, side, ev, flt in POINTS:
            if ev is None:
                continue  # from vLLM's own numbers, below
            pool = by_k.get(rid, []) if ev.startswith("proxy_chunk") else evs
            cand = []
            for x in pool:
                if x["ev"] != ev:
                    continue
                if side == "d" and x["pid"] not in dpids and ev in ("fwd_start", "fwd_end", "step_bound"):
                    continue
                if side == "p" and x["pid"] not in ppids and ev in ("fwd_start", "fwd_end", "step_bound"):
                    continue
                if side == "d" and ev == "notify_sent" and x["pid"] not in dpids:
                    continue
                if side == "p" and ev == "notify_sent" and x["pid"] not in ppids:
                    continue
                if flt in ("target", "done") and x.get("what") != flt:
                    continue
                if flt == "last":
                    ls = x.get("l") or ([x["li"]] if "li" in x else [])
                    if nlayers - 1 not in ls:
                        continue
                elif isinstance(flt, int) and x.get("li") != flt:
                    continue
                cand.append(x["t"])
            row[col] = (min(cand) - t0) * 1e3 if cand else None
        # The prefill's forward thread inside save_kv_layer (the producer's
        # per-layer work, its lock and the GIL), summed over the layers: a
        # duration, not a point.
        ins = sorted(x["t"] for x in evs if x["ev"] == "save_in" and x["pid"] in ppids)
        outs = sorted(x["t"] for x in evs if x["ev"] == "save_out" and x["pid"] in ppids)
        row["p_save_total"] = (sum(o - i for i, o in zip(ins, outs)) * 1e3
                               if ins and len(ins) == len(outs) else None)
        # vLLM's arrival time (wall clock, set by the API server) on this axis
        for col, ev in (("d_arrival", "sched_match"), ("p_arrival", "sched_publish")):
            x = next((x for x in evs if x["ev"] == ev and x.get("arrival_w")), None)
            row[col] = None if x is None else (x["arrival_w"] + x["t"] - x["w"] - t0) * 1e3
        out[rid] = row
    return out


def scrape(url, names=("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                       "vllm:time_to_first_token_seconds")):
    """Sums of vLLM's per-request histograms (a difference around one
    request is that request's value)."""
    from mooncake_connector.serving import http_get
    try:
        status, text = http_get(url + "/metrics", timeout=10)
    except Exception:  # noqa: BLE001 - a server without metrics: no column
        return {}
    out = {}
    for n in names:
        m = re.search(r"^" + re.escape(n) + r"_sum\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
        if m:
            out[n] = float(m.group(1))
    return out


def _group_pids(pgid):
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(st[2]) == pgid:
            pids.append(int(d))
    return pids


def _group_tids(pids):
    """(pid, tid) of every thread of these processes (a process that ended
    meanwhile: none); tid as /proc names it, a string."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            yield pid, tid


def cpu_ns(pgids):
    """{server: {"pid:tid:name": CPU ns so far, "rq:pid:tid:name": ns it
    waited on a run queue so far}} over every thread of every process of
    each server's process group (/proc/*/task/*/schedstat: ns, unlike
    stat's 10 ms ticks)."""
    out = {}
    for name, pgid in pgids.items():
        acc = out.setdefault(name, {})
        for pid, tid in _group_tids(_group_pids(pgid)):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip()
            except (OSError, ValueError, IndexError):
                continue
            key = f"{pid}:{tid}:{comm}"
            acc[key] = acc.get(key, 0) + run_ns
            # the time it was runnable but waited for a CPU (run queue)
            acc["rq:" + key] = acc.get("rq:" + key, 0) + wait_ns
    return out


def cpu_diff(a, b):
    """{server: {thread: ms}} spent between two cpu_ns() readings (threads
    that ran, only)."""
    out = {}
    for srv, th in b.items():
        d = {k: (v - a.get(srv, {}).get(k, 0)) / 1e6 for k, v in th.items()}
        out[srv] = {k: v for k, v in d.items() if v > 0.05}
    return out


def pin(proc, cpu):
    """Every thread of every process of this server's process group on cpu."""
    pids = _group_pids(proc.proc.pid)
    for pid in pids:
        subprocess.run(["taskset", "-a", "-cp", str(cpu), str(pid)], check=True,
                       capture_output=True)
    return pids


def renice(proc, value):
    """Every thread of every process of this server's process group at nice
    `value` (threads started later inherit their creator's); value "idle":
    Linux's SCHED_IDLE policy instead (the threads run only on a CPU nothing
    else wants, and the scheduler counts a CPU running only such threads as
    idle when it places a waking thread)."""
    pids = _group_pids(proc.proc.pid)
    for _pid, tid in _group_tids(pids):
        try:
            if value == "idle":
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, int(tid), value)
        except OSError:
            pass  # a thread that ended meanwhile
    return pids


def make_sets(workdir, model, extra, common, tree_b=None, label_b="tb", noasync=False,
              env_c=None, decode_args=(), extra_c=None, flows=(), decode_extra=None):
    """{set name: Deployment} (not started): "a", this tree's (colocated, its
    pass-through proxy, the push proxies of `extra`); with tree_b, a second
    prefill + decode + push layer-load proxy whose processes import the
    connector from tree_b first (label_b); with noasync, this tree's again
    with --no-async-scheduling on its decode and its own colocated ("na");
    with env_c ({name: value}), this tree's prefill + decode + push
    layer-load proxy again with those environment variables ("c": an A/B of
    engine knobs, MC_*, in one lease); flows: set "a"'s plain flow proxies
    (deployment.Deployment's, named by flow); decode_extra: keys merged into
    every set's decode kv_connector_extra_config (set c's extra_c over them)."""
    from mooncake_connector.deployment import Deployment
    # decode_args: every set's decode server (not "na", which has its own).
    dside = {"side_args": {"decode": list(decode_args)}} if decode_args else {}
    if decode_extra:
        dside["decode_extra_config"] = dict(decode_extra)
    deps = {"a": Deployment(workdir, model, flows=tuple(flows), extra_proxies=extra,
                            colocated_proxy=True, **common, **dside)}
    if tree_b:
        # Every process of this set (metadata server, servers, proxy) copies
        # os.environ when it is made: the other tree first on its path, this
        # one off it.
        saved = os.environ.get("PYTHONPATH")
        here = os.path.abspath(os.path.join(HERE, ".."))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(tree_b)] + [x for x in (saved or "").split(os.pathsep)
                                         if x and os.path.abspath(x) != here])
        try:
            # --whole: its whole-prompt push too (push_whole_<label_b>)
            deps[label_b] = Deployment(os.path.join(workdir, "tree-" + label_b), model,
                                       flows=(), colocated=False,
                                       extra_proxies={k: extra[k] for k in ("push-ll",
                                                                            "push-whole")
                                                      if k in extra}, **common, **dside)
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
    if env_c or extra_c:
        # extra_c: keys merged into this set's decode kv_connector_extra_config
        deps["c"] = Deployment(os.path.join(workdir, "env-c"), model, flows=(),
                               colocated=False, extra_proxies={"push-ll": extra["push-ll"]},
                               **dict(common, env={**(common.get("env") or {}), **(env_c or {})}),
                               **dict(dside, decode_extra_config={**(decode_extra or {}),
                                                                  **(extra_c or {})} or None))
    if noasync:
        na = ["--no-async-scheduling"]
        deps["na"] = Deployment(os.path.join(workdir, "noasync"), model, flows=(),
                                extra_proxies={"push-ll": extra["push-ll"]},
                                side_args={"decode": na, "colocated": na},
                                decode_extra_config=dict(decode_extra or {}) or None, **common)
    return deps


def _parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="128,1024,1900")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--pin", default="",
                    help="server=cpu,... e.g. prefill=0,decode=1,colocated=0 (taskset)")
    ap.add_argument("--nice", default="",
                    help="server=N,... e.g. prefill=5: every thread of that server's processes "
                         "at nice N once up (who wins the CPUs of a small host: the decode's "
                         "steps or the prefill's tail); N idle: SCHED_IDLE instead; servers "
                         "prefill_c, decode_c: the --env-c set's (an A/B in one run)")
    ap.add_argument("--no-ab", action="store_true",
                    help="measure push layer load with the prefill server's settings only "
                         "(default: also with --push-layer-watch off, as mode push_ll_b, "
                         "interleaved: the A/B of the landing thread)")
    ap.add_argument("--whole", action="store_true",
                    help="also push the whole prompt (push_whole: --push-layer-load off, the "
                         "decode computes nothing until the prefill is done): the prefill's "
                         "forward without the decode's concurrent per-layer work")
    ap.add_argument("--out", default="build/ttft_timeline.json")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the vLLM servers run (cuda: all three on GPU 0, as "
                         "serving_bench.py --device cuda; docs/vllm-gpu.md)")
    ap.add_argument("--gpu-path", choices=["on", "off"], default="on",
                    help="--device cuda: the same-host GPU path (CUDA IPC) or off "
                         "(MC_GPU_IPC=0: TCP with GPU staging)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="--device cuda: the servers run vLLM's CUDA graphs as production does "
                         "(--no-enforce-eager; docs/connector.md \"CUDA graphs\")")
    ap.add_argument("--tree-b", metavar="PATH",
                    help="A/B: a second prefill + decode + push layer-load proxy importing the "
                         "connector from this tree (its mode: push_ll_<--label-b>)")
    ap.add_argument("--label-b", default="tb", help="--tree-b's mode suffix (letters, digits)")
    ap.add_argument("--decode-async-scheduling", action="store_true",
                    help="--device cuda: this tree's decode keeps vLLM's asynchronous scheduling "
                         "(its GPU default; the connector then takes every push as the "
                         "whole-prompt push: with --whole, where the GPU default's time goes). "
                         "Default on CUDA: --no-async-scheduling, so layer loads run")
    ap.add_argument("--noasync", action="store_true",
                    help="also a set from this tree with --no-async-scheduling on its decode "
                         "and its own colocated server (modes push_ll_na, colocated_na)")
    ap.add_argument("--prefill-plain", action="store_true",
                    help="also send each prompt straight to the push prefill server as a plain "
                         "request (max_tokens 1, kv_transfer_params do_remote_decode false: "
                         "the connector does nothing for it), mode prefill_plain: the same "
                         "server's forward with and without the push's per-layer work "
                         "(vLLM's scheduled -> first token and the server's CPU, paired)")
    ap.add_argument("--flow-a", action="store_true",
                    help="also flow a's proxy (first token from the prefill; its decode "
                         "pulls), mode flow_a, with the prefill server's own histograms: "
                         "with --prefill-plain, where flow a's first token spends its time "
                         "over colocated (the connector's presence: prefill_plain - "
                         "colocated; publishing: flow_a - prefill_plain inside the server; "
                         "the HTTP path: client TTFT - server TTFT, against colocated's)")
    ap.add_argument("--env-c", action="append", default=[], metavar="NAME=VALUE",
                    help="a third set from this tree (prefill + decode + push layer-load "
                         "proxy, mode push_ll_c) whose servers get this environment variable "
                         "(repeatable): an engine knob's A/B in one lease")
    ap.add_argument("--extra-c", action="append", default=[], metavar="KEY=VALUE",
                    help="a third set from this tree as --env-c makes (mode push_ll_c), its "
                         "decode's kv_connector_extra_config with KEY set to VALUE (JSON: true, "
                         "5, \"x\"; a bare word is a string; repeatable): a connector knob's "
                         "A/B in one lease, e.g. early_recv=true with --decode-async-scheduling")
    ap.add_argument("--decode-extra", action="append", default=[], metavar="KEY=VALUE",
                    help="every set's decode kv_connector_extra_config with KEY set to VALUE "
                         "(as --extra-c reads it; repeatable; --extra-c over it in set c): "
                         "e.g. push_layer_load_async=true, so that an --env-c A/B differs "
                         "in the environment variable only")
    ap.add_argument("--no-trace", action="store_true",
                    help="MC_TRACE unset: TTFT, gap and bars only, no timeline")
    ap.add_argument("--one-layer-ms", type=float, default=0.0,
                    help="one layer's transfer in the TTFT bar (0: stricter; the same-host "
                         "GPU path moved a layer in 0.00-0.01 ms in run 17)")
    ap.add_argument("--pool", nargs="+", metavar="JSON",
                    help="no run: the tables and bars over the requests of several earlier "
                         "runs' --out together (into --out; the prompts of each run paired "
                         "among themselves)")
    ap.add_argument("--reread", metavar="JSON",
                    help="no run: the tables again from an earlier run's --out (its trace)")
    return ap


def _reread(path):
    """--reread: the tables again from an earlier run's JSON and its trace."""
    from mooncake_connector import trace
    with open(path) as f:
        old = json.load(f)
    rows = {int(k): v for k, v in old["rows"].items()}
    modes = list(dict.fromkeys(r["mode"] for v in rows.values() for r in v))
    tl = timelines(trace.read(old["summary"]["trace"]), KV32K_SPEC["layers"])
    old["summary"]["rows"] = report(rows, tl, modes,
                                    one_layer_ms=old["summary"].get("one_layer_ms", 0.0))
    old["timelines"] = tl
    with open(path, "w") as f:
        json.dump(old, f, indent=1)


def _pool(paths, out, one_layer_ms):
    """--pool: several runs' rows as one run's tables."""
    rows = {}
    for j, path in enumerate(paths):
        with open(path) as f:
            for n, recs in json.load(f)["rows"].items():
                for r in recs:
                    # rid "tl-<mode>-<n>-<i>-<pid>": i made unique per run
                    head, i, pid = r["rid"].rsplit("-", 2)
                    rows.setdefault(int(n), []).append(dict(r, rid=f"{head}-{j}x{i}-{pid}"))
    modes = list(dict.fromkeys(r["mode"] for v in rows.values() for r in v))
    summary = {"rows": report(rows, {}, modes, one_layer_ms=one_layer_ms),
               "pooled_from": paths, "one_layer_ms": one_layer_ms}
    with open(out, "w") as f:
        json.dump({"summary": summary}, f, indent=1)


def _server_map(ap, flag, text, pattern, what):
    """--pin / --nice: "server=value,..." for prefill, decode, colocated, and
    prefill_c, decode_c (the --env-c / --extra-c set's); a value that is not
    a number (--nice's "idle") stays a string."""
    out = {}
    for kv in filter(None, text.split(",")):
        k, _, v = kv.partition("=")
        if (k not in ("prefill", "decode", "colocated", "prefill_c", "decode_c")
                or not re.fullmatch(pattern, v)):
            ap.error(f"{flag} {kv!r}: expected prefill|decode|colocated|prefill_c|decode_c={what}")
        out[k] = int(v) if re.fullmatch(r"-?\d+", v) else v
    return out


def _server_of(deps, name):
    """--pin / --nice's server name -> its server (prefill_c: set c's prefill)."""
    if name.endswith("_c"):
        return getattr(deps["c"], name[:-2])
    return getattr(deps["a"], name)


def _check_ab(ap, args):
    """The A/B flags (--tree-b, --label-b, --env-c): the --env-c dict."""
    if args.tree_b and not re.fullmatch(r"[A-Za-z0-9]+", args.label_b):
        ap.error(f"--label-b {args.label_b!r}: letters and digits only")
    env_c = {}
    for kv in args.env_c:
        k, eq, v = kv.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            ap.error(f"--env-c {kv!r}: expected NAME=VALUE")
        env_c[k] = v
    if args.tree_b and args.label_b in ("b", "whole", "na", "c"):
        ap.error(f"--label-b {args.label_b!r}: taken by another mode (push_ll_b, push_whole, "
                 "push_ll_na, push_ll_c); pick another")
    if args.tree_b and not os.path.isdir(os.path.join(args.tree_b, "mooncake_connector")):
        ap.error(f"--tree-b {args.tree_b!r}: no mooncake_connector/ there (a source tree with "
                 "_core built in place)")
    extra_c = parse_extra_config(ap, args.extra_c)
    args.extra_c_dict = extra_c
    args.decode_extra_dict = parse_extra_config(ap, args.decode_extra, "--decode-extra")
    return env_c


def _args(argv):
    """The command line parsed and checked: (args, lengths, pins, nices, env_c)."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.reread or args.pool:
        return args, None, None, None, None
    if args.cuda_graphs and args.device != "cuda":
        ap.error("--cuda-graphs needs --device cuda")
    if args.device == "cpu" and args.gpu_path != "on":
        ap.error("--gpu-path needs --device cuda")
    if args.decode_async_scheduling and args.device != "cuda":
        ap.error("--decode-async-scheduling needs --device cuda (vLLM's CPU backend turns "
                 "asynchronous scheduling off)")
    lengths = [int(x) for x in args.lengths.split(",")]
    pins = _server_map(ap, "--pin", args.pin, r"\d+", "CPU")
    nices = _server_map(ap, "--nice", args.nice, r"-?\d+|idle", "N|idle")

    env_c = _check_ab(ap, args)
    if any(k.endswith("_c") for k in (*pins, *nices)) and not (env_c or args.extra_c_dict):
        ap.error("--pin / --nice prefill_c, decode_c: set c's servers need --env-c or --extra-c")
    return args, lengths, pins, nices, env_c


def _sets(args, env_c):
    """The sets of servers (not started; every process started later gets
    MC_TRACE unless --no-trace): (deps, the trace's path, meta)."""
    workdir = args.workdir or tempfile.mkdtemp(prefix="mc-ttft-")
    tpath = os.path.join(workdir, "trace.jsonl")
    if args.no_trace:
        os.environ.pop("MC_TRACE", None)
    else:
        os.environ["MC_TRACE"] = tpath  # every process started below inherits it
    from mooncake_connector import tiny_model
    from mooncake_connector.vllm_gpu import bench_settings

    # The servers' device, as serving_bench.py sets it; on one GPU each of
    # the vLLM servers of every set gets its share of the memory.
    extra_c = args.extra_c_dict
    nservers = (3 + (2 if args.tree_b else 0) + (3 if args.noasync else 0)
                + (2 if env_c or extra_c else 0))
    dev_env, dev_args = bench_settings(args.device, args.gpu_path, servers=nservers,
                                      cuda_graphs=args.cuda_graphs)
    model = tiny_model.build(**KV32K_SPEC)
    ll = ("--push-layerwise", "on", "--push-layer-load", "on")
    extra = {"push-ll": {"flow": "push", "extra_args": ll}}
    if not args.no_ab:
        extra["push-ll-b"] = {"flow": "push", "extra_args": ll + ("--push-layer-watch", "off")}
    if args.whole:
        extra["push-whole"] = {"flow": "push", "extra_args": ("--push-layerwise", "on",
                                                               "--push-layer-load", "off")}
    common = dict(kv_cache_bytes=256 << 20, env=dev_env, extra_vllm_args=dev_args)
    # A CUDA decode takes layer loads only without vLLM's asynchronous
    # scheduling (docs/connector.md, "Asynchronous scheduling").
    no_async = args.device == "cuda" and not args.decode_async_scheduling
    deps = make_sets(workdir, model, extra, common, tree_b=args.tree_b, label_b=args.label_b,
                     noasync=args.noasync, env_c=env_c, extra_c=extra_c,
                     decode_args=["--no-async-scheduling"] if no_async else (),
                     flows=("a",) if args.flow_a else (),
                     decode_extra=args.decode_extra_dict)
    meta = {"sets": {name: {"pythonpath": d.prefill.env.get("PYTHONPATH"),
                            "no_async_scheduling": "--no-async-scheduling" in d.decode.cmd}
                     for name, d in deps.items()}}
    if env_c:
        meta["sets"]["c"]["env"] = env_c
    for name in deps:  # every set's decode: --decode-extra, then set c's --extra-c
        merged = {**args.decode_extra_dict, **(extra_c if name == "c" else {})}
        if merged:
            meta["sets"][name]["decode_extra_config"] = merged
    return deps, tpath, meta


def _start(deps, pins, nices, meta):
    """Every set's servers up (the metadata servers first: the connectors
    register on start; then the rest in parallel), pinned and niced as asked."""
    from mooncake_connector import serving
    for d in deps.values():
        if d.metadata is not None:
            serving.start_all([d.metadata], 30.0)
    t_up = time.monotonic()
    serving.start_all([p for d in deps.values() for p in d.processes
                       if p is not d.metadata], 600)
    meta["servers_up_s"] = time.monotonic() - t_up
    print(f"{sum(1 for d in deps.values() for p in d.processes)} processes up in "
          f"{meta['servers_up_s']:.0f} s", flush=True)
    for name, cpu in pins.items():
        meta.setdefault("pinned", {})[name] = (cpu, pin(_server_of(deps, name), cpu))
    for name, val in nices.items():
        meta.setdefault("niced", {})[name] = (val, renice(_server_of(deps, name), val))


def _stop(deps):
    """Every set's servers in parallel (SIGTERM to all first), the metadata
    servers last (the connectors unregister on shutdown)."""
    from mooncake_connector import serving
    serving.stop_all([p for d in deps.values() for p in d.processes
                      if p is not d.metadata])
    serving.stop_all([d.metadata for d in deps.values() if d.metadata is not None])


def _modes(args, deps):
    """(urls, srv_of, pre_of): mode -> where its requests go; -> the vLLM
    server whose histograms it reads; push mode -> its prefill server
    (histograms: the prefill's own times)."""
    dep = deps["a"]
    urls = {"colocated": dep.colocated.url, "colocated_proxy": dep.colocated_proxy.url,
            "push_ll": dep.proxies["push-ll"].url}
    srv_of = {"colocated": dep.colocated.url, "colocated_proxy": dep.colocated.url,
              "push_ll": dep.decode.url}
    pre_of = {"push_ll": dep.prefill.url}
    if "push-ll-b" in dep.proxies:
        urls["push_ll_b"] = dep.proxies["push-ll-b"].url
        srv_of["push_ll_b"] = dep.decode.url
    if "push-whole" in dep.proxies:
        urls["push_whole"] = dep.proxies["push-whole"].url
        srv_of["push_whole"] = dep.decode.url
    if args.prefill_plain:
        urls["prefill_plain"] = srv_of["prefill_plain"] = dep.prefill.url
    if args.flow_a:
        # its first token is the prefill's: the prefill server's histograms
        urls["flow_a"] = dep.proxies["a"].url
        srv_of["flow_a"] = dep.prefill.url
    for name, d in deps.items():
        if name == "a":
            continue
        urls[f"push_ll_{name}"] = d.proxies["push-ll"].url
        srv_of[f"push_ll_{name}"] = d.decode.url
        pre_of[f"push_ll_{name}"] = d.prefill.url
        if "push-whole" in d.proxies:
            urls[f"push_whole_{name}"] = d.proxies["push-whole"].url
            srv_of[f"push_whole_{name}"] = d.decode.url
        if d.colocated is not None:
            urls[f"colocated_{name}"] = srv_of[f"colocated_{name}"] = d.colocated.url
    return urls, srv_of, pre_of


def _pgids(deps):
    """{name: process group} of the servers and proxies whose threads' CPU
    time is read around each request."""
    dep = deps["a"]
    pgids = {"prefill": dep.prefill.proc.pid, "decode": dep.decode.proc.pid,
             "colocated": dep.colocated.proc.pid,
             "proxy_push_ll": dep.proxies["push-ll"].proc.pid,
             "proxy_colocated": dep.colocated_proxy.proc.pid}
    if "a" in dep.proxies:
        pgids["proxy_flow_a"] = dep.proxies["a"].proc.pid
    if "push-whole" in dep.proxies:
        pgids["proxy_push_whole"] = dep.proxies["push-whole"].proc.pid
    for name, d in deps.items():
        if name != "a":
            pgids.update({f"prefill_{name}": d.prefill.proc.pid,
                          f"decode_{name}": d.decode.proc.pid,
                          f"proxy_push_ll_{name}": d.proxies["push-ll"].proc.pid})
            if "push-whole" in d.proxies:
                pgids[f"proxy_push_whole_{name}"] = d.proxies["push-whole"].proc.pid
            if d.colocated is not None:
                pgids[f"colocated_{name}"] = d.colocated.proc.pid
    return pgids


def _measure(args, lengths, urls, srv_of, pre_of, pgids, meta):
    """The warm-up (3 requests per mode), then each prompt through every mode,
    one request at a time in a fresh random order: {length: [row, ...]}."""
    from mooncake_connector.openai_client import request
    body = {"model": "tiny", "temperature": 0.0, "max_tokens": args.max_tokens,
            "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}
    # prefill_plain: what the proxy sends the prefill, without the push
    plain = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": False})
    for k, u in urls.items():  # warm-up
        for i in range(3):
            request(u, "/v1/completions", dict(plain if k == "prefill_plain" else body,
                                               prompt=prompt_of(max(lengths), 77 + i)),
                    timeout=600)
    meta["load_before"] = os.getloadavg()
    rows = {}
    order = random.Random(31)
    t_meas = time.monotonic()
    for n in lengths:
        for i in range(args.requests):
            p = prompt_of(n, 5000 * n + i)
            keys = list(urls)
            order.shuffle(keys)
            ref = None
            for k in keys:
                time.sleep(SETTLE_S)
                rid = f"tl-{k}-{n}-{i}-{os.getpid()}"
                srv = srv_of[k]
                before = scrape(srv)
                before_p = scrape(pre_of[k]) if k in pre_of else {}
                c0 = cpu_ns(pgids)
                t_send = time.monotonic()
                r = request(urls[k], "/v1/completions",
                            dict(plain if k == "prefill_plain" else body, prompt=p),
                            timeout=600, headers={"X-Request-Id": rid})
                if r.status != 200 or r.error:
                    raise RuntimeError(f"{k}: {r.status} {r.error}")
                c1 = cpu_ns(pgids)
                after = scrape(srv)
                after_p = scrape(pre_of[k]) if k in pre_of else {}
                rec = {"cpu_ms": cpu_diff(c0, c1), "mode": k, "n": n, "rid": rid, "t_send": t_send,
                       "ttft_ms": r.ttft_s * 1e3, "tokens": r.token_ids,
                       "itl_ms": [x * 1e3 for x in r.itl_s],
                       "cached_tokens": r.cached_tokens,
                       "prompt_tokens": (r.usage or {}).get("prompt_tokens")}
                for m, v in after.items():
                    rec[m.split(":")[1]] = (v - before.get(m, 0.0)) * 1e3
                for m, v in after_p.items():  # the prefill server's, push modes
                    rec["prefill_" + m.split(":")[1]] = (v - before_p.get(m, 0.0)) * 1e3
                rows.setdefault(n, []).append(rec)
                if k == "colocated":
                    ref = r.token_ids
            for rec in rows[n][-len(keys):]:
                # prefill_plain has 1 token: colocated's first
                rec["identical"] = rec["tokens"] == ref[:len(rec["tokens"])] and \
                    bool(rec["tokens"])
        done = rows[n][-len(urls) * args.requests:]
        print(f"  {n} words done ({time.monotonic() - t_meas:.0f} s): TTFT p50 " + ", ".join(
            f"{k} {_pct([x['ttft_ms'] for x in done if x['mode'] == k], 50):.1f}"
            for k in urls) + " ms", flush=True)
    meta["load_after"] = os.getloadavg()
    return rows


def _write(args, rows, urls, meta, tpath):
    """The report (the trace read back: the tables) and the --out JSON."""
    from mooncake_connector import trace
    events = [] if args.no_trace else trace.read(tpath)
    tl = timelines(events, KV32K_SPEC["layers"])
    summary = {"rows": report(rows, tl, list(urls), one_layer_ms=args.one_layer_ms),
               "one_layer_ms": args.one_layer_ms, "traced": not args.no_trace}
    summary.update(meta)
    summary.update({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "command": " ".join(sys.argv), "cpus": os.cpu_count(),
                    "device": args.device,
                    "gpu_path": args.gpu_path if args.device == "cuda" else None,
                    "env": {k: v for k, v in os.environ.items() if k.startswith("MC_")},
                    "trace": None if args.no_trace else tpath})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rows": {str(k): v for k, v in rows.items()},
                   "timelines": tl}, f, indent=1)
    print(f"load average before/after: {meta.get('load_before')} / {meta.get('load_after')}")
    print(f"wrote {args.out}" + ("" if args.no_trace else f" (trace {tpath})"))


def main(argv=None):
    args, lengths, pins, nices, env_c = _args(argv)
    if args.reread:
        _reread(args.reread)
        return 0
    if args.pool:
        _pool(args.pool, args.out, args.one_layer_ms)
        return 0
    deps, tpath, meta = _sets(args, env_c)
    try:
        _start(deps, pins, nices, meta)
        urls, srv_of, pre_of = _modes(args, deps)
        rows = _measure(args, lengths, urls, srv_of, pre_of, _pgids(deps), meta)
    finally:
        _stop(deps)
    time.sleep(0.5)
    _write(args, rows, urls, meta, tpath)
    return 0


#: Per layer (the stretch over the model's layers), printed per push mode.
PER_LAYER = (("prefill forward per layer (step bound -> last layer saved)",
              "prefill forward to last layer saved"),
             ("prefill forward per layer (step bound -> forward end)",
              "(prefill forward: step bound -> forward end)"))


def ref_of(mode):
    """The colocated reference of a push mode: its own set's colocated server
    (push_ll_na: colocated_na, the same vLLM settings), else the first set's."""
    return "colocated_na" if mode == "push_ll_na" else "colocated"


def _fmt(v, spec="8.1f"):
    return "-" if v is None else format(v, spec)


def _prefill_cpu(rec):
    """(all threads, the busiest thread) of the push prefill server's CPU ms
    during one request (cpu_ms["prefill"], run-queue waits left out)."""
    th = [v for t, v in ((rec.get("cpu_ms") or {}).get("prefill") or {}).items()
          if not t.startswith("rq:")]
    return (sum(th), max(th)) if th else (None, None)


def _prefill_with_without(s, recs):
    """The push prefill server's forward with the push (push_ll: its
    prefill leg's vLLM scheduled -> first token, and the server's CPU during
    the request) and without it (prefill_plain: the same prompt, no push),
    p50 and paired per prompt (median difference), into s."""
    per = {}
    for r in recs:
        if r["mode"] == "push_ll":
            sched = r.get("prefill_request_prefill_time_seconds")
        elif r["mode"] == "prefill_plain":
            sched = r.get("request_prefill_time_seconds")
        else:
            continue
        tot, top = _prefill_cpu(r)
        per.setdefault(r["rid"].rsplit("-", 2)[1], {})[r["mode"]] = (sched, tot, top)
    for j, key in enumerate(("sched_first", "prefill_cpu", "prefill_cpu_top")):
        for m in ("push_ll", "prefill_plain"):
            s[f"{m}_{key}"] = _pct([v[m][j] for v in per.values() if m in v], 50)
        d = [v["push_ll"][j] - v["prefill_plain"][j] for v in per.values()
             if "push_ll" in v and "prefill_plain" in v and v["push_ll"][j] is not None
             and v["prefill_plain"][j] is not None]
        name = {"sched_first": "prefill", "prefill_cpu": "prefill_cpu",
                "prefill_cpu_top": "prefill_cpu_top"}[key]
        s[f"paired_{name}_push_minus_plain"] = statistics.median(d) if d else None


#: flow a's first token over colocated, taken apart (--flow-a): name ->
#: (mode, its minus the other's; each "mode:server" (vLLM's arrival -> first
#: token of the server that answered it) or "mode:client")
FLOW_A_SPLIT = (
    ("connector's presence (prefill_plain - colocated, server)",
     ("prefill_plain:server", "colocated:server")),
    ("publishing (flow_a - prefill_plain, server)", ("flow_a:server", "prefill_plain:server")),
    ("HTTP path: flow_a (client - server) - colocated_proxy (client - server)",
     ("flow_a:client-server", "colocated_proxy:client-server")),
    ("flow_a - colocated_proxy (client)", ("flow_a:client", "colocated_proxy:client")),
    ("flow_a - colocated (client)", ("flow_a:client", "colocated:client")),
)


def _flow_a_split(s, recs):
    """Paired medians (per prompt) of FLOW_A_SPLIT into s["flow_a_split"]."""
    per = {}
    for r in recs:
        srv = r.get("time_to_first_token_seconds")
        v = {"client": r["ttft_ms"], "server": srv,
             "client-server": None if srv is None else r["ttft_ms"] - srv}
        per.setdefault(r["rid"].rsplit("-", 2)[1], {})[r["mode"]] = v

    def val(d, key):
        mode, what = key.split(":")
        return (d.get(mode) or {}).get(what)
    out = {}
    for label, (a, b) in FLOW_A_SPLIT:
        d = [val(v, a) - val(v, b) for v in per.values()
             if val(v, a) is not None and val(v, b) is not None]
        out[label] = statistics.median(d) if d else None
    s["flow_a_split"] = out


def report(rows, tl, urls, one_layer_ms=0.0, nlayers=KV32K_SPEC["layers"]):
    out = {}
    pushes = [k for k in urls if k.startswith("push")]
    for n, recs in rows.items():
        s = {}
        for k in urls:
            xs = [r for r in recs if r["mode"] == k]
            s[f"ttft_{k}"] = _pct([r["ttft_ms"] for r in xs], 50)
            s[f"identical_{k}"] = f"{sum(r['identical'] for r in xs)}/{len(xs)}"
            itl = [v for r in xs for v in r.get("itl_ms") or ()]
            s[f"itl_{k}"], s[f"itl99_{k}"] = _pct(itl, 50), _pct(itl, 99)
            s[f"gap12_{k}"] = _pct([r["itl_ms"][0] for r in xs if r.get("itl_ms")], 50)
            s[f"loaded_{k}"] = _pct([r.get("cached_tokens") for r in xs], 50)
            for m in ("request_queue_time_seconds", "request_prefill_time_seconds",
                      "time_to_first_token_seconds"):
                for m2 in (m, "prefill_" + m):
                    if any(m2 in r for r in xs):
                        s[f"{k}_{m2}"] = _pct([r.get(m2) for r in xs], 50)
        s["prompt_tokens"] = next((r["prompt_tokens"] for r in recs if r.get("prompt_tokens")),
                                  None)
        for k in pushes:
            cols = {}
            for r in recs:
                if r["mode"] != k:
                    continue
                row = tl.get(r["rid"], {})
                row["client_ttft"] = r["ttft_ms"]
                srv = r.get("time_to_first_token_seconds")
                if srv is not None and row.get("d_arrival") is not None:
                    # the decode's API server has the first token (vLLM's TTFT)
                    row["d_api_first"] = row["d_arrival"] + srv
                for c, v in row.items():
                    cols.setdefault(c, []).append(v)
            if cols and any(c in cols for c in ("p_step_bound", "d_fwd_end")):
                s[f"timeline_{k}"] = {c: _pct(v, 50) for c, v in cols.items()}
                st = {}
                for label, a, b in STRETCHES:
                    if b not in cols or (a is not None and a not in cols):
                        st[label] = None
                        continue
                    xs = [(y - (0.0 if a is None else x)) for x, y in
                          zip(cols[a] if a is not None else [0.0] * len(cols[b]), cols[b])
                          if x is not None and y is not None]
                    st[label] = _pct(xs, 50)
                for label, of in PER_LAYER:
                    st[label] = None if st.get(of) is None else st[of] / nlayers
                s[f"stretches_{k}"] = st
        # Paired: each prompt went through every mode back to back (random
        # order): the median difference cancels what drifts between prompts.
        by_i = {}
        for r in recs:
            by_i.setdefault(r["rid"].rsplit("-", 2)[1], {})[r["mode"]] = r["ttft_ms"]
        for k in urls:
            ref = ref_of(k) if k in pushes else "colocated"
            if k != ref:
                d = [v[k] - v[ref] for v in by_i.values() if k in v and ref in v]
                s[f"paired_{k}"] = statistics.median(d) if d else None
        for k in pushes:
            if k != "push_ll":
                d = [v[k] - v["push_ll"] for v in by_i.values() if k in v and "push_ll" in v]
                s[f"paired_{k}_minus_push_ll"] = statistics.median(d) if d else None
        d = [v["push_ll"] - v["push_ll_b"] for v in by_i.values()
             if "push_ll" in v and "push_ll_b" in v]
        s["paired_ab"] = statistics.median(d) if d else None
        if "prefill_plain" in urls:
            _prefill_with_without(s, recs)
        if "flow_a" in urls:
            _flow_a_split(s, recs)
        # Issue 31's bars (serving_bench.py summarize's): TTFT p50 <= colocated
        # TTFT p50 + the proxy hop + 2 ms + one layer's transfer; gap 1->2
        # p50 <= colocated ITL p50 + 2 ms.
        hop = None
        if s.get("ttft_colocated") is not None and s.get("ttft_colocated_proxy") is not None:
            hop = max(0.0, s["ttft_colocated_proxy"] - s["ttft_colocated"])
        s["proxy_hop_ms"] = hop
        for k in pushes:
            ref = ref_of(k)
            if s.get(f"ttft_{ref}") is None or hop is None:
                continue
            bar = s[f"ttft_{ref}"] + hop + 2.0 + one_layer_ms
            s[f"bar_ttft_{k}"] = bar
            s[f"bar_ttft_{k}_over"] = s[f"ttft_{k}"] - bar
            s[f"bar_ttft_{k}_ok"] = s[f"ttft_{k}"] <= bar
            if s.get(f"itl_{ref}") is not None and s.get(f"gap12_{k}") is not None:
                gb = s[f"itl_{ref}"] + 2.0
                s[f"bar_gap12_{k}"] = gb
                s[f"bar_gap12_{k}_ok"] = s[f"gap12_{k}"] <= gb
        out[n] = s
        print(f"\n== {n} words ({s['prompt_tokens']} tokens): TTFT p50 " + ", ".join(
            f"{k} {s[f'ttft_{k}']:.1f}" for k in urls) + " ms; identical " + ", ".join(
            f"{k} {s[f'identical_{k}']}" for k in urls))
        print("  paired TTFT - its colocated TTFT, median: " + ", ".join(
            f"{k} {s[f'paired_{k}']:+.1f}" for k in urls if s.get(f"paired_{k}") is not None)
            + " ms" + ("" if s.get("paired_ab") is None else
                       f"; A/B paired push_ll - push_ll_b {s['paired_ab']:+.1f} ms")
            + "".join(f"; paired {k} - push_ll {s[f'paired_{k}_minus_push_ll']:+.1f} ms"
                      for k in pushes if s.get(f"paired_{k}_minus_push_ll") is not None))
        print("  gap 1->2 p50 / ITL p50, p99 (ms): " + ", ".join(
            f"{k} {_fmt(s[f'gap12_{k}'], '.1f')} / {_fmt(s[f'itl_{k}'], '.1f')}, "
            f"{_fmt(s[f'itl99_{k}'], '.1f')}" for k in urls))
        print("  prompt tokens loaded by the decode (p50): " + ", ".join(
            f"{k} {_fmt(s[f'loaded_{k}'], '.0f')}" for k in pushes))
        if hop is not None:
            print(f"  bars (issue 31; hop {hop:.2f} ms, one layer {one_layer_ms:.2f} ms):")
            for k in pushes:
                if f"bar_ttft_{k}" not in s:
                    continue
                g = ("" if f"bar_gap12_{k}" not in s else
                     f"; gap 1->2 {s[f'gap12_{k}']:.1f} <= {s[f'bar_gap12_{k}']:.1f} "
                     f"{'ok' if s[f'bar_gap12_{k}_ok'] else 'MISSED'}")
                print(f"    {k:<16} TTFT {s[f'ttft_{k}']:.1f} <= {s[f'bar_ttft_{k}']:.1f} "
                      f"({ref_of(k)} {s[f'ttft_{ref_of(k)}']:.1f}) "
                      f"{'ok' if s[f'bar_ttft_{k}_ok'] else 'MISSED'} "
                      f"by {abs(s[f'bar_ttft_{k}_over']):.1f} ms{g}")
        for k in urls:
            q = s.get(f"{k}_request_queue_time_seconds")
            pf = s.get(f"{k}_request_prefill_time_seconds")
            tt = s.get(f"{k}_time_to_first_token_seconds")
            if pf is not None:
                role = ("colocated" if k.startswith("colocated") else
                        "prefill" if k == "prefill_plain" else "decode")
                print(f"  {k} ({role} server): vLLM queue {_fmt(q, '.1f')}, scheduled->first token "
                      f"{pf:.1f}, server TTFT {_fmt(tt, '.1f')} ms (p50)")
            pf = s.get(f"{k}_prefill_request_prefill_time_seconds")
            if pf is not None:
                print(f"  {k} (prefill server): vLLM queue "
                      f"{_fmt(s.get(f'{k}_prefill_request_queue_time_seconds'), '.1f')}, "
                      f"scheduled->first token {pf:.1f}, server TTFT "
                      f"{_fmt(s.get(f'{k}_prefill_time_to_first_token_seconds'), '.1f')} ms (p50)")
        if s.get("prefill_plain_sched_first") is not None:
            print("  push prefill server, with the push (push_ll's prefill leg) / without "
                  "(prefill_plain), p50: scheduled->first token "
                  f"{_fmt(s['push_ll_sched_first'], '.1f')} / "
                  f"{_fmt(s['prefill_plain_sched_first'], '.1f')} ms (paired "
                  f"{_fmt(s['paired_prefill_push_minus_plain'], '+.2f')}); server CPU "
                  f"{_fmt(s['push_ll_prefill_cpu'], '.1f')} / "
                  f"{_fmt(s['prefill_plain_prefill_cpu'], '.1f')} ms (paired "
                  f"{_fmt(s['paired_prefill_cpu_push_minus_plain'], '+.2f')}), its busiest "
                  f"thread {_fmt(s['push_ll_prefill_cpu_top'], '.1f')} / "
                  f"{_fmt(s['prefill_plain_prefill_cpu_top'], '.1f')} ms (paired "
                  f"{_fmt(s['paired_prefill_cpu_top_push_minus_plain'], '+.2f')})")
        if s.get("flow_a_split"):
            print("  flow a's first token over colocated, paired medians (ms; server: vLLM's "
                  "arrival -> first token histogram): " + "; ".join(
                      f"{label} {_fmt(v, '+.2f')}" for label, v in s["flow_a_split"].items()))
        traced = [k for k in pushes if s.get(f"stretches_{k}")]
        if traced:
            print("  where the time to first token goes (per request, p50 ms): "
                  + " | ".join(traced))
            for label in [x[0] for x in STRETCHES] + [x[0] for x in PER_LAYER]:
                print(f"    {label:<58} " + " ".join(
                    _fmt(s[f"stretches_{k}"].get(label)) for k in traced))
            print("  points, ms after the proxy received it (p50): " + " | ".join(traced))
            for c, _, _, _ in POINTS + (("client_ttft", 0, 0, 0),):
                print(f"    {c:<16} " + " ".join(_fmt(s[f"timeline_{k}"].get(c))
                                                for k in traced))
    return out


if __name__ == "__main__":
    sys.exit(main())
