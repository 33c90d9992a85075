"""The producer's bootstrap server (vLLM's in-tree MooncakeConnector contract,
connector/bootstrap.py) and its settings; the consumer's reading of in-tree
kv_transfer_params.  No vLLM needed: fast unit tests.  The router in front
of real servers is tests/test_router_mooncake.py."""
import http.client
import json
import logging
import socket
import types

import pytest

from mooncake_connector.connector import bootstrap
from mooncake_connector.connector import settings as settings_mod
from mooncake_connector.connector.settings import SettingsError, shift_port
from mooncake_connector.serving import free_port
from mooncake_connector.hostport import join_hostport
from conftest import drip_header, has_ipv6_loopback


def _cfg(**extra):
    return types.SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config=dict(
        {"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103"}, **extra))


def _req(port, method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def _start(settings, tp=2, pp=1, dp=0, base="127.0.0.1:13003", env=None):
    return bootstrap.start(settings, shift_port(base, 0), dp, tp, pp,
                           lambda t, p: shift_port(base, p * tp + t), env or {})


def test_query_answers_in_the_in_tree_shape():
    s = settings_mod.resolve(_cfg(bootstrap_port=free_port(), bootstrap_host="127.0.0.1"))
    srv = _start(s, tp=2, pp=2)
    try:
        status, body = _req(srv.port, "GET", "/query")
        assert status == 200
        got = json.loads(body)
        # One DP rank; every TP rank of every PP stage named (port + pp * tp + tp_rank).
        assert got == {"0": {"engine_id": "127.0.0.1:13003", "worker_addr": {
            "0": {"0": "127.0.0.1:13003", "1": "127.0.0.1:13005"},
            "1": {"0": "127.0.0.1:13004", "1": "127.0.0.1:13006"}}}}
        # What vllm-router reads: every key a DP rank, each with a string engine_id.
        assert all(k.isdigit() and isinstance(v["engine_id"], str) for k, v in got.items())
        assert _req(srv.port, "GET", "/health")[0] == 200
    finally:
        srv.close()


def test_read_only_and_unknown_paths_are_refused_with_a_reason():
    s = settings_mod.resolve(_cfg(bootstrap_port=free_port(), bootstrap_host="127.0.0.1"))
    srv = _start(s, dp=3)
    try:
        reg = json.dumps({"engine_id": "evil", "dp_rank": 3, "tp_rank": 0, "pp_rank": 0,
                          "addr": "10.0.0.9:1"})
        status, body = _req(srv.port, "POST", "/register", reg,
                            {"Content-Type": "application/json"})
        assert status == 403 and b"read-only" in body
        assert _req(srv.port, "GET", "/nope")[0] == 404
        assert _req(srv.port, "PUT", "/query", b"{}")[0] == 405
        # A bogus Content-Length and an oversized body do not hurt it.
        assert _req(srv.port, "POST", "/x", b"a" * 200000)[0] == 405
        assert _req(srv.port, "POST", "/register", b"",
                    {"Content-Length": "nonsense"})[0] == 403
        # The table is what the producer put there, still (dp rank 3 only).
        assert json.loads(_req(srv.port, "GET", "/query")[1])["3"]["engine_id"] == \
            "127.0.0.1:13003"
    finally:
        srv.close()


def test_a_silent_client_does_not_block_the_others():
    s = settings_mod.resolve(_cfg(bootstrap_port=free_port(), bootstrap_host="127.0.0.1"))
    srv = _start(s)
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(20)]
    try:
        assert _req(srv.port, "GET", "/query")[0] == 200
    finally:
        for c in idle:
            c.close()
        srv.close()


def test_port_settings():
    assert settings_mod.resolve(_cfg()).bootstrap_port is None  # the default
    assert bootstrap.default_port({}) == 8998
    assert bootstrap.default_port({"VLLM_MOONCAKE_BOOTSTRAP_PORT": "9123"}) == 9123
    with pytest.raises(ValueError, match="VLLM_MOONCAKE_BOOTSTRAP_PORT"):
        bootstrap.default_port({"VLLM_MOONCAKE_BOOTSTRAP_PORT": "x"})
    for bad in (-1, 70000, "8998", True, 1.5):
        with pytest.raises(SettingsError, match="bootstrap_port"):
            settings_mod.resolve(_cfg(bootstrap_port=bad))
    # 0: no server at all.
    assert _start(settings_mod.resolve(_cfg(bootstrap_port=0))) is None
    assert _start(settings_mod.resolve(_cfg()), env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "0"}) is None


def test_a_taken_port_is_an_error_only_when_asked_for(caplog):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        asked = settings_mod.resolve(_cfg(bootstrap_port=port, bootstrap_host="127.0.0.1"))
        with pytest.raises(SettingsError, match=f"127.0.0.1:{port}.*bootstrap_port"):
            _start(asked)
        # The default port taken (another producer on this host serves it): a warning.
        default = settings_mod.resolve(_cfg(bootstrap_host="127.0.0.1"))
        with caplog.at_level("WARNING", logger="vllm.mooncake_connector"):
            assert _start(default, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port)}) is None
        assert any("bootstrap_port" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
@pytest.mark.parametrize("held_on", ["127.0.0.1", "0.0.0.0"])
def test_the_default_address_on_a_port_taken_on_ipv4_only_warns_unless_asked_for(caplog,
                                                                                 held_on):
    """No bootstrap_host (the server on "::", IPv4 clients too) and the port
    held on IPv4 only by another server: the default port is one WARNING
    naming bootstrap_port and no server, as with 0.0.0.0 before; the port
    set explicitly is a start-up error naming it."""
    with socket.socket() as holder:
        holder.bind((held_on, 0))
        holder.listen()
        port = holder.getsockname()[1]
        with caplog.at_level("WARNING", logger="vllm.mooncake_connector"):
            assert _start(settings_mod.resolve(_cfg()),
                          env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port)}) is None
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(f"cannot listen on [::]:{port}" in m and "bootstrap_port" in m
                   for m in said), said
        with pytest.raises(SettingsError, match="choose another .*bootstrap_port"):
            _start(settings_mod.resolve(_cfg(bootstrap_port=port)))


@pytest.mark.parametrize("host, why", [("not-a-host.invalid", "Name or service not known"),
                                       ("192.0.2.77", "Cannot assign requested address")])
def test_a_bootstrap_host_not_of_this_host_is_an_error(host, why):
    """bootstrap_host set to an address this host does not have (or no
    address at all): a start-up error naming the setting (was: one WARNING
    and no bootstrap server, whatever the default port)."""
    s = settings_mod.resolve(_cfg(bootstrap_host=host))
    with pytest.raises(SettingsError, match="bootstrap_host .* must be an address of this host") \
            as e:
        _start(s, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())})
    assert why in str(e.value)


def _consumer(**extra):
    from mooncake_connector.connector.scheduler import SchedulerSide
    cfg = types.SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config=dict(
        {"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103", "flow_a": False},
        **extra))
    return SchedulerSide(settings_mod.resolve(cfg), 32, 1, lambda: None, block_bytes=32768)


def _request(params, n=100):
    return types.SimpleNamespace(request_id="r1", prompt_token_ids=list(range(n)),
                                 kv_transfer_params=params)


def test_consumer_takes_in_tree_params_from_our_bootstrap_server():
    """vllm-router's decode leg: no num_tokens, remote_engine_id from /query."""
    sch = _consumer()
    req = _request({"do_remote_decode": False, "do_remote_prefill": True,
                    "transfer_id": "xfer-1", "remote_bootstrap_addr": "http://127.0.0.1:8998",
                    "remote_engine_id": "127.0.0.1:13003"})
    # Size not known before the load: all full blocks, loaded in the background.
    assert sch.get_num_new_matched_tokens(req, 0) == (96, True)


def test_consumer_refuses_an_in_tree_engine_id_by_name():
    sch = _consumer()
    req = _request({"do_remote_prefill": True, "transfer_id": "xfer-1",
                    "remote_bootstrap_addr": "http://10.0.0.1:8998",
                    "remote_engine_id": "6f1d3c0e-uuid-of-an-in-tree-engine"})
    assert sch.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sch.stats.data["recompute_producer_unreachable"] == 1
    # Asked again (next step): still computed, counted once.
    assert sch.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sch.stats.data["recompute_producer_unreachable"] == 1


def test_consumer_takes_a_bracketed_ipv6_engine_and_names_an_unbracketed_one(caplog):
    """A third-party router's remote_engine_id "[::1]:13003" is loaded from;
    "::1:13003" (brackets left out) is not taken for host "::1" port 13003
    (the engine refuses that name: the load then failed unclearly): the
    prompt is computed, counted once, and the log says to bracket it."""
    sch = _consumer()
    req = _request({"do_remote_prefill": True, "transfer_id": "xfer-1",
                    "remote_bootstrap_addr": "http://[::1]:8998",
                    "remote_engine_id": "[::1]:13003"})
    assert sch.get_num_new_matched_tokens(req, 0) == (96, True)
    sch = _consumer()
    req = _request({"do_remote_prefill": True, "transfer_id": "xfer-2",
                    "remote_bootstrap_addr": "http://[::1]:8998",
                    "remote_engine_id": "::1:13003"})
    with caplog.at_level(logging.WARNING):
        assert sch.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sch.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sch.stats.data["recompute_producer_unreachable"] == 1
    assert "an IPv6 address without brackets (write [::1]:13003)" in caplog.text


def test_engine_name_problem():
    from mooncake_connector.hostport import engine_name_problem, is_engine_name
    for ok in ("127.0.0.1:13003", "host-a:1", "[::1]:65535", "[fe80::1%lo]:5"):
        assert engine_name_problem(ok) is None, ok
    for bad, says in (("::1:13003", "without brackets (write [::1]:13003)"),
                      ("fe80::1:80", "without brackets"),
                      ("[::1:13003", "unbalanced brackets"), ("::1]:13003", "without brackets"),
                      ("a]:1", "unbalanced brackets"), ("[]:1", "unbalanced brackets"),
                      ("[[::1]]:1", "unbalanced brackets"),
                      ("h:0", "is not 1-65535"), ("h:65536", "is not 1-65535"),
                      ("h:\u0661", "is not 1-65535"), (":80", "no host:port"),
                      ("nocolon", "no host:port"), (None, "not a string"),
                      (13003, "not a string")):
        got = engine_name_problem(bad)
        assert got is not None and says in got, (bad, got)
        assert not is_engine_name(bad)


def test_the_producer_worker_of_tp0_pp0_serves_it_naming_every_rank():
    from mooncake_connector.connector.worker import WorkerSide
    port = free_port()
    made = []
    try:
        for role, tp_rank, pp_rank in (("kv_producer", 0, 0), ("kv_producer", 1, 0),
                                       ("kv_producer", 0, 1), ("kv_consumer", 0, 0)):
            cfg = _cfg(bootstrap_port=port, bootstrap_host="127.0.0.1")
            cfg.kv_role = role
            w = WorkerSide(settings_mod.resolve(cfg), 32, tp_rank, 2, facts={"pp_size": 2},
                           pp_rank=pp_rank, dp_rank=1)
            w._base = "127.0.0.1:13003"
            w._start_bootstrap()
            made.append(w)
        assert [w.bootstrap is not None for w in made] == [True, False, False, False]
        got = json.loads(_req(port, "GET", "/query")[1])
        assert got == {"1": {"engine_id": "127.0.0.1:13003", "worker_addr": {
            "0": {"0": "127.0.0.1:13003", "1": "127.0.0.1:13005"},
            "1": {"0": "127.0.0.1:13004", "1": "127.0.0.1:13006"}}}}
    finally:
        for w in made:
            if w.bootstrap is not None:
                w.bootstrap.close()
    with pytest.raises(OSError):  # closed: nothing listens any more
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_dripping_client_is_closed_at_the_request_deadline(monkeypatch):
    """The server runs inside the prefill's vLLM process, on 0.0.0.0.  Its
    socket timeout (10 s) is per read: a client dripping its header a byte
    at a time held its connection and its thread forever.  Now a request
    must arrive whole within REQUEST_DEADLINE_S of the connection (or of
    the previous request on it)."""
    monkeypatch.setattr(bootstrap, "REQUEST_DEADLINE_S", 2.0, raising=False)
    s = settings_mod.resolve(_cfg(bootstrap_port=free_port(), bootstrap_host="127.0.0.1"))
    srv = _start(s)
    try:
        # a request line, then a header value one byte every 0.2 s, never its end
        took = drip_header(srv.port, b"GET /query HTTP/1.1\r\nHost: x\r\nX-Slow: ", 12,
                           drip=b"a", every=0.2)
        assert took is not None and 1.5 < took < 6, took
        assert _req(srv.port, "GET", "/query")[0] == 200
        # A keep-alive client's requests each get the deadline afresh.
        import time
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        for _ in range(3):
            c.request("GET", "/health")
            assert c.getresponse().read()
            time.sleep(1.0)
        c.close()
    finally:
        srv.close()


def test_a_dripped_post_body_is_closed_at_the_request_deadline(monkeypatch):
    """The server reads a POST's body (up to 64 KiB of its Content-Length)
    with the socket's per-read timeout: a body dripped a byte per second
    is still cut at REQUEST_DEADLINE_S, which covers the whole request
    (checked: no change was needed)."""
    import socket
    import time
    monkeypatch.setattr(bootstrap, "REQUEST_DEADLINE_S", 2.0)
    s = settings_mod.resolve(_cfg(bootstrap_port=free_port(), bootstrap_host="127.0.0.1"))
    srv = _start(s)
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as c:
            c.sendall(b"POST /register HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n")
            c.settimeout(0.5)
            t0 = time.monotonic()
            took = None
            while time.monotonic() - t0 < 12:
                try:
                    if c.recv(100) == b"":
                        took = time.monotonic() - t0
                        break
                except socket.timeout:
                    try:
                        c.sendall(b"x")
                    except OSError:
                        took = time.monotonic() - t0
                        break
                except ConnectionResetError:
                    took = time.monotonic() - t0
                    break
        assert took is not None and took < 6, took
        assert _req(srv.port, "GET", "/query")[0] == 200
    finally:
        srv.close()


def test_connections_are_bounded_and_a_flood_does_not_keep_clients_out(monkeypatch):
    """Each connection is a thread of the vLLM process: a client opening
    thousands of idle connections made thousands of threads.  At most
    MAX_CONNECTIONS are served at once; a new one beyond that closes the
    oldest (a flood of idle sockets cannot keep a router's /query out)."""
    import threading
    import time
    monkeypatch.setattr(bootstrap, "MAX_CONNECTIONS", 8, raising=False)
    s = settings_mod.resolve(_cfg(bootstrap_port=free_port(), bootstrap_host="127.0.0.1"))
    srv = _start(s)
    base = threading.active_count()
    idle = []
    try:
        for _ in range(60):
            idle.append(socket.create_connection(("127.0.0.1", srv.port)))
            idle[-1].sendall(b"GET /query HTTP/1.1\r\n")
        time.sleep(0.5)
        assert threading.active_count() - base <= 8 + 2, threading.active_count() - base
        assert _req(srv.port, "GET", "/query")[0] == 200
        assert srv.evicted >= 50, srv.evicted
    finally:
        for c in idle:
            c.close()
        srv.close()


def test_clients_that_leave_early_print_no_traceback(capfd, monkeypatch):
    """socketserver's default handle_error prints a traceback to stderr (the
    prefill vLLM's log) for each request whose client left before its
    answer (BrokenPipeError, ConnectionResetError): a client could fill the
    log at will.  Now a client that left is a debug line, and connections
    the server closes itself (over MAX_CONNECTIONS, past the deadline) are
    quiet too."""
    import struct
    import time
    monkeypatch.setattr(bootstrap, "MAX_CONNECTIONS", 4, raising=False)
    s = settings_mod.resolve(_cfg(bootstrap_port=free_port(), bootstrap_host="127.0.0.1"))
    srv = _start(s)
    try:
        for _ in range(30):
            c = socket.create_connection(("127.0.0.1", srv.port))
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.sendall(b"GET /query HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
            c.close()  # a reset: the server's answer finds no one
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(12)]
        for c in idle:
            c.sendall(b"GET /query HTTP/1.1\r\n")
        time.sleep(1.0)
        for c in idle:
            c.close()
        assert _req(srv.port, "GET", "/query")[0] == 200
    finally:
        srv.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err[-2000:]


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_bootstrap_host_listens_and_names_ipv6_engines(host):
    """bootstrap_host "::1" (or "[::1]"): the server listens on IPv6 (was:
    socket.gaierror from an AF_INET socket, a WARNING and no server) and its
    url brackets the address; an IPv6 engine's names keep their brackets."""
    s = settings_mod.resolve(_cfg(bootstrap_port=free_port(), bootstrap_host=host))
    srv = _start(s, tp=2, base="[::1]:13003")
    try:
        assert srv is not None and srv.url == f"http://[::1]:{srv.port}"
        c = http.client.HTTPConnection("::1", srv.port, timeout=5)
        try:
            c.request("GET", "/query")
            r = c.getresponse()
            got = json.loads(r.read())
        finally:
            c.close()
        assert r.status == 200
        assert got == {"0": {"engine_id": "[::1]:13003", "worker_addr": {
            "0": {"0": "[::1]:13003"}, "1": {"0": "[::1]:13004"}}}}
    finally:
        srv.close()


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
def test_the_default_host_serves_ipv4_and_ipv6_clients():
    """No bootstrap_host: one socket on "::" that takes IPv4 clients too
    (was: 0.0.0.0, so a router on an IPv6-only network could not reach it)."""
    s = settings_mod.resolve(_cfg(bootstrap_port=free_port()))
    srv = _start(s, tp=1)
    try:
        assert srv.host == "::" and srv.url == f"http://127.0.0.1:{srv.port}"
        for addr in ("127.0.0.1", "::1"):
            c = http.client.HTTPConnection(addr, srv.port, timeout=5)
            try:
                c.request("GET", "/query")
                r = c.getresponse()
                assert r.status == 200 and json.loads(r.read())["0"]["engine_id"] == \
                    "127.0.0.1:13003", addr
            finally:
                c.close()
    finally:
        srv.close()


def test_join_hostport_brackets_ipv6_only():
    assert join_hostport("::1", 13003) == "[::1]:13003"
    assert join_hostport("[fd00::1]", 5) == "[fd00::1]:5"
    assert join_hostport("10.0.0.1", 13003) == "10.0.0.1:13003"
    assert join_hostport("node-1.example", 80) == "node-1.example:80"
    assert shift_port(join_hostport("::1", 13003), 2) == "[::1]:13005"


def test_an_ipv6_producers_flow_b_answer_names_a_bare_remote_host():
    """A producer whose engine is "[::1]:13003": its flow-b answer's
    remote_host is "::1", bare as vLLM's own connectors send it (a consumer
    brackets it to connect; was "[::1]", which such a consumer bracketed
    again); remote_engine_id keeps the engine's name, and a consumer given
    only remote_host / remote_port finds that same engine."""
    from mooncake_connector.connector.scheduler import SchedulerSide
    cfg = types.SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config={
        "prefill_url": "[::1]:13003", "decode_url": "[::1]:13103", "bootstrap_port": 0})
    sch = SchedulerSide(settings_mod.resolve(cfg), 32, 1, lambda: None, block_bytes=32768)
    _, out = sch.request_finished(_request({"do_remote_decode": True}), [[0, 1, 2]])
    assert (out["remote_host"], out["remote_port"], out["remote_engine_id"]) == \
        ("::1", 13003, "[::1]:13003")
    params = {k: out[k] for k in ("do_remote_prefill", "remote_host", "remote_port")}
    cons = _consumer(prefill_url="[::1]:13003", decode_url="[::1]:13103")
    assert cons._source(_request(params)) == ("B", "[::1]:13003")


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
def test_the_bootstrap_servers_address_is_logged_in_brackets(caplog):
    """The default address "::": logged as [::]:port (was ":::port")."""
    port = free_port()
    s = settings_mod.resolve(_cfg(bootstrap_port=port))
    with caplog.at_level(logging.INFO, logger="vllm.mooncake_connector"):
        srv = _start(s, tp=1)
    try:
        assert srv.host == "::"
        said = [r.getMessage() for r in caplog.records if "bootstrap server on" in r.getMessage()]
        assert said and f"bootstrap server on [::]:{port} " in said[0], said
    finally:
        srv.close()


_NS_CHILD = r"""
import http.client, json, sys, types
from mooncake_connector.connector import bootstrap, settings
host, client = sys.argv[1:]
cfg = types.SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config={
    "prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103",
    "bootstrap_port": 8998, "bootstrap_host": host})
base = "127.0.0.1:13003"
try:
    srv = bootstrap.start(settings.resolve(cfg), base, 0, 1, 1, lambda t, p: base, {})
except settings.SettingsError as e:
    sys.exit(f"SettingsError: {e}")
c = http.client.HTTPConnection(client, 8998, timeout=5)
c.request("GET", "/query")
print(json.dumps([srv.host, c.getresponse().status]))
srv.close()
"""


def _in_own_namespaces(tmp_path, host, client):
    """The bootstrap server given bootstrap_host `host`, asked GET /query at
    `client`, in a network namespace of its own (lo up, with fe80::1 on it
    too) and a mount namespace whose /etc/hosts says mc-v6-only-name is
    ::1: [server host, HTTP status]."""
    import subprocess
    import sys
    import shutil
    if not (shutil.which("unshare") and shutil.which("ip")):
        pytest.skip("no unshare or ip command here")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n::1 mc-v6-only-name\n")
    setup = (f"ip link set lo up && ip -6 addr add fe80::1/64 dev lo nodad && "
             f"mount --bind {hosts} /etc/hosts")
    probe = subprocess.run(["unshare", "-m", "-n", "sh", "-c",
                            f"{setup} && getent ahosts mc-v6-only-name"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0 or "::1" not in probe.stdout:
        pytest.skip(f"no network and mount namespace of the test's own here (unshare -m -n: "
                    f"{probe.stderr.strip()!r})")
    r = subprocess.run(["unshare", "-m", "-n", "sh", "-c", f'{setup} && exec "$0" -P -c "$@"',
                        sys.executable, _NS_CHILD, host, client],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_bootstrap_host_name_with_only_ipv6_addresses_listens_there(tmp_path):
    """bootstrap_host a host name that resolves to IPv6 addresses only (here
    "mc-v6-only-name" -> ::1 in the test's own /etc/hosts): the server
    listens on its IPv6 address.  Was an AF_INET socket: here glibc gave it
    ::1 as 127.0.0.1, so IPv6 clients were refused (seen); a name with a
    non-loopback IPv6 address only did not resolve at all: a start-up error
    calling it no address of this host."""
    assert _in_own_namespaces(tmp_path, "mc-v6-only-name", "::1") == ["mc-v6-only-name", 200]


@pytest.mark.parametrize("host", ["fe80::1%lo", "[fe80::1%lo]"])
def test_a_link_local_bootstrap_host_with_its_zone_listens_there(tmp_path, host):
    """bootstrap_host "fe80::1%lo" (a link-local address and its interface):
    the server listens there (was: a start-up error, "Invalid argument ...
    must be an address of this host": bound as (host, port), Python drops
    the zone)."""
    assert _in_own_namespaces(tmp_path, host, "fe80::1%lo") == ["fe80::1%lo", 200]


@pytest.mark.parametrize("host, hint", [
    ("fe80::1", "a link-local address needs its interface after a %, e.g. fe80::1%eth0"),
    ("[::1]:8998", "it has a port: give the address alone, the port as bootstrap_port"),
    ("127.0.0.1:8998", "it has a port: give the address alone, the port as bootstrap_port"),
    ("[::1", "unbalanced brackets (IPv6 as ::1 or [::1])"),
    ("::1]", "unbalanced brackets"),
    ("1:2:3", "not an IPv6 address"),
    ("not a host", "it has spaces or control characters"),
    ("a\x00b", "it has spaces or control characters"),
    ("\ud800", "not UTF-8 text (a lone surrogate)")])
def test_a_bootstrap_host_of_a_wrong_form_says_what_is_wrong(host, hint):
    """A link-local address without its interface, an address with a port,
    brackets, a NUL or a lone surrogate: the settings are refused where they
    are read (vLLM's start and `mooncake-connector config
    --kv-transfer-config` alike), the message naming the setting and what
    is wrong (were: errors of the bind at the bootstrap server's start only,
    "must be an address of this host"; a NUL or a lone surrogate were a
    TypeError crash before that)."""
    with pytest.raises(SettingsError) as e:
        settings_mod.resolve(_cfg(bootstrap_host=host))
    assert "kv_connector_extra_config.bootstrap_host" in str(e.value), str(e.value)
    assert hint in str(e.value), str(e.value)


def test_the_proxys_reading_of_a_bootstrap_table_refuses_hostile_answers():
    """proxy_engines.parse_table reads a /query answer from another server
    (outside bytes, at most TABLE_MAX): every malformed one is a ValueError
    naming what is wrong, which the proxy's lookup logs and survives (a
    nesting deeper than Python's stack was a RecursionError that escaped
    the lookup); a good table parses in rank order, IPv6 engines in
    brackets only."""
    from mooncake_connector.proxy_engines import TABLE_MAX, parse_table
    deep = b"[" * (TABLE_MAX // 2) + b"]" * (TABLE_MAX // 2)
    for body, says in ((deep, "nested too deep"), (b"\xff", "utf-8"), (b"[]", "non-empty"),
                       (b"{}", "non-empty"), (b'{"0": 5}', "not a string"),
                       (b'{"x": {"engine_id": "a:1"}}', "not a rank number"),
                       (b'{"0": {"engine_id": "::1:13003"}}', "write [::1]:13003"),
                       (b'{"0": {"engine_id": "a:0"}}', "is not 1-65535"),
                       (b'{"0": {"engine_id": ["a:1"]}}', "not a string")):
        with pytest.raises(ValueError) as e:
            parse_table(body)
        assert says in str(e.value), (body[:40], str(e.value))
    got = parse_table(b'{"1": {"engine_id": "[::1]:13004"}, "0": {"engine_id": "h:13003"}}')
    assert got == [("0", "h:13003"), ("1", "[::1]:13004")]
