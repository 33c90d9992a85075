"""mooncake-connector doctor against real servers: each misconfiguration in
docs/doctor.md's table is made for real (etcd, Redis and the HTTP metadata
server started here, ports taken by real listeners, a peer `doctor --serve`
process) and doctor must fail it with a fix that names what to do.

The servers are started once for the module (about 2 s); each doctor run is
its own process (`python -m mooncake_connector doctor --json`), so the
entry point is tested too.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.error

import pytest

from conftest import outward_addr
from test_metadata_backends import REDIS_PASSWORD, EtcdServer, HttpServer, RedisServer

from mooncake_connector.serving import free_port

mc = pytest.importorskip("mooncake_connector")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    made = {}
    for kind, cls, binary in (("etcd", EtcdServer, "etcd"), ("redis", RedisServer, "redis-server"),
                              ("http", HttpServer, None)):
        if binary and shutil.which(binary) is None:
            continue
        made[kind] = cls(tmp_path_factory.mktemp(f"doctor-{kind}")).start()
    yield made
    for s in made.values():
        s.stop()


def need(servers, kind):
    if kind not in servers:
        pytest.skip(f"{kind} server not installed (scripts/env.sh installs it)")
    return servers[kind]


def two_ports():
    """Two free ports at least 50 apart (the config's rule for one host)."""
    a = free_port()
    return a, free_port(away=[a])


def write_cfg(tmp_path, **fields):
    p, d = two_ports()
    cfg = {"prefill_url": f"127.0.0.1:{p}", "decode_url": f"127.0.0.1:{d}",
           "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "device_name": ""}
    cfg.update(fields)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    p = tmp_path / "mooncake.json"
    p.write_text(json.dumps(cfg) if isinstance(cfg, dict) else cfg)
    return str(p)


def doctor(*args, env=None, timeout=60):
    e = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"
         and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    for k, v in (env or {}).items():
        e[k] = v + os.pathsep + e[k] if k == "PYTHONPATH" and e.get(k) else v
    r = subprocess.run([sys.executable, "-m", "mooncake_connector", "doctor", "--json", *args],
                       capture_output=True, text=True, env=e, timeout=timeout, cwd="/")
    assert r.returncode in (0, 1), r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] == (r.returncode == 0)
    for x in out["rows"]:  # every failure says how to fix it
        assert x["status"] != "fail" or x["fix"], x
    return r.returncode, out["rows"]


def row(rows, check, item=None, status=None):
    hits = [r for r in rows if r["check"] == check and (item is None or item in r["item"])
            and (status is None or r["status"] == status)]
    assert hits, f"no {check}/{item}/{status} row in {json.dumps(rows, indent=1)}"
    return hits[0]


def failed(rows, check, item=None):
    r = row(rows, check, item, "fail")
    assert r["fix"], r
    return r


# ------------------------------------------------------------ healthy setups

@pytest.mark.parametrize("kind", ["etcd", "redis", "http"])
def test_healthy_metadata(servers, tmp_path, kind):
    srv = need(servers, kind)
    rc, rows = doctor("--config", write_cfg(tmp_path, metadata_server=srv.url))
    r = row(rows, "metadata", status="ok")
    assert f"{kind} reachable" in r["detail"] and "put " in r["detail"] and " ms" in r["detail"]
    assert row(rows, "engine", "prefill_url")["status"] == "ok"
    assert row(rows, "engine", "prefill port", "ok")
    assert rc == 0, rows
    if kind == "redis":
        assert REDIS_PASSWORD not in json.dumps(rows)  # masked


def test_p2p_table_and_console_script(tmp_path):
    cfg = write_cfg(tmp_path)
    exe = os.path.join(os.path.dirname(sys.executable), "mooncake-connector")
    if not os.path.exists(exe):
        pytest.skip("console script not installed next to this python")
    r = subprocess.run([exe, "doctor", "--config", cfg], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CHECK" in r.stdout and "P2PHANDSHAKE" in r.stdout and "0 failed" in r.stdout


# ------------------------------------------------------------ 1-3: the file

def test_no_config_given():
    rc, rows = doctor()
    assert rc == 1
    assert "MOONCAKE_CONFIG_PATH" in failed(rows, "config", "file")["fix"]


def test_config_file_missing(tmp_path):
    rc, rows = doctor("--config", str(tmp_path / "nope.json"))
    assert rc == 1 and "create" in failed(rows, "config")["fix"]


def test_bad_field_value(tmp_path):
    rc, rows = doctor("--config", write_cfg(tmp_path, protocol="udp"))
    r = failed(rows, "config")
    assert rc == 1 and '"protocol"' in r["fix"] and '"rdma"' in r["fix"]


def test_vllm_kv_transfer_config_pasted(tmp_path):
    p = tmp_path / "mooncake.json"
    p.write_text(json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}))
    rc, rows = doctor("--config", str(p))
    r = failed(rows, "config")
    assert rc == 1 and "kv_connector" in r["detail"], r
    assert 'remove "kv_connector"' in r["fix"] and "prefill_url" in r["fix"], r


def test_kv_transfer_config_checked_with_the_file(tmp_path):
    """--kv-transfer-config: the flag vLLM is to get, with the file, as the
    server's start takes them; its kv_role picks the engine check's side."""
    cfg = write_cfg(tmp_path)
    ktc = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
                      "kv_load_failure_policy": "fail",
                      "kv_connector_extra_config": {"push_layer_load": True}})
    rc, rows = doctor("--config", cfg, "--kv-transfer-config", ktc)
    r = row(rows, "config", "kv-transfer-config", "ok")
    assert "kv_consumer" in r["detail"] and "push_layer_load" in r["detail"], r
    assert "replaced by the connector's" in row(rows, "config", "kv_load_failure_policy",
                                                "warn")["detail"]
    assert row(rows, "engine", "decode_url") and \
        not [x for x in rows if x["check"] == "engine" and "prefill" in x["item"]], rows
    assert rc == 0, rows
    ktc = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
                      "kv_connector_extra_config": {"push_layer_load_async": True}})
    rc, rows = doctor("--config", cfg, "--kv-transfer-config", ktc)
    r = failed(rows, "config", "kv-transfer-config")
    assert rc == 1 and "set load_failure_policy to 'fail'" in r["detail"], r
    rc, rows = doctor("--config", cfg, "--kv-transfer-config", "{not json")
    assert rc == 1 and "not valid JSON" in failed(rows, "config", "kv-transfer-config")["detail"]
    # the seed's field twice, another file named in the extra config: said
    (tmp_path / "other").mkdir()
    other = write_cfg(tmp_path / "other")
    ktc = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
                      "kv_rank": 1, "kv_connector_extra_config": {
                          "kv_rank": 0, "mooncake_config_path": other}})
    rc, rows = doctor("--config", cfg, "--kv-transfer-config", ktc)
    assert "1 at the top level is ignored" in row(rows, "config", "kv_rank", "warn")["detail"]
    r = row(rows, "config", "mooncake_config_path", "warn")
    assert f"the server reads {other}" in r["detail"] and f"--config {other}" in r["fix"], r
    # a mooncake.json field given in the extra config: the workers' parser reads it
    ktc = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
                      "kv_connector_extra_config": {"protocol": "udp"}})
    rc, rows = doctor("--config", cfg, "--kv-transfer-config", ktc)
    r = failed(rows, "config", "kv-transfer-config")
    assert rc == 1 and '"protocol": value "udp"' in r["detail"], r


# ------------------------------------------------------------ 4-8: metadata

@pytest.mark.parametrize("kind", ["etcd", "redis", "http"])
def test_metadata_server_not_running(tmp_path, kind):
    port = free_port()
    url = {"etcd": f"etcd://127.0.0.1:{port}", "redis": f"redis://127.0.0.1:{port}",
           "http": f"http://127.0.0.1:{port}/metadata"}[kind]
    rc, rows = doctor("--config", write_cfg(tmp_path, metadata_server=url))
    fix = failed(rows, "metadata")["fix"]
    assert rc == 1 and f"nothing listens on 127.0.0.1:{port}" in fix and kind in fix, fix


@pytest.mark.parametrize("written,actual,want", [
    ("http", "etcd", "etcd://"), ("etcd", "redis", "redis://"), ("redis", "http", "http://"),
    ("bare", "http", "/metadata"), ("http", "redis", "redis://"), ("etcd", "http", "http://")])
def test_metadata_wrong_kind(servers, tmp_path, written, actual, want):
    srv = need(servers, actual)
    hp = f"127.0.0.1:{srv.port}"
    url = {"http": f"http://{hp}/metadata", "etcd": f"etcd://{hp}", "redis": f"redis://{hp}",
           "bare": hp}[written]
    rc, rows = doctor("--config", write_cfg(tmp_path, metadata_server=url))
    fix = failed(rows, "metadata")["fix"]
    assert rc == 1 and (f'"{want}' in fix or f"{hp}{want}" in fix), fix
    assert f"is {'a Redis' if actual == 'redis' else 'an etcd' if actual == 'etcd' else 'an HTTP'}" \
        in fix, fix


def test_redis_password_missing(servers, tmp_path):
    srv = need(servers, "redis")
    rc, rows = doctor("--config", write_cfg(tmp_path, metadata_server=f"redis://127.0.0.1:{srv.port}"))
    fix = failed(rows, "metadata")["fix"]
    assert rc == 1 and "redis://:PASSWORD@" in fix and "MC_REDIS_PASSWORD" in fix, fix


def test_redis_password_wrong(servers, tmp_path):
    srv = need(servers, "redis")
    rc, rows = doctor("--config", write_cfg(
        tmp_path, metadata_server=f"redis://:wrong@127.0.0.1:{srv.port}"))
    assert rc == 1 and "redis://:PASSWORD@" in failed(rows, "metadata")["fix"]
    assert "wrong" not in row(rows, "config", "metadata_server")["detail"]  # masked


def test_http_wrong_path(servers, tmp_path):
    srv = need(servers, "http")
    rc, rows = doctor("--config", write_cfg(
        tmp_path, metadata_server=f"http://127.0.0.1:{srv.port}/meta"))
    fix = failed(rows, "metadata")["fix"]
    assert rc == 1 and f"http://127.0.0.1:{srv.port}/metadata" in fix, fix


def test_metadata_host_unresolvable(tmp_path):
    rc, rows = doctor("--config", write_cfg(
        tmp_path, metadata_server="http://no-such-host.invalid:8080/metadata"))
    assert rc == 1 and "does not resolve" in failed(rows, "metadata")["fix"]


@pytest.mark.parametrize("kind", ["etcd", "http"])
def test_proxy_in_the_environment(servers, tmp_path, kind):
    """libcurl (the HTTP and etcd clients) sends through http_proxy, even to
    127.0.0.1; here the proxy is a port with nothing behind it."""
    srv = need(servers, kind)
    cfg = write_cfg(tmp_path, metadata_server=srv.url)
    proxy = {"http_proxy": f"http://127.0.0.1:{free_port()}", "no_proxy": ""}
    rc, rows = doctor("--config", cfg, env=proxy)
    fix = failed(rows, "metadata")["fix"]
    assert rc == 1 and "no_proxy" in fix and proxy["http_proxy"] in fix, fix
    rc, rows = doctor("--config", cfg, env={**proxy, "no_proxy": "localhost,127.0.0.1"})
    assert rc == 0 and row(rows, "metadata", status="ok")


# ------------------------------------------------------------ 9-12: engine address

@pytest.mark.parametrize("holder", ["127.0.0.1", "127.0.0.2"])
def test_engine_port_in_use(tmp_path, holder):
    """The engine listens on 0.0.0.0:port, so a listener on another local
    address (127.0.0.2) blocks it too; doctor binds the same way."""
    with socket.socket() as s:
        s.bind((holder, 0))
        s.listen(1)
        port = s.getsockname()[1]
        rc, rows = doctor("--config", write_cfg(tmp_path, prefill_url=f"127.0.0.1:{port}"))
    r = failed(rows, "engine", f"prefill port {port}")
    assert rc == 1 and f"sport = :{port}" in r["fix"] and "in use" in r["detail"].lower()


def test_tp_rank_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        rc, rows = doctor("--tp", "2", "--config",
                          write_cfg(tmp_path, prefill_url=f"127.0.0.1:{port - 1}"))
    assert rc == 1 and "TP ranks" in failed(rows, "engine", f"prefill port {port} (TP rank 1)")["fix"]


def test_tp_ranks_past_the_last_port(tmp_path):
    """prefill_url's port + --tp - 1 past 65535: one row naming it and the
    fix (was "the check itself failed: OverflowError", "report this")."""
    rc, rows = doctor("--tp", "1000", "--role", "prefill", "--config",
                      write_cfg(tmp_path, prefill_url="127.0.0.1:65000"))
    r = failed(rows, "engine", "prefill ports")
    assert rc == 1 and "past 65535" in r["detail"] and "at most 64536" in r["fix"], r
    assert not [x for x in rows if "the check itself failed" in x["detail"]], rows


@pytest.mark.parametrize("sizes", [("--tp", "2", "--dp", "2"),
                                   ("--data-parallel-size", "2", "-tp", "2")])  # vLLM's spelling
def test_data_parallel_engine_port_in_use(tmp_path, sizes):
    """vLLM data parallelism inside one server: engine k's ranks take the
    ports from prefill_url's + k x TP x PP.  Doctor names them (a row with
    the range and each engine's first port) and binds each; engine 1's TP
    rank 0 (base + 2 with TP 2) taken here fails, naming that engine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        rc, rows = doctor(*sizes, "--config",
                          write_cfg(tmp_path, prefill_url=f"127.0.0.1:{port - 2}"))
    r = failed(rows, "engine", f"prefill port {port} (DP engine 1, TP rank 0)")
    assert rc == 1 and "data-parallel engine k" in r["fix"] and f"sport = :{port}" in r["fix"]
    dp = row(rows, "engine", "prefill DP ports", "ok")
    assert f"ports {port - 2}-{port + 1}" in dp["detail"], dp
    assert f"engine 1 from {port}" in dp["detail"], dp
    assert [x["item"] for x in rows if x["item"].startswith("prefill port ")] == [
        f"prefill port {port - 2} (DP engine 0, TP rank 0)",
        f"prefill port {port - 1} (DP engine 0, TP rank 1)",
        f"prefill port {port} (DP engine 1, TP rank 0)",
        f"prefill port {port + 1} (DP engine 1, TP rank 1)"]


def test_data_parallel_ports_past_65535(tmp_path):
    rc, rows = doctor("--dp", "4", "--config", write_cfg(tmp_path, prefill_url="127.0.0.1:65534",
                                                          decode_url="127.0.0.1:65000"))
    r = failed(rows, "engine", "prefill DP ports")
    assert rc == 1 and "65534-65537" in r["detail"] and "at most 65532" in r["fix"]


def not_local(n):
    """n documentation addresses (RFC 5737) that are not on this host;
    nothing is ever sent to them."""
    from mooncake_connector.doctor import _local_addrs

    here = _local_addrs()
    out = [f"{net}.{i}" for net in ("198.51.100", "203.0.113", "192.0.2") for i in range(1, 9)
           if f"{net}.{i}" not in here]
    return out[:n]


def test_engine_address_not_on_this_host(tmp_path):
    a, b = not_local(2)
    rc, rows = doctor("--config", write_cfg(tmp_path, prefill_url=f"{a}:15000",
                                            decode_url=f"{b}:15000"))
    r = failed(rows, "engine", "address")
    assert rc == 1 and "addresses here" in r["fix"] and "127.0.0.1" not in r["fix"].split("(")[1]


def test_engine_loopback_with_remote_peer(tmp_path):
    rc, rows = doctor("--config", write_cfg(tmp_path, prefill_url=f"127.0.0.1:{free_port()}",
                                            decode_url=f"{not_local(1)[0]}:15000"))
    r = failed(rows, "engine", "prefill_url")
    assert rc == 1 and "loopback" in r["detail"] and "prefill_url" in r["fix"]


# ------------------------------------------------------------ 13-15: RDMA

def test_rdma_device_missing(tmp_path):
    rc, rows = doctor("--config", write_cfg(tmp_path, protocol="rdma", device_name="mlx5_9"))
    r = failed(rows, "rdma", "mlx5_9")
    assert rc == 1 and ("device_name" in r["fix"] or '"protocol": "tcp"' in r["fix"])


def _sysfs(tmp_path, state="4: ACTIVE", gids=("fe80:0000:0000:0000:0000:0000:0000:0001",)):
    """A sysfs-shaped tree for one RoCE device (no RDMA NIC on CI hosts)."""
    port = tmp_path / "sys" / "class" / "infiniband" / "rxe0" / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    (port / "gid_attrs" / "ndevs").mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "link_layer").write_text("Ethernet\n")
    for i in range(4):
        g = gids[i] if i < len(gids) else "0000:0000:0000:0000:0000:0000:0000:0000"
        (port / "gids" / str(i)).write_text(g + "\n")
        (port / "gid_attrs" / "types" / str(i)).write_text("RoCE v2\n")
        (port / "gid_attrs" / "ndevs" / str(i)).write_text("veth0\n")
    net = tmp_path / "sys" / "class" / "net" / "veth0"
    net.mkdir(parents=True)
    (net / "mtu").write_text("1500\n")
    return str(tmp_path / "sys")


@pytest.mark.parametrize("case", ["ok", "down", "no-gid", "bad-gid-index"])
def test_rdma_port_states(tmp_path, case):
    root = _sysfs(tmp_path, state="1: DOWN" if case == "down" else "4: ACTIVE",
                  gids=() if case == "no-gid" else ("fe80:0000:0000:0000:0000:0000:0000:0001",))
    env = {"MC_DOCTOR_SYSFS": root}
    if case == "bad-gid-index":
        env["MC_GID_INDEX"] = "3"
    rc, rows = doctor("--config", write_cfg(tmp_path, protocol="rdma", device_name="rxe0"), env=env)
    if case == "ok":
        assert "RoCE MTU 1024" in row(rows, "rdma", "rxe0 port 1", "ok")["detail"]
        return
    r = failed(rows, "rdma", "rxe0 port 1")
    assert rc == 1
    assert {"down": "not ACTIVE", "no-gid": "IP address", "bad-gid-index": "MC_GID_INDEX"}[case] \
        in r["fix"], r


# ------------------------------------------------------------ 16-17: vLLM

def test_vllm_outside_supported_range(tmp_path):
    # A real installed-distribution record of an old vLLM, first on the path.
    d = tmp_path / "site" / "vllm-0.20.0.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.20.0\n")
    rc, rows = doctor("--config", write_cfg(tmp_path), env={"PYTHONPATH": str(tmp_path / "site")})
    r = failed(rows, "vllm", "version")
    assert rc == 1 and "0.20.0" in r["detail"] and "pip install 'vllm>=0.26" in r["fix"], r


def test_vllm_plugin_filtered_out(tmp_path):
    rc, rows = doctor("--config", write_cfg(tmp_path), env={"VLLM_PLUGINS": "lora_filesystem"})
    assert rc == 1 and "VLLM_PLUGINS" in failed(rows, "vllm", "plugin")["fix"]


def test_vllm_version_in_range_and_plugin_registered(tmp_path):
    rc, rows = doctor("--config", write_cfg(tmp_path))
    assert row(rows, "vllm", "plugin", "ok")
    v = row(rows, "vllm", "version")
    assert v["status"] in ("ok", "skip"), v
    if v["status"] == "ok":  # vLLM < 0.34 (no KVCacheAccess): said so, not a failure
        assert row(rows, "vllm", "kv cache access")["status"] in ("ok", "skip")
    if v["status"] == "ok":  # no NVIDIA device on this host: the runner row says so
        m = row(rows, "vllm", "model runner")
        assert m["status"] == ("skip" if not os.path.exists("/dev/nvidiactl") else "ok"), m


@pytest.mark.parametrize("version,is_cuda,env,want", [
    ("0.34.0", True, {}, "V2, vLLM's only GPU runner"),
    ("0.34.0", True, {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "V2, vLLM's only GPU runner"),
    ("0.26.0", True, {}, "V2, vLLM's default"),
    ("0.32.0", True, {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "V2 (VLLM_USE_V2_MODEL_RUNNER=1)"),
    ("0.32.0", True, {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "V1"),
    ("0.34.0", False, {}, None),
])
def test_model_runner_row(version, is_cuda, env, want):
    """Which model runner a GPU server here runs: on the V2 runner the row
    says a consumer under "recompute" makes no in-step load (vLLM issue
    #49250) and names the fix; V1 and the CPU backend keep in-step loads."""
    from mooncake_connector.doctor import Report, check_model_runner
    rep = Report()
    check_model_runner(rep, version, is_cuda=is_cuda, environ=env)
    (r,) = rep.rows
    assert (r.check, r.item) == ("vllm", "model runner"), r
    if want is None:
        assert r.status == "skip" and "in-step loads stay on" in r.detail, r
    elif want == "V1":
        assert r.status == "ok" and r.detail.startswith("V1") and "stay on" in r.detail, r
    else:
        assert r.status == "ok" and r.detail.startswith(want), r
        assert "#49250" in r.detail and '"fail"' in r.detail and "background" in r.detail, r


# ------------------------------------------------------------ 18-19: peer

def test_peer_transfer_each_way(tmp_path):
    port = free_port()
    srv = subprocess.Popen([sys.executable, "-m", "mooncake_connector", "doctor", "--serve",
                            "--listen", f"127.0.0.1:{port}", "--seconds", "60"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        line = srv.stdout.readline()
        assert f"doctor --peer 127.0.0.1:{port}" in line, line + srv.stderr.read()
        rc, rows = doctor("--config", write_cfg(tmp_path), "--peer", f"127.0.0.1:{port}")
        for op in ("write", "read"):
            assert "GB/s" in row(rows, "peer", f"{op} 64 MiB", "ok")["detail"]
        assert row(rows, "peer", "data", "ok")
        assert rc == 0, rows
    finally:
        srv.terminate()
        srv.wait(10)


HOSTILE_SERVER = r"""
import sys, time
import mooncake_connector as mc
port, answer = sys.argv[1], open(sys.argv[2], "rb").read()
e = mc.TransferEngine()
e.initialize("127.0.0.1:" + port, "P2PHANDSHAKE", "tcp", "")
print("up", flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    for sender, msg in e.get_notifies():
        e.send_notify(sender, answer)
    time.sleep(0.01)
"""


@pytest.mark.parametrize("answer,said", [
    (b"{not json", "not JSON"),
    (b"[" * 100_000, "not JSON"),  # deeper than Python's stack: was RecursionError
    (b'{"addr": "4096", "size": 67108864}', "not a doctor's answer"),
    (b'{"addr": 4096}', "not a doctor's answer"),
    (b"\xff\xfe", "not JSON"),
], ids=["broken", "deep", "addr-string", "no-size", "not-utf8"])
def test_peer_that_answers_something_else_is_named(tmp_path, answer, said):
    """--peer at a program that answers the hello with something other
    than `doctor --serve`'s answer: a traceback (JSONDecodeError,
    RecursionError, KeyError, TypeError) or a write to whatever "addr"
    said.  Now the row says what came and the fix; nothing is written."""
    port = free_port()
    (tmp_path / "answer").write_bytes(answer)
    srv = subprocess.Popen([sys.executable, "-c", HOSTILE_SERVER, str(port),
                            str(tmp_path / "answer")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        assert srv.stdout.readline().strip() == "up", srv.stderr.read()
        rc, rows = doctor("--config", write_cfg(tmp_path), "--peer", f"127.0.0.1:{port}",
                          "--timeout", "3")
        r = failed(rows, "peer")
        assert rc == 1 and said in r["detail"] and "doctor --serve" in r["fix"], r
        assert not [x for x in rows if x["item"].endswith("64 MiB")], rows
    finally:
        srv.terminate()
        srv.wait(10)


def test_peer_not_serving(tmp_path):
    port = free_port()
    rc, rows = doctor("--config", write_cfg(tmp_path), "--peer", f"127.0.0.1:{port}",
                      "--timeout", "3")
    assert rc == 1 and "doctor --serve" in failed(rows, "peer")["fix"]


@pytest.mark.parametrize("port", ["0", "99999", "+80", "8_0"])
def test_peer_port_that_is_no_port_is_named(tmp_path, port):
    """--peer 127.0.0.1:0, :99999, :+80 or :8_0 started a local engine and
    failed the handshake ("segment ... is not host:port") with the fix
    "run doctor --serve --listen 127.0.0.1:0 ... and open TCP port 0".  Now
    the row says the port is not a number in 1..65535 (nothing started)."""
    rc, rows = doctor("--config", write_cfg(tmp_path), "--peer", f"127.0.0.1:{port}",
                      "--timeout", "2")
    r = failed(rows, "peer")
    assert rc == 1 and f"not HOST:PORT (port '{port}' is not a number in 1..65535)" in \
        r["detail"], r


def test_serve_at_an_address_of_another_host_is_warned_of():
    """doctor --serve --listen 192.0.2.1:PORT (TEST-NET-1: no host's
    address) served, telling peers to connect to a machine that is not
    this one, without a word.  Now a warning says so (and why it may be
    right: a NAT); serving goes on."""
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "mooncake_connector", "doctor", "--serve",
                        "--listen", f"192.0.2.1:{port}", "--seconds", "1"],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    assert f"warning: --listen 192.0.2.1:{port}: host \"192.0.2.1\" (192.0.2.1) is no " \
        "address of this host" in r.stderr, r.stderr
    assert "serving at 192.0.2.1" in r.stdout


def test_serve_port_taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "mooncake_connector", "doctor", "--serve",
                            "--listen", f"127.0.0.1:{port}", "--seconds", "5"],
                           capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 1 and f"cannot serve at 127.0.0.1:{port}" in r.stderr, r.stderr


# ------------------------------------------------------------ peer authentication

def test_auth_off_on_loopback_is_ok(tmp_path):
    rc, rows = doctor("--config", write_cfg(tmp_path))
    assert "off" in row(rows, "auth", "peer authentication", "ok")["detail"]


def test_auth_off_on_a_network_address_warns(tmp_path):
    addr = outward_addr()
    if not addr:
        pytest.skip("this host has no non-loopback IPv4 address")
    p, d = two_ports()
    rc, rows = doctor("--config", write_cfg(tmp_path, prefill_url=f"{addr}:{p}",
                                            decode_url=f"{addr}:{d}"))
    r = row(rows, "auth", "peer authentication", "warn")
    assert addr in r["detail"] and "auth_secret" in r["fix"], r


def test_auth_short_secret_warns_and_long_one_is_ok(tmp_path):
    rc, rows = doctor("--config", write_cfg(tmp_path, auth_secret="abc"))
    r = row(rows, "auth", "peer authentication", "warn")
    assert "3 bytes" in r["detail"] and "token_hex" in r["fix"], r
    rc, rows = doctor("--config", write_cfg(tmp_path, auth_secret="x" * 32))
    assert "32 bytes" in row(rows, "auth", "peer authentication", "ok")["detail"]
    rc, rows = doctor("--config", write_cfg(tmp_path), env={"MC_AUTH_SECRET": "y" * 20})
    assert "MC_AUTH_SECRET" in row(rows, "auth", "peer authentication", "ok")["detail"]


def test_auth_file_and_environment_differ(tmp_path):
    rc, rows = doctor("--config", write_cfg(tmp_path, auth_secret="a" * 20),
                      env={"MC_AUTH_SECRET": "b" * 20})
    r = row(rows, "auth", "MC_AUTH_SECRET", "warn")
    assert "ignored" in r["detail"], r


@pytest.mark.parametrize("serve_secret,mine,ok", [("s" * 20, "s" * 20, True),
                                                  ("s" * 20, "t" * 20, False),
                                                  ("s" * 20, None, False),
                                                  (None, "t" * 20, False)])
def test_peer_with_shared_secrets(tmp_path, serve_secret, mine, ok):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MC_AUTH_SECRET"}
    if serve_secret:
        env["MC_AUTH_SECRET"] = serve_secret
    srv = subprocess.Popen([sys.executable, "-m", "mooncake_connector", "doctor", "--serve",
                            "--listen", f"127.0.0.1:{port}", "--seconds", "60"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        line = srv.stdout.readline()
        assert f"doctor --peer 127.0.0.1:{port}" in line, line + srv.stderr.read()
        rc, rows = doctor("--config", write_cfg(tmp_path, auth_secret=mine), "--peer",
                          f"127.0.0.1:{port}", "--timeout", "5")
        if ok:
            assert rc == 0 and row(rows, "peer", "data", "ok"), rows
        else:
            r = failed(rows, "peer")
            assert "auth_secret" in r["fix"] and "same" in r["fix"], r
    finally:
        srv.terminate()
        srv.wait(10)


def test_metadata_server_token(tmp_path):
    import time
    import urllib.request
    port = free_port()
    env = dict(os.environ, MC_METADATA_TOKEN="tok-" + "z" * 20)
    srv = subprocess.Popen([sys.executable, "-m", "mooncake_connector.metadata_server", "--host",
                            "127.0.0.1", "--port", str(port), "--log-level", "warning"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/")
    try:
        end = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                break
            except urllib.error.HTTPError:
                break  # answering (health may want the token too)
            except OSError:
                assert time.monotonic() < end and srv.poll() is None, srv.stderr.read()
                time.sleep(0.1)
        cfg = write_cfg(tmp_path, metadata_server=f"http://127.0.0.1:{port}/metadata")
        rc, rows = doctor("--config", cfg)
        assert rc == 1 and "MC_METADATA_TOKEN" in failed(rows, "metadata")["fix"], rows
        rc, rows = doctor("--config", cfg, env={"MC_METADATA_TOKEN": "wrong-" + "z" * 20})
        assert rc == 1 and "MC_METADATA_TOKEN" in failed(rows, "metadata")["fix"], rows
        rc, rows = doctor("--config", cfg, env={"MC_METADATA_TOKEN": "tok-" + "z" * 20})
        assert row(rows, "metadata", None, "ok"), rows
    finally:
        srv.terminate()
        srv.wait(10)
# ------------------------------------------------------------ the same-host CPU path

def test_same_host_cpu_path_row(tmp_path):
    """A real process_vm_readv from another process (this host allows it: the
    engine tests on same-host-cpu run here); each off switch says which."""
    env = {"MC_SAME_HOST_CPU": "1"}
    rc, rows = doctor("--config", write_cfg(tmp_path), env=env)
    assert "cross-memory attach works" in row(rows, "same-host", "cpu", "ok")["detail"]
    rc, rows = doctor("--config", write_cfg(tmp_path), env={"MC_SAME_HOST_CPU": "0"})
    assert "MC_SAME_HOST_CPU=0" in row(rows, "same-host", "cpu", "skip")["detail"]
    rc, rows = doctor("--config", write_cfg(tmp_path, same_host_cpu=False), env=env)
    assert '"same_host_cpu": false' in row(rows, "same-host", "cpu", "skip")["detail"]


def test_same_host_cpu_switch_spellings(tmp_path):
    """The doctor reads MC_SAME_HOST_CPU as the engine does: "No" is off,
    a value that is neither on nor off is a warn row naming it (the engine
    warns and keeps the path on)."""
    rc, rows = doctor("--config", write_cfg(tmp_path), env={"MC_SAME_HOST_CPU": "No"})
    assert "MC_SAME_HOST_CPU=No" in row(rows, "same-host", "cpu", "skip")["detail"]
    rc, rows = doctor("--config", write_cfg(tmp_path), env={"MC_SAME_HOST_CPU": "maybe"})
    assert "'maybe'" in row(rows, "same-host", "switch", "warn")["detail"]


def test_serve_without_listen_takes_a_free_port():
    """`doctor --serve` with neither --listen nor a config: this host's
    address and a free port (it asked the engine for "host:0", which the
    engine refuses as a name: the documented default always failed)."""
    e = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"}
    r = subprocess.run([sys.executable, "-m", "mooncake_connector", "doctor", "--serve",
                        "--seconds", "0.5"], capture_output=True, text=True, env=e, timeout=60,
                       cwd="/")
    assert r.returncode == 0, r.stderr
    assert re.search(r"doctor serving at \S+:\d+ .*doctor --peer \S+:[1-9]\d*", r.stdout), r.stdout


@pytest.mark.parametrize("args,expect", [
    (["--timeout", "-1"], "--timeout must be a number of seconds in (0, 86400]"),
    (["--timeout", "nan"], "--timeout must be a number of seconds in (0, 86400]"),
    # was "the check itself failed: ValueError", "fix: report this"
    (["--peer", "127.0.0.1:1", "--timeout", "1e308"],
     "--timeout must be a number of seconds in (0, 86400], not 1e+308"),
    # was 65,535 ports bound one by one, a row each, then an OverflowError
    (["--tp", "100000"], "--tp x --pp x --dp must be at most 1024 (one port each), not 100000"),
    (["--tp", "64", "--dp", "32"], "--tp x --pp x --dp must be at most 1024"),
    (["--tp", "0"], "--tp must be >= 1"),
    (["--dp", "0"], "--dp must be >= 1"),
    (["--serve", "--seconds", "-1"], "--seconds must be a number of seconds >= 0"),
    (["--serve", "--seconds", "nan"], "--seconds must be a number of seconds >= 0"),
])
def test_bad_numbers_are_refused(args, expect):
    r = subprocess.run([sys.executable, "-m", "mooncake_connector", "doctor", *args],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 2 and expect in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("listen", ["no-such-host.invalid:17000", "no-such-host.invalid",
                                    "[no-such-host.invalid]:17000"])
def test_serve_listen_host_that_does_not_resolve(listen):
    """The engine listens on 0.0.0.0 and advertises the name as given: an
    unresolvable --listen "served" (exit 0) where no peer could reach it."""
    r = subprocess.run([sys.executable, "-m", "mooncake_connector", "doctor", "--serve",
                        "--listen", listen, "--seconds", "0.5"],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stdout, r.stderr)
    line, = r.stderr.strip().splitlines()
    assert f"--listen {listen}" in line and "does not resolve" in line, line
    assert "give an address of this host" in line and "/etc/hosts" in line, line


def test_serve_listen_ipv6_without_brackets_is_the_engines_message():
    r = subprocess.run([sys.executable, "-m", "mooncake_connector", "doctor", "--serve",
                        "--listen", "fe80::1", "--seconds", "0.5"],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 1 and "does not resolve" not in r.stderr, r.stderr
    assert "write IPv6 as" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_peer_host_that_does_not_resolve(tmp_path):
    """Was 'the check itself failed: gaierror(...)', fix 'report this'."""
    rc, rows = doctor("--config", write_cfg(tmp_path), "--peer", "no-such-host.invalid:17000")
    r = failed(rows, "peer")
    assert rc == 1 and "does not resolve" in r["detail"] and "--peer" in r["fix"], r


PLUGIN_STATE = ("from mooncake_connector.connector import plugin; plugin.register(); "
                "from vllm.distributed.kv_transfer.kv_connector.factory import "
                "KVConnectorFactory as F; "
                "print(bool(getattr(F.get_connector_class, '_mooncake', False)))")
DISABLE_VALUES = [("false", True), ("no", True), ("off", True), ("0", True), ("1", False),
                  ("true", False), ("maybe", False)]


@pytest.fixture(scope="module")
def plugin_states(plugin_forks):
    """{value: PLUGIN_STATE's run with MOONCAKE_CONNECTOR_DISABLE_PLUGIN=value}:
    each run a process of its own that registers the plugin afresh, forked
    from one Python that imported vLLM's factory once (conftest.plugin_forks,
    shared with test_connector_vllm's plugin checks; importing vLLM is ~13 s
    here, the rest milliseconds), not one Python per value."""
    return {v: plugin_forks.run(PLUGIN_STATE, cwd="/", timeout=300,
                                env={**os.environ, "MOONCAKE_CONNECTOR_DISABLE_PLUGIN": v})
            for v, _ in DISABLE_VALUES}


@pytest.mark.parametrize("value,on", DISABLE_VALUES)
def test_disable_plugin_variable_is_read_one_way_by_plugin_and_doctor(tmp_path, value, on,
                                                                      plugin_states):
    """MOONCAKE_CONNECTOR_DISABLE_PLUGIN: the plugin took any value but "" and
    "0" as on, so =false / =no turned it off, while the doctor checked for
    "1" only and reported the plugin registered.  Now false/no/off/0 leave
    it on, 1/true/yes/on turn it off, both read it alike, and a value that
    is neither is named (and taken as on, as before)."""
    r = plugin_states[value]
    assert r.returncode == 0 and r.stdout.strip(), (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.strip().splitlines()[-1] == str(on), (r.stdout, r.stderr[-2000:])
    rc, rows = doctor("--config", write_cfg(tmp_path),
                      env={"MOONCAKE_CONNECTOR_DISABLE_PLUGIN": value}, timeout=300)
    status = row(rows, "vllm", "plugin")["status"]
    assert status == ("ok" if on else "warn"), rows
    if value == "maybe":
        assert "'maybe'" in row(rows, "vllm", "plugin")["detail"]
        assert "'maybe'" in r.stderr, r.stderr[-2000:]


def test_serve_listen_example_is_an_address_this_host_has():
    """--listen's example in the "does not resolve" message: a routable
    IPv4 address, else a routable IPv6 one in brackets (was: 127.0.0.1
    on an IPv6-only host, which has no such address), never link-local."""
    from mooncake_connector.doctor import runner
    ex = runner._example_addr
    assert ex({"127.0.0.1": "lo", "::1": "lo", "10.1.2.3": "eth0"}) == "10.1.2.3"
    assert ex({"::1": "lo", "fe80::5": "eth0", "2001:db8::7": "eth0"}) == "2001:db8::7"
    assert ex({"::1": "lo", "fe80::5": "eth0"}) == "::1"
    assert ex({"127.0.0.1": "lo", "::1": "lo"}) == "127.0.0.1"
    assert ex({}) == "127.0.0.1"
    assert runner._hp(ex({"::1": "lo"}), 17000) == "[::1]:17000"
