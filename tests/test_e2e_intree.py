"""vLLM's in-tree MooncakeConnector on our engine, with real vLLM servers
(pytest -m e2e; docs/compat.md "vLLM's in-tree MooncakeConnector on our engine").

A prefill and a decode vLLM server (CPU backend) configured the in-tree way:
  {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer" | "kv_consumer",
   "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
with no Mooncake installed and MC_MOONCAKE_SHIM=1, so vLLM's
`from mooncake.engine import TransferEngine` gets ours (mooncake_shim).
The requests follow the in-tree connector's proxy contract (vLLM's
tests/v1/kv_connector/mooncake_integration/toy_proxy_server.py; written up
in docs/compat.md): the prefill's bootstrap server (/query) names its
engine id; per request one transfer_id; the prefill leg
(do_remote_decode, max_tokens 1) and the decode leg (do_remote_prefill,
remote_bootstrap_addr, remote_engine_id, transfer_id) are sent at once.

Checked per request: greedy tokens identical to the decode server computing
the prompt itself (token_match.judge; MC_E2E_OWN_REFERENCE=1: to a third,
colocated server without any connector); the decode's /metrics count the
whole prompt as loaded from the peer (external_kv_transfer) and none computed; and the prefill's
log has our engine's line for each push (MC_MOONCAKE_SHIM_STATS=1), from
the prefill's engine to the decode's (the segments our C engine logged at
start-up in each server), whose bytes add up to exactly the prompt's blocks
x layers x block bytes, as the engine's own same-host byte counter says.

One test-side shim is needed (tests/intree_cpu/sitecustomize.py): vLLM's
MooncakeConnectorWorker.__init__ asks torch.accelerator for a device index,
which raises on a host without an accelerator (vllm 0.32.0
mooncake_connector.py:1186); it answers 0 there (the CPU platform ignores it).
"""
import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
import threading
import time

import pytest

from mooncake_connector.connector.bootstrap import intree_legs
from mooncake_connector.demo import _prompt
from mooncake_connector.deployment import prompt_tokens_by_source
from mooncake_connector.openai_client import request
from mooncake_connector.token_match import judge

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXT = "external_kv_transfer"  # vLLM's prompt_tokens_by_source label
BLOCK = 32  # serving.BASE_VLLM_ARGS' --block-size
REQ_TIMEOUT = float(os.environ.get("MC_E2E_REQ_TIMEOUT", "900"))
# 1 token, one partial block, a full block and a partial one, several blocks.
PROMPTS = [("short", "hello world, here we go again"), ("medium", _prompt(45, 31)),
           ("long", _prompt(200, 32))]
# Our C engine's own start line (MC_LOG_LEVEL=info), as vLLM initialized it.
ENGINE_UP = re.compile(r"mooncake-connector\[\d+\] INFO engine (127\.0\.0\.1:\d+) up "
                       r"\(protocol tcp, metadata P2PHANDSHAKE\)")
STATS_RE = re.compile(
    r"engine (\S+) \(mooncake_connector, served as mooncake\.engine\): "
    r"batch_transfer_sync_write to (\S+) ok, (\d+) bytes; .* "
    r"same_host_cpu_bytes_written=(\d+)")


def _config(role):
    return {"kv_connector": "MooncakeConnector", "kv_role": role,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}


def _body(prompt, stream=False, logprobs=False):
    b = {"model": "tiny", "prompt": prompt, "temperature": 0.0, "max_tokens": 8,
         "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if logprobs:
        b["logprobs"] = 2
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


def _site_dir(workdir):
    """sitecustomize.py + our wheel's .pth, on the servers' PYTHONPATH only."""
    site = os.path.join(workdir, "site")
    os.makedirs(site)
    shutil.copy(os.path.join(HERE, "intree_cpu", "sitecustomize.py"), site)
    shutil.copy(os.path.join(ROOT, "mooncake_connector_shim.pth"), site)
    return site


def _query(boot, timeout=5.0):
    from mooncake_connector import serving
    status, body = serving.http_get(f"http://127.0.0.1:{boot}/query", timeout=timeout)
    assert status == 200, f"bootstrap /query answered {status}: {body[:300]}"
    return json.loads(body)


def _pd_request(d, body, stream):
    """One request the in-tree connector's way: both legs at once, joined
    by transfer_id (vLLM's toy_proxy_server.py)."""
    rid, pre, dec = intree_legs(dict(body, stream=stream), d["bootstrap_addr"], d["engine_id"])
    out = {}

    def prefill_leg():
        out["p"] = request(d["prefill"].url, "/v1/completions", pre, timeout=REQ_TIMEOUT,
                           headers={"X-Request-Id": rid, "X-data-parallel-rank": "0"})

    t = threading.Thread(target=prefill_leg, daemon=True)
    t.start()
    r = request(d["decode"].url, "/v1/completions", dec, timeout=REQ_TIMEOUT,
                headers={"X-Request-Id": rid})
    t.join(REQ_TIMEOUT)
    p = out.get("p")
    assert p is not None and p.status == 200, ("prefill leg", p and p.status, p and p.error)
    return r


def _stats_lines(log_path, since):
    with open(log_path, "rb") as f:
        f.seek(since)
        text = f.read().decode("utf-8", "replace")
    return [m.groups() for m in STATS_RE.finditer(text)]


def _path(log_path, segment):
    """True if the engine's first-contact line (MC_LOG_LEVEL=info) says it
    reaches `segment` by the same-host CPU path, False if it says TCP (e.g.
    switched off, or no ptrace rights in a container: the reason is logged)."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    shc = f"same-host CPU path to segment {segment}: cross-memory attach" in text
    tcp = f"segment {segment}: not via same-host-cpu" in text
    assert shc != tcp, f"the engine logged neither or both paths to {segment}"
    return shc


def _size(path):
    return os.path.getsize(path) if os.path.exists(path) else 0


@pytest.fixture(scope="module")
def intree(tiny_model_dir):
    from mooncake_connector import serving, tiny_model
    from e2e_fixtures import START_TIMEOUT_S

    from mooncake_connector import mooncake_shim
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and not isinstance(spec.loader, mooncake_shim._Loader):
        pytest.skip(f"a real Mooncake package is installed ({spec.origin}): vLLM would use "
                    "it, not ours")
    workdir = tempfile.mkdtemp(prefix="mc-e2e-intree-")
    site = _site_dir(workdir)
    boot = serving.free_port()
    env = {"MC_MOONCAKE_SHIM": "1", "MC_MOONCAKE_SHIM_STATS": "1",
           "MC_INTREE_CPU_ACCEL_INDEX": "1", "VLLM_HOST_IP": "127.0.0.1", "MC_LOG_LEVEL": "info",
           # Our engine's default between two processes of one host: the
           # same-host CPU path (tests/conftest.py turns it off for tests),
           # whose own byte counter the push lines carry.  TCP, the protocol
           # the configuration names, is the in-process cell's
           # (tests/test_intree_worker.py); MC_INTREE_E2E_TCP=1 runs this on it.
           "MC_SAME_HOST_CPU": "0" if os.environ.get("MC_INTREE_E2E_TCP") == "1" else "1",
           "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot),
           "PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH"))
                                         if p)}
    logs = os.path.join(workdir, "logs")
    prefill = serving.vllm_server("prefill (in-tree MooncakeConnector)", tiny_model_dir,
                                  serving.free_port(), os.path.join(logs, "prefill.log"),
                                  _config("kv_producer"), env=env)
    decode = serving.vllm_server("decode (in-tree MooncakeConnector)", tiny_model_dir,
                                 serving.free_port(), os.path.join(logs, "decode.log"),
                                 _config("kv_consumer"), env=env)
    procs = [prefill, decode]
    colocated = None
    if os.environ.get("MC_E2E_OWN_REFERENCE") == "1":  # an independent colocated server
        colocated = serving.vllm_server("colocated (no connector)", tiny_model_dir,
                                        serving.free_port(), os.path.join(logs, "colocated.log"))
        procs.append(colocated)
    t0 = time.monotonic()
    serving.start_all(procs, START_TIMEOUT_S)
    try:
        print(f"\nin-tree cell up in {time.monotonic() - t0:.0f} s; logs in {logs}")
        q = _query(boot)
        assert list(q) == ["0"] and list(q["0"]["worker_addr"]) == ["0"], q
        spec = tiny_model.spec_with()
        yield {"prefill": prefill, "decode": decode, "colocated": colocated, "boot": boot,
               "query": q,
               "engine_id": q["0"]["engine_id"], "bootstrap_addr": f"http://127.0.0.1:{boot}",
               "layers": spec["layers"],
               "block_bytes": BLOCK * tiny_model.kv_bytes_per_token(spec) // spec["layers"]}
    finally:
        serving.stop_all(procs)


def test_servers_run_vllms_class_on_our_engine(intree):
    """Both servers: vLLM's own class (our plugin keeps it for this shape of
    configuration), its worker started, `mooncake.engine` served by us."""
    for side in ("prefill", "decode"):
        with open(intree[side].log_path, encoding="utf-8", errors="replace") as f:
            log = f.read()
        assert "mooncake.engine is provided by mooncake_connector (MC_MOONCAKE_SHIM=1" in log, \
            (side, log[-3000:])
        assert "Initializing Mooncake Transfer Engine worker" in log, (side, log[-3000:])
        # Our C engine's own start line (MC_LOG_LEVEL=info), as vLLM initialized it.
        assert ENGINE_UP.search(log), (side, log[-3000:])
        assert "Please install mooncake" not in log, side
        if "resolves to" in log:  # our vLLM plugin is installed: it must keep vLLM's class
            assert "resolves to vLLM's in-tree MooncakeConnector" in log, side
    addr = intree["query"]["0"]["worker_addr"]["0"]["0"]
    assert addr.startswith("tcp://127.0.0.1:"), addr


def test_disaggregated_tokens_identical_and_kv_moved_by_our_engine(intree):
    d = intree
    # References: the decode server computing each prompt itself (no
    # kv_transfer_params: its connector does nothing), or with
    # MC_E2E_OWN_REFERENCE=1 a colocated server without any connector.
    ref_url = (d["colocated"] or d["decode"]).url
    refs, lens = {}, {}
    before = prompt_tokens_by_source(d["decode"].url)
    for pid, prompt in PROMPTS:
        r = request(ref_url, "/v1/completions", _body(prompt, logprobs=True),
                    timeout=REQ_TIMEOUT)
        assert r.status == 200 and r.token_ids, (pid, r.status, r.error)
        refs[pid] = (r.token_ids, r.top_logprobs)
        lens[pid] = r.usage["prompt_tokens"]
    after = prompt_tokens_by_source(d["decode"].url)
    assert after.get(EXT, 0) == before.get(EXT, 0), (before, after)

    segs = {}
    for side in ("prefill", "decode"):
        with open(d[side].log_path, encoding="utf-8", errors="replace") as f:
            found = ENGINE_UP.findall(f.read())
        assert len(found) == 1, (side, found)  # one worker, one engine
        segs[side] = found[0]
    d = dict(d, prefill_seg=segs["prefill"], decode_seg=segs["decode"])
    log = d["prefill"].log_path
    same_host = None  # which path the engine took: its first-contact line says
    total = 0
    mismatches, report = [], []
    for pid, prompt in PROMPTS:
        for stream in (False, True):
            m0, l0 = prompt_tokens_by_source(d["decode"].url), _size(log)
            r = _pd_request(d, _body(prompt), stream)
            assert r.status == 200 and r.error is None, (pid, stream, r.status, r.error)
            verdict, note = judge(refs[pid][0], refs[pid][1], r.token_ids)
            if verdict == "differ":
                mismatches.append(f"{pid} stream={stream}: {note}")
            deadline = time.monotonic() + 30  # a loaded CI host
            while True:  # the counters follow the answer by a step
                m1 = prompt_tokens_by_source(d["decode"].url)
                delta = {k: v - m0.get(k, 0) for k, v in m1.items() if v != m0.get(k, 0)}
                if sum(delta.values()) >= lens[pid] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            loaded, computed = delta.get(EXT, 0), delta.get("local_compute", 0)
            # The prefill pushes after its request finished; the decode's
            # answer waits for it, so the line is there, give the log a moment.
            want = math.ceil(lens[pid] / BLOCK) * d["layers"] * d["block_bytes"]
            deadline = time.monotonic() + 30  # a loaded CI host
            while True:
                lines = _stats_lines(log, l0)
                if sum(int(x[2]) for x in lines) >= want or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            moved = sum(int(x[2]) for x in lines)
            report.append(f"{pid} ({lens[pid]} tokens) stream={stream}: {verdict}, "
                          f"decode loaded {loaded} computed {computed}, our engine pushed "
                          f"{moved} bytes in {len(lines)} call(s)")
            assert loaded == lens[pid] and computed == 0, (report[-1], delta)
            assert moved == want, (report[-1], f"want {want} bytes", lines)
            total += moved
            if same_host is None:
                same_host = _path(log, d["decode_seg"])
                if d["prefill"].env["MC_SAME_HOST_CPU"] == "0":
                    assert not same_host, "MC_SAME_HOST_CPU=0 and still the same-host path"
                report.append(f"our engine's path to the decode: "
                              f"{'same-host CPU' if same_host else 'TCP'}")
            # The engine's own counter: on the same-host CPU path it counted
            # every byte pushed so far; over TCP it has nothing to count.
            assert int(lines[-1][3]) == (total if same_host else 0), (lines, total)
            # Pushed by the prefill's engine to the decode server's engine.
            assert {(x[0], x[1]) for x in lines} == {(d["prefill_seg"], d["decode_seg"])}, lines
    print("\n" + "\n".join(report))
    assert not mismatches, mismatches
