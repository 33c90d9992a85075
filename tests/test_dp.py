"""vLLM data parallelism inside one server (--data-parallel-size N: one API
server, N engines): each engine's names (settings.dp_base), what the
connector reads of vLLM's parallel config, the producer's names in its
answers and bootstrap table, and a flow-A probe that looks in each of the
producer's engines.  No vLLM needed: fast unit tests (the servers are
tests/test_e2e_dp.py)."""
import json
import types

import pytest

from mooncake_connector.connector import bootstrap, lifecycle, peer_record
from mooncake_connector.connector import probe as probe_mod
from mooncake_connector.connector import settings as settings_mod
from mooncake_connector.connector.connector import _dp, _dp_size, dp_count, dp_local
from mooncake_connector.connector.scheduler import SchedulerSide
from mooncake_connector.connector.settings import dp_base, shift_port
from mooncake_connector.serving import free_port


def _pc(**kw):
    return types.SimpleNamespace(parallel_config=types.SimpleNamespace(**kw))


def test_engine_k_moves_past_the_ranks_of_the_engines_before_it():
    assert dp_base("10.0.0.1:13003", 0, 4, 2) == "10.0.0.1:13003"  # engine 0: as configured
    assert dp_base("10.0.0.1:13003", 1, 1, 1) == "10.0.0.1:13004"
    assert dp_base("10.0.0.1:13003", 1, 4, 2) == "10.0.0.1:13011"  # 8 ranks of engine 0
    assert dp_base("10.0.0.1:13003", 3, 2, 1) == "10.0.0.1:13009"
    # Every rank of every engine its own port: D engines x TP x PP consecutive ports.
    d, tp, pp = 3, 2, 2
    ports = {shift_port(dp_base("h:1000", k, tp, pp), p * tp + t)
             for k in range(d) for p in range(pp) for t in range(tp)}
    assert ports == {f"h:{1000 + i}" for i in range(d * tp * pp)}
    with pytest.raises(settings_mod.SettingsError):
        dp_base("h:65535", 1, 1, 1)


def test_what_is_read_of_vllms_parallel_config():
    # No data parallelism: engine 0, no siblings (vLLM sets the local rank to
    # 0 then, from VLLM_DP_RANK_LOCAL's default, or leaves it None).
    for rl in (None, 0):
        none = _pc(data_parallel_size=1, data_parallel_size_local=1, data_parallel_rank=0,
                   data_parallel_rank_local=rl, data_parallel_index=0)
        assert (dp_local(none), dp_count(none), _dp(none), _dp_size(none)) == (0, 1, 0, 1)
    # A dense model's engine 0 of --data-parallel-size 2: only its process's
    # name (vLLM's EngineCore_DP0) tells.
    import multiprocessing
    name = multiprocessing.current_process().name
    multiprocessing.current_process().name = "EngineCore_DP0"
    try:
        assert _dp_size(none) == 2 and dp_local(none) == 0
    finally:
        multiprocessing.current_process().name = name
    # A dense model's engine 1 of --data-parallel-size 2: vLLM resets it to
    # DP 1 (reconfigure_for_independent_dp_rank) but keeps the local rank and
    # the global index.
    dense = _pc(data_parallel_size=1, data_parallel_size_local=1, data_parallel_rank=0,
                data_parallel_rank_local=1, data_parallel_index=1)
    assert (dp_local(dense), dp_count(dense), _dp(dense)) == (1, 1, 1)
    assert _dp_size(dense) > 1  # siblings behind the API server: forgets answer "seen"
    # A MoE model's engine 1 of 2: the sizes stay.
    moe = _pc(data_parallel_size=2, data_parallel_size_local=2, data_parallel_rank=1,
              data_parallel_rank_local=1, data_parallel_index=1)
    assert (dp_local(moe), dp_count(moe), _dp(moe), _dp_size(moe)) == (1, 2, 1, 2)
    # External load balancing (--data-parallel-rank 3: one engine per server,
    # each with its own config): names as configured, no siblings.
    ext = _pc(data_parallel_size=1, data_parallel_size_local=1, data_parallel_rank=0,
              data_parallel_rank_local=0, data_parallel_index=3,
              data_parallel_external_lb=True)
    assert (dp_local(ext), dp_count(ext), _dp(ext), _dp_size(ext)) == (0, 1, 3, 1)
    # Hybrid: this node's second engine (global rank 5): local index 1.
    hyb = _pc(data_parallel_size=8, data_parallel_size_local=4, data_parallel_rank=5,
              data_parallel_rank_local=1, data_parallel_index=5, data_parallel_hybrid_lb=True)
    assert (dp_local(hyb), dp_count(hyb), _dp(hyb), _dp_size(hyb)) == (1, 4, 5, 4)


def _worker(role="kv_producer", dp_local=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
    s = types.SimpleNamespace(local_hostname=None, role=role)
    return types.SimpleNamespace(s=s, dp_local=dp_local, tp_rank=tp_rank, tp_size=tp_size,
                                 pp_rank=pp_rank, facts={"pp_size": pp_size})


def test_each_engine_of_a_server_gets_its_own_names():
    cfg = {"prefill_host": "127.0.0.1", "prefill_port": 13003,
           "decode_host": "127.0.0.1", "decode_port": 13103}
    assert lifecycle._name(_worker(), cfg) == ("127.0.0.1:13003", "127.0.0.1:13003")
    assert lifecycle._name(_worker(dp_local=1), cfg) == ("127.0.0.1:13004", "127.0.0.1:13004")
    # TP 2 x PP 2: engine 1 starts after engine 0's four ranks
    assert lifecycle._name(_worker(dp_local=1, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2),
                           cfg) == ("127.0.0.1:13007", "127.0.0.1:13010")
    assert lifecycle._name(_worker("kv_consumer", dp_local=2, tp_size=2), cfg) == \
        ("127.0.0.1:13107", "127.0.0.1:13107")


def _producer_cfg():
    return types.SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config={
        "prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103"})


def test_a_producer_engines_answer_names_that_engine():
    s = settings_mod.resolve(_producer_cfg())
    for k, tp, pp, want in ((0, 2, 1, "127.0.0.1:13003"), (1, 1, 1, "127.0.0.1:13004"),
                            (1, 2, 2, "127.0.0.1:13007")):
        sch = SchedulerSide(s, 32, tp, lambda: None, block_bytes=32768, dp_local=k,
                            pp_size=pp)
        assert sch.producer_base == want


class _Meta:
    """A metadata client over a dict (peer_record's keys)."""
    def __init__(self, records):
        self.kv = {peer_record.KEY.format(name=n): json.dumps(r) for n, r in records.items()}
        self.gets = 0

    def get(self, key):
        self.gets += 1
        v = self.kv.get(key)
        return v.encode() if v is not None else None

    def close(self):
        pass


def _rec(dp, tp=1, pp=1, role="kv_producer"):
    return {"role": role, "tp_size": tp, "pp_size": pp, "dp_local": dp}


def test_a_servers_engines_are_found_by_their_records():
    meta = _Meta({"h:100": _rec(0, 2), "h:102": _rec(1, 2), "h:104": _rec(2, 2),
                  "h:108": _rec(4, 2)})
    assert peer_record.dp_engines(meta, "h:100") == ["h:100", "h:102", "h:104"]
    assert peer_record.dp_engines(meta, "h:200") == ["h:200"]  # nothing published
    # Another server's engine 0 next door is not one of ours.
    meta = _Meta({"h:100": _rec(0), "h:101": _rec(0), "h:102": _rec(1)})
    assert peer_record.dp_engines(meta, "h:100") == ["h:100"]
    meta = _Meta({"h:100": _rec(0), "h:101": _rec(1, role="kv_consumer")})
    assert peer_record.dp_engines(meta, "h:100") == ["h:100"]


def test_bootstrap_table_names_every_engine_of_the_server():
    t = bootstrap.query_table("h:100", 0, 2, 1, lambda t, p: shift_port("h:100", p * 2 + t),
                              dp_count=2)
    assert t == {"0": {"engine_id": "h:100", "worker_addr": {"0": {"0": "h:100"},
                                                             "1": {"0": "h:101"}}},
                 "1": {"engine_id": "h:102", "worker_addr": {"0": {"0": "h:102"},
                                                             "1": {"0": "h:103"}}}}
    # A dense model's engines do not say how many there are: the table grows
    # with the engines the metadata server knows.
    n = [1]
    s = settings_mod.resolve(types.SimpleNamespace(kv_role="kv_producer",
                                                   kv_connector_extra_config={
        "prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103",
        "bootstrap_port": free_port(), "bootstrap_host": "127.0.0.1"}))
    srv = bootstrap.start(s, "h:100", 0, 1, 1, lambda t, p: shift_port("h:100", p + t), {},
                          dp_found=lambda: n[0])
    try:
        assert set(json.loads(srv.body())) == {"0"}
        n[0], srv._refreshed = 2, float("-inf")
        got = json.loads(srv.body())
        assert got["1"]["engine_id"] == "h:101" and got["1"]["worker_addr"] == {"0": {"0": "h:101"}}
    finally:
        srv.close()


class _KV:
    def __init__(self, held):
        self.held, self.asked = held, []

    def probe(self, name, tokens, timeout):
        self.asked.append(name)
        return self.held.get(name, 0)

    def close(self):
        pass


def _probe(held, records):
    ktc = types.SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={
        "decode_url": "127.0.0.1:400", "prefill_url": "h:100", "protocol": "tcp",
        "metadata_server": "P2PHANDSHAKE"})
    p = probe_mod.ProducerProbe(settings_mod.resolve(ktc, env={}))
    p.kv, p.engine, p.default_producer = _KV(held), object(), "h:100"
    p._meta = _Meta(records)
    return p


def test_flow_a_probe_looks_in_each_producer_engine():
    toks = list(range(64))
    recs = {"h:100": _rec(0), "h:101": _rec(1)}
    p = _probe({"h:101": 64}, recs)
    assert p.held_tokens(None, toks) == 64 and p._where == "h:101"  # on engine 1
    assert p.kv.asked == ["h:100", "h:101"]
    p = _probe({"h:100": 64, "h:101": 64}, recs)
    assert p.held_tokens(None, toks) == 64 and p._where is None  # engine 0 holds it all
    assert p.kv.asked == ["h:100"]
    p = _probe({"h:100": 32, "h:101": 48}, recs)
    assert p.held_tokens(None, toks) == 48 and p._where == "h:101"  # the most held wins
    p = _probe({}, recs)
    assert p.held_tokens(None, toks) == 0 and p._where is None
    # A named producer (flow B) is asked alone.
    p = _probe({"h:101": 64}, recs)
    assert p.held_tokens("h:101", toks) == 64 and p.kv.asked == ["h:101"]
    # The engines are looked up once per DISCOVER_S, not per probe.
    p = _probe({"h:101": 64}, recs)
    p.held_tokens(None, toks)
    gets = p._meta.gets
    p.held_tokens(None, toks)
    assert p._meta.gets == gets


class _SlowMetadata:
    """A metadata server stand-in (Mooncake's HTTP protocol, GET only) that
    takes `delay` s over each answer: peer_record's records by engine name."""
    def __init__(self, records, delay):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlparse
        self.gets = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                import time
                outer.gets += 1
                time.sleep(delay)
                key = parse_qs(urlparse(self.path).query)["key"][0]
                name = key.rpartition("/")[2]
                body = json.dumps(records[name]).encode() if name in records else b"{}"
                self.send_response(200 if name in records else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metadata"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_probe_does_not_wait_for_a_slow_metadata_server(monkeypatch):
    """The producer's engines are looked up by the warm-up, then in the
    background: a probe answers from the list it has (a prompt on engine 1
    is found) without waiting for a metadata server that answers slowly."""
    import ctypes
    import time

    import mooncake_connector as mc
    from conftest import wait_until
    delay, bs = 1.0, 16
    port = free_port(span=2)
    names = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    slow = _SlowMetadata({names[0]: _rec(0), names[1]: _rec(1)}, delay)
    buf = ctypes.create_string_buffer(4 * 4096)
    ktc = types.SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={
        "decode_url": "127.0.0.1:400", "prefill_url": names[0], "protocol": "tcp",
        "metadata_server": "P2PHANDSHAKE"})
    engines = [mc.TransferEngine(), mc.TransferEngine()]
    p = probe_mod.ProducerProbe(settings_mod.resolve(ktc, env={}))
    try:
        for e, n in zip(engines, names):
            e.initialize(n, "P2PHANDSHAKE", "tcp", "")
        engines[1].register_memory(ctypes.addressof(buf), len(buf))
        with mc.KVTransfer(engines[1], mc.LookupBuffer(1 << 20, block_size=bs)) as kv1, \
                mc.KVTransfer(engines[0], mc.LookupBuffer(1 << 20, block_size=bs)):
            toks = list(range(4 * bs))
            kv1.send_kv(toks, [(ctypes.addressof(buf) + i * 4096, 4096, i) for i in range(4)])
            assert p._ensure_engine(time.monotonic())
            p._meta = mc.MetadataClient(slow.url)  # P2P probe engine, engines from the slow server
            p.warm()
            assert wait_until(lambda: not p.pending(probe_mod.WARM), timeout=30)
            monkeypatch.setattr(probe_mod, "DISCOVER_S", 0.0)  # every probe finds the list stale
            for _ in range(3):
                t0 = time.monotonic()
                assert p.held_tokens(None, toks) == 4 * bs and p._where == names[1]
                assert time.monotonic() - t0 < delay / 2  # no metadata round trip waited for
            gets = slow.gets
            assert wait_until(lambda: slow.gets > gets)  # looked up again, in the background
    finally:
        p.close()
        for e in engines:
            e.close()
        slow.close()
