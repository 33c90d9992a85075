"""Our engines on Mooncake's own HTTP metadata server program
(``mooncake_http_metadata_server`` from Mooncake's wheel, run unmodified with
our venv's aiohttp).  That server refuses a second PUT of a
``mooncake/rpc_meta/<segment>`` key and has no TTL; the engine writes that key
once per lifetime, keeps it alive without a refused PUT each period, and
replaces a stale one left by an earlier engine of the same name.  Skips with
the reason when the wheel cannot be had (tests/mooncake_wheel.py)."""
import json
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import http  # noqa: E402
from mooncake_wheel import find_server  # noqa: E402

import mooncake_connector as mc  # noqa: E402
from mooncake_connector.serving import free_port  # noqa: E402


@pytest.fixture
def mooncake_server(tmp_path):
    path, why = find_server()
    if not path:
        pytest.skip(why)
    port = free_port()
    log = open(tmp_path / "server.log", "w+")
    p = subprocess.Popen([sys.executable, path, "--host", "127.0.0.1", "--port", str(port),
                          "--log-level", "INFO"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/metadata"
    end = time.time() + 20
    while True:
        try:
            if http("GET", url + "?key=probe", timeout=3)[0] == 404:
                break
        except OSError:
            pass
        assert p.poll() is None and time.time() < end, "Mooncake's metadata server did not start"
        time.sleep(0.05)
    yield url, log
    p.terminate()
    p.wait(10)
    log.close()


def test_engines_register_transfer_and_keep_alive_on_mooncakes_server(
        mooncake_server, monkeypatch, capfd):
    url, log = mooncake_server
    monkeypatch.setenv("MC_METADATA_TTL", "1")  # keep-alive every ~333 ms
    with mc.TransferEngine() as a, mc.TransferEngine() as b:
        a.initialize("127.0.0.1", url, "tcp", "")
        b.initialize("127.0.0.1", url, "tcp", "")
        seg = b.get_segment_name()
        rpc_key = f"mooncake/rpc_meta/{seg}"
        assert json.loads(http("GET", f"{url}?key={rpc_key}")[1])["rpc_port"] == b.get_rpc_port()
        # Every register / unregister re-publishes the descriptor: each one
        # used to re-PUT the rpc key and fail with HTTP 400 here.
        dst = b.allocate_managed_buffer(1 << 16)
        extra = b.allocate_managed_buffer(1 << 16)
        b.unregister_memory(extra)
        b.register_memory(extra, 1 << 16)
        src = a.allocate_managed_buffer(1 << 16)
        a.write_bytes_to_buffer(src, b"moon" * 1024)
        a.transfer_sync_write(seg, src, extra, 4096)
        a.transfer_sync_write(seg, src, dst, 4096)
        assert b.read_bytes_from_buffer(dst, 8) == b"moonmoon"
        assert b.read_bytes_from_buffer(extra, 4) == b"moon"
        time.sleep(1.3)  # several keep-alive rounds on both engines
        b.unregister_memory(extra)
        with pytest.raises(mc.MooncakeError):
            a.transfer_sync_write(seg, src, extra, 4096)  # descriptor updated
    err = capfd.readouterr().err
    assert "keep-alive of segment" not in err and "Duplicate" not in err, err
    # Clean close removed what the engines wrote.
    assert http("GET", f"{url}?key={rpc_key}")[0] == 404
    assert http("GET", f"{url}?key=mooncake/ram/{seg}")[0] == 404
    # At most one refused PUT per engine (the first keep-alive learns the
    # server keeps keys without TTL and checks with GET afterwards).
    log.flush()
    log.seek(0)
    refused = [ln for ln in log.read().splitlines() if '" 400 ' in ln]
    assert len(refused) <= 2, refused


def test_stale_rpc_entry_of_an_earlier_engine_is_replaced(mooncake_server):
    url, _ = mooncake_server
    port = free_port()
    name = f"127.0.0.1:{port}"
    stale = b'{"ip_or_host_name":"127.0.0.1","rpc_port":1}'
    assert http("PUT", f"{url}?key=mooncake/rpc_meta/{name}", stale)[0] == 200
    assert http("PUT", f"{url}?key=mooncake/rpc_meta/{name}", stale)[0] == 400  # that server
    with mc.TransferEngine() as e:
        e.initialize(name, url, "tcp", "")
        assert e.get_segment_name() == name
        got = json.loads(http("GET", f"{url}?key=mooncake/rpc_meta/{name}")[1])
        assert got["rpc_port"] == port
