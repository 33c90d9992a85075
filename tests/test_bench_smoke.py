"""The benchmark tools run and verify their data (tiny sizes; numbers are
not checked here — benchmarks/JOURNAL.md records them)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_transfer_bench_smoke():
    pytest.importorskip("numpy")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "transfer_bench.py"), "--engine",
         "ours", "--mode", "all", "--ops", "write,read", "--block-sizes", "4K,1M",
         "--batch-sizes", "1,16", "--threads", "1,2", "--buffer-size", "8M",
         "--total-bytes", "8M", "--latency-iters", "200", "--latency-warmup", "20"],
        capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    points = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    measured = [p for p in points if p.get("kind") in ("bandwidth", "latency")]
    assert measured and all(p.get("ok") for p in measured), [p for p in measured if not p.get("ok")]
    assert {p.get("kind") for p in points} >= {"bandwidth", "latency"}


def test_transfer_bench_warmup_still_verifies():
    """--warmup moves the bytes once before the clock; the timed run's bytes
    are still checked (the destination is poisoned after the warm-up)."""
    pytest.importorskip("numpy")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "transfer_bench.py"), "--engine",
         "ours", "--mode", "bandwidth", "--ops", "write,read", "--block-sizes", "4K",
         "--batch-sizes", "16", "--threads", "1", "--buffer-size", "4M",
         "--total-bytes", "4M", "--warmup", "--scatter"],
        capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    points = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    bw = [p for p in points if p.get("kind") == "bandwidth"]
    assert len(bw) == 2 and all(p["ok"] and p["warmup"] and p["verified_spans"] for p in bw), bw


def test_c_bench_tool_smoke():
    tool = os.path.join(ROOT, "build", "bench", "mc_bench")
    if not os.path.exists(tool):
        pytest.skip("build/bench/mc_bench not built (run `make bench`)")
    t = subprocess.Popen([tool, "target", "--size", str(16 << 20)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        _, seg, _, addr = t.stdout.readline().split()
        r = subprocess.run([tool, "initiator", "--segment", seg, "--addr", addr, "--block",
                            "65536", "--total", str(16 << 20), "--lat-iters", "100", "--reps",
                            "1"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        assert lines[0]["GBps"] > 0 and lines[1]["p50_us"] > 0
    finally:
        t.stdin.close()
        t.wait(timeout=10)
    assert shutil.which("true")


def test_serving_bench_paired_statistics():
    """The serving benchmark's bars from synthetic timings: per-prompt paired
    differences (not differences of medians) decide the paired bars."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import serving_bench as sb
    finally:
        sys.path.pop(0)
    n = 5
    col = [0.020, 0.030, 0.040, 0.050, 0.060]
    row = {"prompt_words": 128, "prompt_tokens": 130, "identical": n, "loaded_tokens": [128] * n,
           "colocated": col, "colocated_proxy": [c + 0.001 for c in col],
           "disaggregated": [c + 0.0005 for c in col],
           "disaggregated_decode_first": [c + 0.010 for c in col],
           "prefill_leg": col, "decode_leg": col}
    for k, _ in sb.MODES:
        row[f"itl_{k}"], row[f"gap12_{k}"] = [0.004], [0.004]
    fixed = {"colocated": [0.010, 0.020, 0.030], "decode": [0.0103, 0.0202, 0.0304]}
    s = sb.summarize([row], fixed, {128: {"seconds": 0.001, "bytes": 1 << 20}})
    r = s["rows"][0]
    assert abs(r["ttft_paired_diff_vs_colocated_ms_p50"] - 0.5) < 1e-6
    assert r["ttft_paired_bar_vs_colocated_ok"]              # 0.5 <= 1.1 x 1 ms
    assert abs(r["ttft_paired_diff_vs_colocated_proxy_ms_p50"] + 0.5) < 1e-6
    assert abs(s["fixed_overhead_paired_ms_p50"] - 0.3) < 1e-6 and s["fixed_overhead_paired_ok"]
    assert r["ttft_ms_per_request"]["colocated"] == [20.0, 30.0, 40.0, 50.0, 60.0]


def test_serving_bench_push_vs_intree(tmp_path):
    """Push against vLLM's in-tree connector: each as a ratio to its own
    phase's colocated server; and the in-tree producer's stats lines."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import serving_bench as sb
    finally:
        sys.path.pop(0)
    n = 4
    row = {"prompt_words": 128, "prompt_tokens": 130, "identical": n, "loaded_tokens": [],
           "colocated": [0.100] * n, "push": [0.150] * n,            # 1.5x its colocated
           "colocated_phase2": [0.200] * n, "intree": [0.400] * n,   # 2.0x its colocated
           "intree_at_once": [0.280] * n}                           # 1.4x
    for k, _ in sb.MODES:
        row[f"itl_{k}"], row[f"gap12_{k}"] = [0.010] * n, [0.010] * n
    row["gap12_push"] = [0.030] * n                                 # 3x colocated ITL
    s = sb.summarize([row], None, {128: {"seconds": 0.001, "bytes": 1 << 20}})["rows"][0]
    v = s["push_vs_intree"]
    assert abs(v["ttft_ratio"] - 1.5) < 1e-9 and abs(v["ttft_ratio_intree"] - 2.0) < 1e-9
    assert v["ttft_ahead_or_equal"] and not v["gap12_ahead_or_equal"]
    assert not s["push_vs_intree_at_once"]["ttft_ahead_or_equal"]   # 1.5 > 1.05 x 1.4
    assert abs(s["ttft_intree_paired_diff_ms_p50"] - 200.0) < 1e-6  # against colocated_phase2
    log = tmp_path / "prefill.log"
    log.write_text(
        "x INFO [metrics.py:103] KV Transfer metrics: Num successful transfers=4, Avg xfer time "
        "(ms)=50.0, P90 xfer time (ms)=77.5, Avg MB per transfer=10.0, Throughput (MB/s)=983.1, "
        "Num failed transfers=1, Num failed recvs=0, Num KV expired reqs=0\n"
        "y KV Transfer metrics: Num successful transfers=1, Avg xfer time (ms)=100.0, Avg MB per "
        "transfer=20.0, Num failed transfers=0, Num failed recvs=0, Num KV expired reqs=2\n")
    assert sb.intree_xfer_stats(str(log)) == {"transfers": 5, "failed_or_expired": 3,
                                              "MB": 60.0, "avg_xfer_ms": 60.0}


def test_serving_bench_intree_phase_per_device(tmp_path):
    """The in-tree phase's servers: on CPU the benchmark-only workaround
    (tests/intree_cpu on PYTHONPATH, MC_INTREE_CPU_ACCEL_INDEX=1); on CUDA
    none of it, the GPU servers' environment kept; the Mooncake site checked
    per device, and a CUDA failure named with its likely cause."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import serving_bench as sb
    finally:
        sys.path.pop(0)
    from mooncake_connector.vllm_gpu import bench_settings

    site = str(tmp_path / "site")
    env, note = sb.intree_settings("cpu", {}, site, 4242, "/a" + os.pathsep + "/b")
    assert env["PYTHONPATH"].split(os.pathsep) == [site, sb.INTREE_CPU_SITE, "/a", "/b"]
    assert env["MC_INTREE_CPU_ACCEL_INDEX"] == "1" and note == sb.INTREE_CPU_NOTE
    assert env["MC_MOONCAKE_SHIM"] == "0" and env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "4242"
    gpu_env, _ = bench_settings("cuda")
    env, note = sb.intree_settings("cuda", gpu_env, site, 4243, "/tmp/vllm-site")
    assert env["PYTHONPATH"].split(os.pathsep) == [site, "/tmp/vllm-site"]
    assert "MC_INTREE_CPU_ACCEL_INDEX" not in env and note == sb.INTREE_CUDA_NOTE
    assert {k: env[k] for k in gpu_env} == gpu_env
    assert env["MOONCAKE_CONNECTOR_DISABLE_PLUGIN"] == "1"
    with pytest.raises(ValueError, match="'xpu'"):
        sb.intree_settings("xpu", {}, site, 1)

    assert "pip install --target" in sb.intree_site_problem("cpu", site)
    assert "vllm-gpu-intree.sh stage" in sb.intree_site_problem("cuda", None)
    os.makedirs(os.path.join(site, "mooncake"))
    open(os.path.join(site, "mooncake", "__init__.py"), "w").close()
    assert sb.intree_site_problem("cpu", site) is None
    assert "engine" in sb.intree_site_problem("cuda", site)
    open(os.path.join(site, "mooncake", "engine.cpython-312-x86_64-linux-gnu.so"), "w").close()
    assert sb.intree_site_problem("cuda", site) is None
    os.makedirs(os.path.join(site, "mooncake_transfer_engine_non_cuda-0.3.13.dist-info"))
    assert "non-cuda" in sb.intree_site_problem("cuda", site)

    died = "RuntimeError: Mooncake batch memory registration failed."
    assert "batch_register_memory" in sb.intree_failure_hint("cuda", died)
    assert sb.intree_failure_hint("cpu", died) == ""
    assert "libcudart.so.12" in sb.intree_failure_hint(
        "cuda", "ImportError: libcudart.so.12: cannot open shared object file")
    assert sb.intree_failure_hint("cuda", "ValueError: something else") == ""

    # The engine's own import error, which vLLM's connector does not show.
    env, _ = sb.intree_settings("cuda", {}, site, 1)
    why = sb.intree_engine_import_problem(env)
    assert "mooncake.engine does not import" in why and "ModuleNotFoundError" in why
    with open(os.path.join(site, "mooncake", "engine.py"), "w") as f:
        f.write("class TransferEngine:\n    pass\n")
    assert sb.intree_engine_import_problem(env) is None


def test_serving_bench_device_flags_and_transfer_size(capsys):
    """--gpu-path / bfloat16 are GPU-only flags (a clear error on CPU), and the
    measured transfer moves the KV of the dtype the servers run (bf16: half)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import serving_bench as sb
    finally:
        sys.path.pop(0)
    for bad, says in ((["--gpu-path", "off"], "need --device cuda"),
                      (["--dtype", "bfloat16"], "need --device cuda"),
                      (["--cuda-graphs"], "--cuda-graphs needs --device cuda"),
                      (["--decode-async-scheduling"],
                       "--decode-async-scheduling needs --device cuda"),
                      (["--spec", "layers=x"], "is not key=integer")):
        with pytest.raises(SystemExit) as e:
            sb.parse_args(bad)
        assert e.value.code == 2
        assert says in capsys.readouterr().err
    args, lengths, want, overrides = sb.parse_args(["--lengths", "64,128", "--modes", "push",
                                                    "--kv32k", "--spec", "layers=4"])
    assert lengths == [64, 128] and want == {"push", "colocated"}
    assert overrides["layers"] == 4 and args.kv_cache_mib == 256
    spec = {"layers": 2, "hidden": 128, "heads": 2, "kv_heads": 2}
    _, fp32 = sb.xfer_time(spec, 64, 1, sys.executable)
    _, bf16 = sb.xfer_time(spec, 64, 1, sys.executable, dtype_bytes=2)
    assert fp32 == 64 * 2 * 2 * 2 * 64 * 4 and bf16 == fp32 // 2


def test_ttft_timeline_gpu_path_needs_cuda(capsys):
    """ttft_timeline.py --gpu-path is a --device cuda flag: a clear error on
    CPU, before any server starts."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import ttft_timeline as tt
    finally:
        sys.path.pop(0)
    for bad, says in ((["--gpu-path", "off"], "--gpu-path needs --device cuda"),
                      (["--cuda-graphs"], "--cuda-graphs needs --device cuda"),
                      (["--pin", "prefill=x"],
                       "expected prefill|decode|colocated|prefill_c|decode_c=CPU"),
                      (["--nice", "proxy=3"],
                       "expected prefill|decode|colocated|prefill_c|decode_c=N|idle"),
                      (["--nice", "prefill=lazy"], "=N|idle"),
                      (["--nice", "prefill_c=idle"], "set c's servers need --env-c or --extra-c"),
                      (["--env-c", "1X=2"], "expected NAME=VALUE"),
                      (["--decode-extra", "Push=1"], "--decode-extra 'Push=1': expected KEY=VALUE")):
        with pytest.raises(SystemExit) as e:
            tt.main(bad)
        assert e.value.code == 2
        assert says in capsys.readouterr().err


def test_ttft_timeline_cpu_and_nice_of_a_process_group():
    """ttft_timeline.py's per-thread CPU reading (cpu_ns, cpu_diff) and
    renice reach every thread of every process of a server's process
    group: a child with a busy second thread, in a group of its own."""
    import time
    import types

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import ttft_timeline as tt
    finally:
        sys.path.pop(0)
    code = ("import threading, time, sys\n"
            "def spin():\n    t = time.time()\n    while time.time() - t < 30: pass\n"
            "threading.Thread(target=spin, name='spinner', daemon=True).start()\n"
            "print('up', flush=True); sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline() == "up\n"
        a = tt.cpu_ns({"srv": child.pid})
        threads = {k for k in a["srv"] if not k.startswith("rq:")}
        assert len(threads) >= 2 and all(k.startswith(f"{child.pid}:") for k in threads), a
        assert {"rq:" + k for k in threads} <= set(a["srv"])
        time.sleep(0.3)
        ran = {k: ms for k, ms in tt.cpu_diff(a, tt.cpu_ns({"srv": child.pid}))["srv"].items()
               if not k.startswith("rq:")}
        assert ran and max(ran, key=ran.get).split(":")[1] != str(child.pid), ran  # the spinner
        assert tt.renice(types.SimpleNamespace(proc=child), 5) == [child.pid]
        for key in threads:
            tid = int(key.split(":")[1])
            assert os.getpriority(os.PRIO_PROCESS, tid) == 5, key
        # "idle": SCHED_IDLE on every thread (--nice prefill=idle)
        tt.renice(types.SimpleNamespace(proc=child), "idle")
        for key in threads:
            assert os.sched_getscheduler(int(key.split(":")[1])) == os.SCHED_IDLE, key
    finally:
        child.kill()
        child.wait()


def test_ttft_timeline_reads_a_trace():
    """benchmarks/ttft_timeline.py from a trace of one push request (the
    event names the connector and proxy write, two processes, 2 layers):
    each point on the proxy's axis, the decode and the prefill told apart by
    the events only each writes, and the stretches per request."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import ttft_timeline as tt
    finally:
        sys.path.pop(0)
    rid, tid, P, D, X = "tl-push_ll-128-0-1", "push-tl-x", 11, 22, 33

    def ev(ms, pid, name, k, **kw):
        return {"t": 100.0 + ms / 1e3, "w": 5000.0 + ms / 1e3, "pid": pid, "ev": name,
                "k": k, **kw}
    events = [ev(0, X, "proxy_in", rid), ev(0.1, X, "proxy_dispatch", tid, rid=rid),
              ev(3, D, "sched_match", tid, arrival_w=5000.001), ev(4, D, "step_bound", tid),
              ev(4.1, D, "fwd_start", tid), ev(4.2, D, "target_queued", tid),
              ev(4.5, D, "layer_wait", tid, li=0), ev(5, D, "notify_sent", tid, what="target"),
              ev(3.5, P, "sched_publish", tid, arrival_w=5000.002),
              ev(4.0, P, "step_bound", tid), ev(5.5, P, "p_recv", tid, what="target"),
              ev(7.8, P, "save_in", tid), ev(8, P, "layer_saved", tid, li=0),
              ev(8.1, P, "save_out", tid), ev(8.2, P, "write_issued", tid, l=[0]),
              ev(8.5, P, "write_seen_landed", tid, l=[0]),
              ev(8.6, P, "notify_sent", tid, what="layer", l=[0]),
              ev(8.7, D, "c_recv", tid, what="layer", l=[0]), ev(8.8, D, "layer_go", tid, li=0),
              ev(9, D, "layer_wait", tid, li=1), ev(11.9, P, "save_in", tid),
              ev(12, P, "layer_saved", tid, li=1), ev(12.4, P, "save_out", tid),
              ev(12.5, P, "write_seen_landed", tid, l=[1]),
              ev(12.6, P, "notify_sent", tid, what="layer", l=[0, 1]),
              ev(12.8, D, "c_recv", tid, what="layer", l=[0, 1]),
              ev(12.9, D, "layer_go", tid, li=1), ev(14, D, "fwd_end", tid),
              ev(15, P, "fwd_end", tid), ev(17, X, "proxy_chunk_in", rid),
              ev(17.2, X, "proxy_chunk_out", rid), ev(20, X, "proxy_prefill_answer", tid)]
    tl = tt.timelines(sorted(events, key=lambda e: e["t"]), nlayers=2)[rid]
    assert abs(tl["d_fwd_end"] - 14) < 1e-6 and abs(tl["p_fwd_end"] - 15) < 1e-6
    assert abs(tl["p_step_bound"] - 4.0) < 1e-6 and abs(tl["d_fwd_start"] - 4.1) < 1e-6
    assert abs(tl["p_last_saved"] - 12) < 1e-6 and abs(tl["p_last_landed"] - 12.5) < 1e-6
    assert abs(tl["p_last_told"] - 12.6) < 1e-6 and abs(tl["d_last_recv"] - 12.8) < 1e-6
    assert abs(tl["d_target_sent"] - 5) < 1e-6 and abs(tl["d_arrival"] - 1) < 1e-6
    rows = {128: [{"mode": "push_ll", "n": 128, "rid": rid, "ttft_ms": 18.0, "identical": True,
                   "time_to_first_token_seconds": 15.0},
                  {"mode": "colocated", "n": 128, "rid": "tl-colocated-128-0-1",
                   "ttft_ms": 16.0, "identical": True}]}
    s = tt.report(rows, {rid: tl}, ["colocated", "push_ll"])[128]
    st = s["stretches_push_ll"]
    assert abs(st["last layer's write (saved -> landed)"] - 0.5) < 1e-6
    assert abs(st["decode API server -> proxy"] - 1.0) < 1e-6  # API first token at 1 + 15 ms
    # the prefill's forward thread in save_kv_layer: 0.3 + 0.5 ms over the two layers
    assert abs(st["(prefill's forward thread in save_kv_layer, all layers)"] - 0.8) < 1e-6
    assert abs(s["paired_push_ll"] - 2.0) < 1e-6


def test_ttft_timeline_reads_a_whole_prompt_push():
    """A whole-prompt push's decode side (the path a GPU decode on vLLM's
    asynchronous scheduling takes): the producer's "done", the decode's
    worker counting the load over, vLLM's scheduler learning it, the
    request's first step, each a point, and the stretches between them."""
    tt = _tt()
    rid, tid, P, D, X = "tl-push_whole-128-0-1", "push-tl-w", 11, 22, 33

    def ev(ms, pid, name, k, **kw):
        return {"t": 100.0 + ms / 1e3, "w": 5000.0 + ms / 1e3, "pid": pid, "ev": name,
                "k": k, **kw}
    events = [ev(0, X, "proxy_in", rid), ev(0.1, X, "proxy_dispatch", tid, rid=rid),
              ev(3, D, "sched_match", tid, arrival_w=5000.001),
              ev(3.2, D, "sched_alloc", tid, sync=False), ev(4, D, "step_bound", tid),
              ev(4.2, D, "target_queued", tid), ev(5, D, "notify_sent", tid, what="target"),
              ev(3.5, P, "sched_publish", tid), ev(4.0, P, "step_bound", tid),
              ev(5.5, P, "p_recv", tid, what="target"), ev(8, P, "layer_saved", tid, li=0),
              ev(12, P, "layer_saved", tid, li=1), ev(15, P, "fwd_end", tid),
              ev(15.5, P, "notify_sent", tid, what="done"),
              ev(16, D, "c_recv", tid, what="done"), ev(16.1, D, "recv_done", tid),
              ev(18, D, "sched_recv_seen", tid), ev(19.5, D, "sched_compute", tid),
              ev(20, X, "proxy_prefill_answer", tid), ev(30, X, "proxy_chunk_in", rid),
              ev(30.2, X, "proxy_chunk_out", rid)]
    tl = tt.timelines(sorted(events, key=lambda e: e["t"]), nlayers=2)[rid]
    want = {"p_done_told": 15.5, "d_done_recv": 16, "d_recv_done": 16.1,
            "d_sched_seen": 18, "d_sched_compute": 19.5, "p_answer": 20, "d_chunk_in": 30}
    for col, ms in want.items():
        assert abs(tl[col] - ms) < 1e-6, (col, tl[col])
    assert tl["d_last_recv"] is None  # no "layer" told: not a layer load
    rows = {128: [{"mode": "push_whole", "n": 128, "rid": rid, "ttft_ms": 32.0,
                   "identical": True, "time_to_first_token_seconds": 0.0285},
                  {"mode": "colocated", "n": 128, "rid": "tl-colocated-128-0-1",
                   "ttft_ms": 16.0, "identical": True}]}
    st = tt.report(rows, {rid: tl}, ["colocated", "push_whole"])[128]["stretches_push_whole"]
    assert abs(st["(whole push: load over -> vLLM's scheduler learns it)"] - 1.9) < 1e-6
    assert abs(st["(whole push: scheduler learns it -> the request's first step scheduled)"]
               - 1.5) < 1e-6
    assert abs(st["(whole push: prefill answer at the proxy -> decode's 1st chunk there)"]
               - 10.0) < 1e-6


def test_ttft_timeline_takes_flow_a_apart():
    """--flow-a's split of flow a's first token over colocated, paired per
    prompt: the connector's presence and publishing inside the servers
    (vLLM's arrival -> first token), the HTTP path outside them."""
    tt = _tt()

    def rec(mode, i, client, server):
        return {"mode": mode, "n": 128, "rid": f"tl-{mode}-128-{i}-1", "ttft_ms": client,
                "identical": True, "time_to_first_token_seconds": server}
    recs = []
    for i, k in enumerate((0.0, 10.0, 20.0)):  # per-prompt drift cancels
        recs += [rec("colocated", i, 10 + k, 8 + k), rec("colocated_proxy", i, 12 + k, 8 + k),
                 rec("prefill_plain", i, 11 + k, 9 + k), rec("flow_a", i, 16 + k, 9.5 + k)]
    s = tt.report({128: recs}, {}, ["colocated", "colocated_proxy", "prefill_plain",
                                    "flow_a"])[128]["flow_a_split"]
    want = {"connector's presence (prefill_plain - colocated, server)": 1.0,
            "publishing (flow_a - prefill_plain, server)": 0.5,
            "HTTP path: flow_a (client - server) - colocated_proxy (client - server)": 2.5,
            "flow_a - colocated_proxy (client)": 4.0, "flow_a - colocated (client)": 6.0}
    assert s == pytest.approx(want)


def test_ttft_timeline_decode_extra_reaches_every_set(tmp_path):
    """--decode-extra: every set's decode gets the keys (so an --env-c A/B
    differs in the environment only); set c's --extra-c goes over them; the
    prefills get none of them.  Servers are made, not started."""
    tt = _tt()
    from mooncake_connector import tiny_model
    model = tiny_model.build(**tt.KV32K_SPEC)
    extra = {"push-ll": {"flow": "push", "extra_args": ("--push-layerwise", "on")}}
    deps = tt.make_sets(str(tmp_path / "w"), model, extra, dict(kv_cache_bytes=64 << 20),
                        env_c={"MC_GIL_SWITCH_US": "500"}, noasync=True,
                        extra_c={"load_failure_policy": "recompute"},
                        decode_extra={"push_layer_load_async": True,
                                      "load_failure_policy": "fail"})
    assert set(deps) == {"a", "c", "na"}
    for name, want in (("a", "fail"), ("na", "fail"), ("c", "recompute")):
        dec = deps[name].kv_configs["decode"]["kv_connector_extra_config"]
        assert dec["push_layer_load_async"] is True, name
        assert dec["load_failure_policy"] == want, name
        pre = deps[name].kv_configs["prefill"].get("kv_connector_extra_config") or {}
        assert "push_layer_load_async" not in pre, name
    assert deps["c"].prefill.env.get("MC_GIL_SWITCH_US") == "500"
    assert deps["a"].prefill.env.get("MC_GIL_SWITCH_US") is None


def test_push_notice_latency_by_mode():
    """benchmarks/push_notice_latency.py splits a trace by the timeline's
    mode and prompt length (the proxy's dispatch names the request): an
    A/B's two sets are read apart, each latency from its own events."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import push_notice_latency as pn
    finally:
        sys.path.pop(0)
    P, D = 11, 22

    def req(k, rid, late_ms, gil_ms=None):
        t = 100.0
        # the decode's forward thread (tid 1): its wait ended, then the GIL
        woke = [] if gil_ms is None else [
            {"t": t + 0.0029 + late_ms / 1e3, "pid": D, "tid": 1, "ev": "woke", "k": k,
             "gil_ms": gil_ms},
            {"t": t + 0.00295 + late_ms / 1e3, "pid": P, "tid": 1, "ev": "fwd_mid", "k": k}]
        return [{"t": t, "pid": 9, "ev": "proxy_dispatch", "k": k, "rid": rid},
                {"t": t + 0.001, "pid": D, "ev": "target_queued", "k": k},
                {"t": t + 0.002, "pid": D, "ev": "notify_sent", "k": k, "what": "target"},
                {"t": t + 0.0025, "pid": P, "ev": "p_recv", "k": k, "what": "target"},
                {"t": t + 0.003, "pid": P, "ev": "layer_saved", "k": k, "li": 0},
                {"t": t + 0.0031, "pid": D, "tid": 1, "ev": "layer_wait", "k": k, "li": 0}] + woke + [
                {"t": t + 0.003 + late_ms / 1e3, "pid": D, "tid": 1, "ev": "c_recv", "k": k,
                 "what": "layer", "l": [0]},
                {"t": t + 0.010, "pid": P, "ev": "fwd_end", "k": k},
                {"t": t + 0.012, "pid": D, "ev": "fwd_end", "k": k}]
    events = (req("x1", "tl-push_ll-128-0-5", 5.0, gil_ms=4.0)
              + req("x2", "tl-push_ll_c-128-0-5", 0.5, gil_ms=0.2)
              + req("x3", "tl-push_ll_c-1900-0-5", 1.5) + req("x4", "other", 3.0))
    got = pn.measure(events)
    assert set(got) == {("push_ll", "128"), ("push_ll_c", "128"), ("push_ll_c", "1900"),
                        ("-", "-")}
    notice, target, lag, taken, gil = got[("push_ll", "128")]
    assert gil == [4.0] and got[("push_ll_c", "128")][4] == [0.2]
    assert got[("push_ll_c", "1900")][4] == []  # no wait ended just before its notice
    assert [round(x, 3) for x in notice] == [5.0] and [round(x, 3) for x in taken] == [1.5]
    assert [round(x, 3) for x in target] == [1.0] and [round(x, 3) for x in lag] == [2.0]
    assert [round(x, 3) for x in got[("push_ll_c", "128")][0]] == [0.5]
    assert [round(x, 3) for x in got[("push_ll_c", "1900")][0]] == [1.5]
    # the A/B's ratio, set c over set a, at the length both have
    assert pn.ratios(got) == [" p50 push_ll_c / push_ll at 128 tokens: layer notice 0.10x, "
                              "target receipt 1.00x, target taken 1.00x, "
                              "GIL after the wake 0.05x"]


def _tt():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import ttft_timeline as tt
    finally:
        sys.path.pop(0)
    return tt


def test_ttft_timeline_sets_for_an_ab_of_two_trees(tmp_path, monkeypatch):
    """ttft_timeline.py --tree-b / --noasync (issue 31's same-lease A/B):
    the second tree's processes import the connector from that tree (first
    on PYTHONPATH, this tree off it), the others from this one; the
    no-async set turns vLLM's asynchronous scheduling off on its decode and
    its own colocated server only.  Built, not started."""
    tt = _tt()
    pp = os.pathsep.join([ROOT, "/x/site"])
    monkeypatch.setenv("PYTHONPATH", pp)
    tree_b = tmp_path / "treeb"
    (tree_b / "mooncake_connector").mkdir(parents=True)
    extra = {"push-ll": {"flow": "push", "extra_args": ("--push-layer-load", "on")}}
    deps = tt.make_sets(str(tmp_path / "w"), "/no/model", extra,
                        {"kv_cache_bytes": 1 << 20}, tree_b=str(tree_b), label_b="lc",
                        noasync=True)
    assert set(deps) == {"a", "lc", "na"}
    assert os.environ["PYTHONPATH"] == pp
    b = deps["lc"]
    assert b.colocated is None and list(b.proxies) == ["push-ll"] and b.metadata is not None
    for p in b.processes:
        assert p.env["PYTHONPATH"].split(os.pathsep) == [str(tree_b), "/x/site"], p.name
    for p in deps["a"].processes + deps["na"].processes:
        assert p.env["PYTHONPATH"] == pp, p.name
    na = deps["na"]
    assert "--no-async-scheduling" in na.decode.cmd and "--no-async-scheduling" in na.colocated.cmd
    assert "--no-async-scheduling" not in na.prefill.cmd
    assert not any("--no-async-scheduling" in p.cmd for d in (deps["a"], b) for p in d.processes)
    ports = [p.url for d in deps.values() for p in d.processes]
    assert len(set(ports)) == len(ports)


def test_ttft_timeline_extra_c_sets_the_decode_extra_config(tmp_path):
    """ttft_timeline.py --extra-c KEY=VALUE (a connector knob's A/B in one
    lease, e.g. early_recv): set "c"'s decode gets the key in its
    kv_connector_extra_config, JSON values typed; set "a"'s does not; a
    malformed item is a usage error."""
    tt = _tt()
    ap = tt._parser()
    args = ap.parse_args(["--extra-c", "early_recv=true", "--extra-c", "idle_wait_ms=5"])
    assert tt._check_ab(ap, args) == {}
    assert args.extra_c_dict == {"early_recv": True, "idle_wait_ms": 5}
    extra = {"push-ll": {"flow": "push", "extra_args": ("--push-layer-load", "on")}}
    deps = tt.make_sets(str(tmp_path / "w"), "/no/model", extra, {"kv_cache_bytes": 1 << 20},
                        extra_c=args.extra_c_dict)
    assert set(deps) == {"a", "c"}

    def cfg(d):
        i = d.decode.cmd.index("--kv-transfer-config")
        return json.loads(d.decode.cmd[i + 1]).get("kv_connector_extra_config") or {}
    assert cfg(deps["c"])["early_recv"] is True and cfg(deps["c"])["idle_wait_ms"] == 5
    assert "early_recv" not in cfg(deps["a"])
    with pytest.raises(SystemExit):
        tt._check_ab(ap, ap.parse_args(["--extra-c", "early_recv"]))


def test_ttft_timeline_bars_per_variant(capsys):
    """Issue 31's bars per push mode against its own set's colocated server
    (push_ll_na: colocated_na), the hop from the first set's pass-through
    proxy, the gap 1->2 against the reference's ITL; paired differences
    against the reference and against push_ll."""
    tt = _tt()

    def rec(mode, ttft, itl, cached=0):
        return {"mode": mode, "n": 128, "rid": f"tl-{mode}-128-0-1", "ttft_ms": ttft,
                "itl_ms": itl, "identical": True, "cached_tokens": cached, "prompt_tokens": 136}
    rows = {128: [rec("colocated", 20.0, [6.0, 6.0]), rec("colocated_proxy", 21.0, [6.0]),
                  rec("push_ll", 30.0, [9.0, 7.0], 128), rec("push_ll_lc", 22.5, [7.0], 128),
                  rec("colocated_na", 15.0, [6.0]), rec("push_ll_na", 18.5, [7.0], 128)]}
    modes = [r["mode"] for r in rows[128]]
    s = tt.report(rows, {}, modes, one_layer_ms=0.5)[128]
    assert s["proxy_hop_ms"] == 1.0
    assert s["bar_ttft_push_ll"] == 23.5 and not s["bar_ttft_push_ll_ok"]
    assert s["bar_ttft_push_ll_lc"] == 23.5 and s["bar_ttft_push_ll_lc_ok"]
    assert s["bar_ttft_push_ll_na"] == 18.5 and s["bar_ttft_push_ll_na_ok"]
    assert s["bar_gap12_push_ll"] == 8.0 and not s["bar_gap12_push_ll_ok"]
    assert s["bar_gap12_push_ll_lc_ok"] and s["bar_gap12_push_ll_na_ok"]
    assert s["paired_push_ll_na"] == 3.5 and s["paired_push_ll"] == 10.0
    assert s["paired_push_ll_lc_minus_push_ll"] == -7.5
    assert s["loaded_push_ll_lc"] == 128 and s["gap12_push_ll"] == 9.0
    out = capsys.readouterr().out
    assert "push_ll          TTFT 30.0 <= 23.5 (colocated 20.0) MISSED by 6.5 ms" in out
    assert "push_ll_na       TTFT 18.5 <= 18.5 (colocated_na 15.0) ok" in out


def test_ttft_timeline_pools_runs(tmp_path):
    """--pool: the requests of two runs together, each prompt paired within
    its own run (the same prompt index in two runs is two prompts)."""
    tt = _tt()

    def rec(mode, i, ttft, pid):
        return {"mode": mode, "n": 128, "rid": f"tl-{mode}-128-{i}-{pid}", "ttft_ms": ttft,
                "itl_ms": [5.0], "identical": True}
    paths = []
    for j, (c, p) in enumerate(((10.0, 13.0), (20.0, 21.0))):
        path = tmp_path / f"r{j}.json"
        path.write_text(json.dumps({"rows": {"128": [rec("colocated", 0, c, j),
                                                     rec("colocated_proxy", 0, c, j),
                                                     rec("push_ll", 0, p, j)]}}))
        paths.append(str(path))
    out = tmp_path / "pooled.json"
    assert tt.main(["--pool", *paths, "--out", str(out)]) == 0
    s = json.loads(out.read_text())["summary"]["rows"]["128"]
    assert s["identical_push_ll"] == "2/2"
    assert s["paired_push_ll"] == 2.0  # median of +3 and +1, not one run's pair
    assert s["ttft_colocated"] == 15.0


def test_ttft_timeline_prefill_with_and_without_push(capsys):
    """--prefill-plain: the push prefill server's scheduled -> first token
    and CPU with the push (push_ll's prefill leg) against the same prompt
    sent to it plainly, p50 and paired per prompt; run-queue waits are not
    CPU."""
    tt = _tt()

    def rec(mode, i, ttft, sched, cpu, **kw):
        key = "prefill_request_prefill_time_seconds" if mode == "push_ll" else \
            "request_prefill_time_seconds"
        return {"mode": mode, "n": 128, "rid": f"tl-{mode}-128-{i}-1", "ttft_ms": ttft,
                "itl_ms": [5.0], "identical": True, key: sched,
                "cpu_ms": {"prefill": {"1:1:core": cpu, "1:2:io": 1.0, "rq:1:1:core": 50.0}},
                **kw}
    rows = {128: [rec("colocated", 0, 20.0, 9.0, 0.0), rec("colocated_proxy", 0, 21.0, 9.0, 0.0),
                  rec("push_ll", 0, 25.0, 12.0, 10.0), rec("prefill_plain", 0, 15.0, 10.0, 8.0),
                  rec("colocated", 1, 20.0, 9.0, 0.0), rec("colocated_proxy", 1, 21.0, 9.0, 0.0),
                  rec("push_ll", 1, 25.0, 11.0, 9.0), rec("prefill_plain", 1, 15.0, 10.5, 8.5)]}
    modes = list(dict.fromkeys(r["mode"] for r in rows[128]))
    s = tt.report(rows, {}, modes)[128]
    assert s["push_ll_sched_first"] == 11.5 and s["prefill_plain_sched_first"] == 10.25
    assert s["paired_prefill_push_minus_plain"] == 1.25  # median of +2.0 and +0.5
    assert s["push_ll_prefill_cpu"] == 10.5 and s["prefill_plain_prefill_cpu"] == 9.25
    assert s["paired_prefill_cpu_push_minus_plain"] == 1.25
    assert s["push_ll_prefill_cpu_top"] == 9.5 and s["paired_prefill_cpu_top_push_minus_plain"] == 1.25
    out = capsys.readouterr().out
    assert "with the push (push_ll's prefill leg) / without (prefill_plain)" in out
    assert "scheduled->first token 11.5 / 10.2 ms (paired +1.25)" in out


def test_ttft_timeline_env_set(tmp_path, monkeypatch):
    """ttft_timeline.py --env-c: a third set from this tree whose servers
    (and only those) get the given environment variables; bad ones named."""
    tt = _tt()
    extra = {"push-ll": {"flow": "push", "extra_args": ("--push-layer-load", "on")}}
    deps = tt.make_sets(str(tmp_path / "w"), "/no/model", extra,
                        {"kv_cache_bytes": 1 << 20, "env": {"K0": "1"}},
                        env_c={"MC_GPU_POLL_NS": "2000"})
    assert set(deps) == {"a", "c"}
    c = deps["c"]
    assert c.colocated is None and list(c.proxies) == ["push-ll"]
    assert c.prefill.env["MC_GPU_POLL_NS"] == "2000" and c.decode.env["MC_GPU_POLL_NS"] == "2000"
    assert c.prefill.env["K0"] == "1"
    assert not any("MC_GPU_POLL_NS" in p.env for p in deps["a"].processes)
    ports = [p.url for d in deps.values() for p in d.processes]
    assert len(set(ports)) == len(ports)
    with pytest.raises(SystemExit):
        tt.main(["--env-c", "no-equals", "--out", str(tmp_path / "x.json")])


def test_gate_chain_splits_a_layer_hand_off(tmp_path):
    """benchmarks/gate_chain.py: a layer saved on the prefill (MC_TRACE) is
    matched to the gate's submit and the copy job after it in the
    prefill's engine log (MC_GPU_TRACE, microseconds modulo 100 s, here
    across the wrap), and to the decode's receipt when the decode waited;
    another prefill's log is not taken for it."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gate_chain as gc
    finally:
        sys.path.pop(0)
    t0 = 199.9995  # s: 99,999,500 us on the engine's wrapped clock
    k = "push-tl-push_ll-128-0-7-abc"
    ev = [{"t": t0 - 0.001, "k": k, "pid": 2, "ev": "sched_publish", "n_sched": 133},
          {"t": t0, "k": k, "pid": 2, "ev": "layer_saved", "li": 0},
          {"t": t0 - 0.0002, "k": k, "pid": 3, "ev": "layer_wait", "li": 0},
          {"t": t0 + 0.0009, "k": k, "pid": 3, "ev": "c_recv", "what": "layer", "l": [0]}]
    log = tmp_path / "prefill.log"
    # submit 100 us after the save (99,999,600), the job queued 420 us later (past the
    # wrap: 20.0), picked up +30, launched +40, done seen +240
    log.write_text("x gpu trace: 4 requests at 99999600.0 us: validate 1.0 us, locate (first "
                   "chunk) 2.0 us, submit all 3.0 us, whole call to its transport yes\n"
                   "y gpu trace: D2D job cuda:0, 8 copies: queued at 20.0 us, launched +40.0 us, "
                   "done seen +240.0 us, picked up +30.0 us\n")
    other = tmp_path / "other.log"
    other.write_text("gpu trace: 4 requests at 5000000.0 us: validate 1.0 us, locate (first "
                     "chunk) 2.0 us, submit all 3.0 us, whole call to its transport yes\n")
    res = gc.chains(ev, {str(log): gc.read_log(str(log)), str(other): gc.read_log(str(other))})
    h = res[("push_ll", 128)]
    near = pytest.approx

    assert h[gc.HOPS[0]] == [near(0.1)] and h[gc.HOPS[1]] == [near(0.42)]
    assert h[gc.HOPS[2]] == [near(0.03)] and h[gc.HOPS[3]] == [near(0.01)]
    assert h[gc.HOPS[4]] == [near(0.2)]
    assert h[gc.HOPS[5]] == [near(0.14)] and h[gc.HOPS[6]] == [near(0.9)]
    assert len(res) == 1  # the other log's submit explains no save


def test_serving_bench_prefix_cached_reference_is_opt_in():
    """colocated_cached (a fourth server: vLLM's prefix cache, the prompt sent
    twice) is asked for by name, not by --modes all, and its per-mode token
    identity reaches the summary."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import serving_bench as sb
    finally:
        sys.path.pop(0)
    assert "colocated_cached" not in sb.parse_args(["--modes", "all"])[2]
    assert "colocated_cached" in sb.parse_args(["--modes", "colocated_cached,push"])[2]
    n = 2
    row = {"prompt_words": 128, "prompt_tokens": 130, "identical": 1, "loaded_tokens": [],
           "colocated": [0.1] * n, "colocated_cached": [0.05] * n, "push": [0.12] * n,
           "identical_to_cached_by_mode": {"colocated": 1, "colocated_cached": 2, "push": 2}}
    for k, _ in sb.MODES:
        row[f"itl_{k}"], row[f"gap12_{k}"] = [0.01] * n, [0.01] * n
    s = sb.summarize([row], None, {128: {"seconds": 0.001, "bytes": 1 << 20}})["rows"][0]
    assert s["identical_to_cached_by_mode"] == {"colocated": 1, "colocated_cached": 2, "push": 2}
    assert "colocated_cached" in s["modes"]


def test_ttft_timeline_main_with_stand_in_servers(tmp_path, monkeypatch):
    """ttft_timeline.py's main end to end with stand-ins for the servers (no
    vLLM): every set's processes started and stopped, the metadata servers
    first and last; every mode warmed up 3 times, then each prompt sent
    once through every mode in a seeded random order; each row with its
    histogram differences (the decode's, and the prefill's for push modes),
    its CPU reading and its tokens compared with colocated's; --pin and
    --nice applied to the named servers; the JSON written."""
    import types
    from mooncake_connector import openai_client, serving, tiny_model
    tt = _tt()
    NS = types.SimpleNamespace
    pid = iter(range(1000, 2000))

    def proc(name):
        return NS(name=name, url=f"http://{name}", proc=NS(pid=next(pid)),
                  env={"PYTHONPATH": "/p"}, cmd=["--no-async-scheduling"] if "decode" in name
                  else [])

    def dep(name, colocated=True, whole=True):
        d = NS(metadata=proc(f"{name}-meta"), prefill=proc(f"{name}-prefill"),
               decode=proc(f"{name}-decode"),
               colocated=proc(f"{name}-colocated") if colocated else None,
               colocated_proxy=proc(f"{name}-colocated-proxy") if colocated else None,
               proxies={k: proc(f"{name}-{k}") for k in ("push-ll", "push-ll-b", "push-whole")
                        if k != "push-whole" or whole})
        d.processes = [p for p in (d.metadata, d.prefill, d.decode, d.colocated,
                                   d.colocated_proxy, *d.proxies.values()) if p is not None]
        return d
    made = {}

    def make_sets(workdir, model, extra, common, **kw):
        made.update(extra=sorted(extra), kw=kw)
        return {"a": dep("a"), "c": dep("c", colocated=False, whole=False)}
    started, stopped, sent = [], [], []
    counters = {}

    def scrape(url):
        counters[url] = counters.get(url, 0.0) + 0.001
        return {"vllm:request_queue_time_seconds": counters[url],
                "vllm:request_prefill_time_seconds": 2 * counters[url]}

    def request(url, path, body, timeout=None, headers=None):
        sent.append((url, body["prompt"][:40], (headers or {}).get("X-Request-Id")))
        toks = [1, 2, 3][:body["max_tokens"]]
        return NS(status=200, error=None, ttft_s=0.02 if "colocated" in url else 0.03,
                  token_ids=toks, itl_s=[0.001] * (len(toks) - 1), cached_tokens=0,
                  usage={"prompt_tokens": 7})
    monkeypatch.setattr(tt, "make_sets", make_sets)
    monkeypatch.setattr(tt, "scrape", scrape)
    monkeypatch.setattr(tt, "cpu_ns", lambda pgids: {"prefill": {"t": 1e6 * len(sent)}})
    monkeypatch.setattr(tt, "pin", lambda p, cpu: [p.proc.pid])
    monkeypatch.setattr(tt, "renice", lambda p, v: [p.proc.pid])
    monkeypatch.setattr(tt, "SETTLE_S", 0.0)
    monkeypatch.setattr(tt.time, "sleep", lambda s: None)
    monkeypatch.setattr(serving, "start_all", lambda ps, t: started.append([p.name for p in ps]))
    monkeypatch.setattr(serving, "stop_all", lambda ps: stopped.append([p.name for p in ps]))
    monkeypatch.setattr(tiny_model, "build", lambda **kw: "/no/model")
    monkeypatch.setattr(openai_client, "request", request)
    monkeypatch.delenv("MC_TRACE", raising=False)
    out = tmp_path / "tl.json"
    assert tt.main(["--lengths", "16,32", "--requests", "2", "--no-trace", "--whole",
                    "--prefill-plain", "--max-tokens", "3", "--env-c", "MC_X=1",
                    "--pin", "decode=1", "--nice", "prefill_c=idle", "--workdir",
                    str(tmp_path / "w"), "--out", str(out)]) == 0
    assert made["extra"] == ["push-ll", "push-ll-b", "push-whole"]
    assert made["kw"]["env_c"] == {"MC_X": "1"}
    assert started[0] == ["a-meta"] and started[1] == ["c-meta"] and len(started) == 3
    assert "a-meta" not in started[2] and len(started[2]) == 11
    assert stopped[-1] == ["a-meta", "c-meta"] and len(stopped) == 2
    modes = ["colocated", "colocated_proxy", "push_ll", "push_ll_b", "push_whole",
             "prefill_plain", "push_ll_c"]
    warm = len(modes) * 3
    assert len(sent) == warm + 2 * 2 * len(modes)
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert sorted(rows) == ["16", "32"] and all(len(v) == 2 * len(modes) for v in rows.values())
    # the seeded order: each prompt through every mode, shuffled per prompt
    first = [r["mode"] for r in rows["16"][:len(modes)]]
    assert sorted(first) == sorted(modes)
    # random.Random(31) over the modes in their order of setting up
    assert [r["mode"] for r in rows["16"] + rows["32"]][:10] == [
        "colocated_proxy", "push_ll", "push_whole", "prefill_plain", "push_ll_c", "push_ll_b",
        "colocated", "push_ll_b", "prefill_plain", "push_ll"]
    assert [s[2] for s in sent[warm:warm + len(modes)]] == [r["rid"] for r in
                                                           rows["16"][:len(modes)]]
    for r in rows["16"] + rows["32"]:
        assert r["identical"] is True, r
        assert r["request_queue_time_seconds"] == pytest.approx(1.0)
        assert ("prefill_request_queue_time_seconds" in r) == (r["mode"] in ("push_ll",
                                                                          "push_ll_c"))
        assert r["cpu_ms"] == {"prefill": {"t": 1.0}}
    s = res["summary"]
    assert s["pinned"] == {"decode": [1, [s["pinned"]["decode"][1][0]]]}
    assert s["niced"]["prefill_c"][0] == "idle" and s["traced"] is False
    assert s["sets"]["c"]["env"] == {"MC_X": "1"} and "servers_up_s" in s
    assert s["sets"]["a"]["no_async_scheduling"] is True


def test_serving_bench_layer_read_mode():
    """push_layer_read: in --modes all, its own proxy asks for layer loads read
    by the decode (--push-layerwise on --push-layer-load on --push-layer-read
    on), it gets that proxy's URL, and the summary pairs its TTFT with
    push_layer_load's per request."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import serving_bench as sb
    finally:
        sys.path.pop(0)
    assert {"push_layer_load", "push_layer_read"} <= sb.parse_args(["--modes", "all"])[2]
    want = sb.parse_args(["--modes", "push_layer_load,push_layer_read"])[2]
    extra, skipped = sb._mode_proxies(want, ("a", "b", "push"))
    assert not skipped
    assert extra["push-layer-read"] == {"flow": "push", "extra_args": (
        "--push-layerwise", "on", "--push-layer-load", "on", "--push-layer-read", "on")}
    assert "--push-layer-read" not in extra["push-layer-load"]["extra_args"]

    class P:
        def __init__(self, url):
            self.url = url

    class Dep:
        colocated, colocated_proxy, colocated_cached = P("c"), P("cp"), None
        proxies = {"a": P("a"), "push-layer-load": P("ll"), "push-layer-read": P("lr")}
    urls = sb._mode_urls(Dep, want, skipped)
    assert urls["push_layer_read"] == "lr" and urls["push_layer_load"] == "ll"
    _, skipped = sb._mode_proxies(want, ("a", "b"))
    assert "push_layer_read" in skipped
    n = 3
    row = {"prompt_words": 128, "prompt_tokens": 130, "identical": n, "loaded_tokens": [],
           "colocated": [0.1] * n, "push_layer_load": [0.100, 0.200, 0.400],
           "push_layer_read": [0.110, 0.180, 0.480]}                # ratios 1.1, 0.9, 1.2
    for k, _ in sb.MODES:
        row[f"itl_{k}"], row[f"gap12_{k}"] = [0.01] * n, [0.01] * n
    s = sb.summarize([row], None, {128: {"seconds": 0.001, "bytes": 1 << 20}})["rows"][0]
    assert abs(s["read_vs_load_ttft_ratio_paired_p50"] - 1.1) < 1e-9
    assert abs(s["read_vs_load_ttft_ratio_of_p50"] - 0.9) < 1e-9   # 180 / 200
    assert abs(s["read_vs_load_ttft_paired_diff_ms_p50"] - 10.0) < 1e-6
    assert "push_layer_read" in s["modes"] and "push_layer_read" in sb.COLORS
