"""vLLM's in-tree MooncakeConnector, worker half, in one process on CPU
tensors, on our engine (run by tests/test_intree_worker.py in a fresh
interpreter, so neither the `mooncake.engine` hook nor vLLM's process groups
leak into the pytest process; also under scripts/vllm_next.sh's 0.34 overlay).

A producer and a consumer worker connector (vLLM's own classes, constructed
as vLLM's worker constructs them: `MooncakeConnector(vllm_config,
KVConnectorRole.WORKER, kv_cache_config)`) register CPU KV tensors in the
CPU attention backend's per-layer layout, then requests move blocks the way
vLLM's scheduler asks for them (its own MooncakeConnectorMetadata): the
producer's bootstrap server, the consumer's ZMQ request, the producer's push
through our engine.  Every block the consumer asked for must hold the
producer's bytes exactly; every other block stays untouched.

Prints one JSON line with what happened; exits non-zero on any failure.
"""
import importlib.util
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # get_ip(): loopback only
os.environ.setdefault("MC_SAME_HOST_CPU", "0")      # the TCP transport, as configured

from mooncake_connector.serving import free_port  # noqa: E402

os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(free_port())

# `from mooncake.engine import TransferEngine` (vLLM's module, at import) -> ours.
from mooncake_connector import mooncake_shim  # noqa: E402

mooncake_shim.install()

# vLLM's MooncakeConnectorWorker.__init__ asks torch.accelerator for a device
# index, which raises on a host without one: tests/intree_cpu/sitecustomize.py.
_spec = importlib.util.spec_from_file_location(
    "intree_cpu_site", os.path.join(HERE, "intree_cpu", "sitecustomize.py"))
_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_site)
_site.patch_accelerator_index()

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import parallel_state as ps  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (  # noqa: E402
    mooncake_connector as mc)
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec)

import vllm_harness  # noqa: E402  (make_config; the 0.34 triton-cpu shim)

BLOCK = 32
KV_HEADS = vllm_harness.HEADS  # 2
HEAD = 32                      # the tiny config's hidden 128 / 4 heads
NUM_BLOCKS = 48
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
EXTRA = {"mooncake_protocol": "tcp"}
# (producer blocks, consumer blocks): contiguous runs, one block, scattered.
MOVES = [([3, 4, 5, 6], [10, 11, 12, 13]), ([7], [20]), ([1, 9, 2, 30], [31, 5, 40, 8])]


def kv_config():
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def wait(cond, what, timeout=60.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def step(worker, meta):
    """What vLLM's worker does with the scheduler's metadata each step."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.clear_connector_metadata()


def main():
    out = {"vllm": vllm.__version__}
    model = vllm_harness.tiny_model_dir(tempfile.mkdtemp(prefix="mc-intree-model-"))
    cfg_p = vllm_harness.make_config(model, "kv_producer", EXTRA, BLOCK, module_path=None)
    cfg_c = vllm_harness.make_config(model, "kv_consumer", EXTRA, BLOCK, module_path=None)
    # vLLM's factory resolves the in-tree name to this very class.
    cls = KVConnectorFactory.get_connector_class(cfg_p.kv_transfer_config)
    assert cls is mc.MooncakeConnector, cls
    from mooncake_connector import compat
    assert issubclass(mc.TransferEngine, compat.TransferEngine), mc.TransferEngine

    kcc = kv_config()
    try:  # vLLM >= 0.34: the engine core resolves one KV layout before workers start
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    except ImportError:
        resolve_kv_cache_layout = None
    if resolve_kv_cache_layout is not None:
        for cfg in (cfg_p, cfg_c):  # the CPU attention backend supports LBHNC only
            out["kv_cache_layout"] = resolve_kv_cache_layout(
                cfg, [["LBHNC"]], [kcc.kv_cache_groups[0].kv_cache_spec]).name
    with set_current_vllm_config(cfg_p):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ps.initialize_model_parallel(1, 1)
        prod = cls(cfg_p, KVConnectorRole.WORKER, kcc)
    with set_current_vllm_config(cfg_c):
        cons = cls(cfg_c, KVConnectorRole.WORKER, kcc)
    pw, cw = prod.connector_worker, cons.connector_worker
    assert isinstance(pw.engine, compat.TransferEngine), type(pw.engine)
    out["producer_segment"] = pw.engine.get_segment_name()
    out["consumer_segment"] = cw.engine.get_segment_name()

    # The CPU attention backend's per-layer KV: (blocks, kv heads, block, 2 * head).
    gen = torch.Generator().manual_seed(7)
    kv_p = {n: torch.rand(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD, generator=gen) for n in LAYERS}
    kv_c = {n: torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD) for n in LAYERS}
    prod.register_kv_caches(kv_p)  # starts the bootstrap server, registers with it
    cons.register_kv_caches(kv_c)
    boot = f"http://127.0.0.1:{os.environ['VLLM_MOONCAKE_BOOTSTRAP_PORT']}"
    pe = cfg_p.kv_transfer_config.engine_id
    out["block_bytes"] = kv_p[LAYERS[0]][0].nbytes

    sent, recvd = set(), set()

    def poll():
        for w, box in ((prod, sent), (cons, recvd)):
            s, r = w.get_finished(set())
            box |= (s or set()) | (r or set())

    def move(tag, src, dst):
        """One request's legs (p-<tag>, d-<tag>, transfer xfer-<tag>) as
        vLLM's schedulers send them: the producer's src blocks to the
        consumer's dst blocks.  (Its ids.)"""
        xfer, p_id, d_id = f"xfer-{tag}", f"p-{tag}", f"d-{tag}"
        p_params = {"do_remote_decode": True, "transfer_id": xfer}
        d_params = {"do_remote_prefill": True, "transfer_id": xfer,
                    "remote_engine_id": pe, "remote_bootstrap_addr": boot}
        # Producer: the request was admitted (update_state_after_alloc) ...
        m = mc.MooncakeConnectorMetadata()
        m.add_new_req(p_id, [], p_params, load_remote_cache=False)
        step(prod, m)
        # ... the consumer asks for its blocks (both legs run at once) ...
        m = mc.MooncakeConnectorMetadata()
        m.add_new_req(d_id, [list(dst)], d_params)
        step(cons, m)
        # ... and the producer's prefill finished (request_finished).
        m = mc.MooncakeConnectorMetadata()
        m.add_new_req(p_id, [list(src)], p_params, load_remote_cache=False)
        step(prod, m)
        return p_id, d_id

    for i, (src, dst) in enumerate(MOVES):
        p_id, d_id = move(i, src, dst)
        wait(lambda: (poll(), p_id in sent and d_id in recvd)[1], f"request {i} to finish")

    assert not cons.get_block_ids_with_load_errors()
    moved = set()
    for src, dst in MOVES:
        for s, d in zip(src, dst):
            moved.add(d)
            for n in LAYERS:
                assert torch.equal(kv_c[n][d], kv_p[n][s]), (n, s, d)
    for n in LAYERS:
        for b in range(NUM_BLOCKS):
            if b not in moved:
                assert not kv_c[n][b].any(), ("a block nobody asked for changed", n, b)
    out["blocks_checked"] = len(moved) * len(LAYERS)

    out["bytes_expected"] = sum(len(src) for src, _ in MOVES) * len(LAYERS) * out["block_bytes"]
    st = prod.get_kv_connector_stats()
    out["connector_stats"] = st.reduce() if st is not None else None
    out["engine_stats"] = {k: v for k, v in pw.engine.get_stats().items() if "bytes" in k}

    # vLLM >= 0.33 sleep mode: unregister (batch_unregister_memory) and
    # restore (batch_register_memory) the consumer's KV, then move one more.
    if hasattr(cons, "unregister_kv_caches"):
        cons.unregister_kv_caches()
        cons.restore_kv_caches()
        src, dst = [11, 12], [44, 45]
        move("s", src, dst)
        wait(lambda: (poll(), "p-s" in sent and "d-s" in recvd)[1], "the move after restore")
        assert not cons.get_block_ids_with_load_errors()
        for s, d in zip(src, dst):
            for n in LAYERS:
                assert torch.equal(kv_c[n][d], kv_p[n][s]), ("after restore", n, s, d)
        out["sleep_mode"] = "unregister + restore + move ok"
        out["bytes_expected"] += len(src) * len(LAYERS) * out["block_bytes"]
    # The consumer's KV no longer registered with its engine (vLLM >= 0.33's
    # sleep mode; on 0.32 the same engine call): our engine must refuse the
    # push (Mooncake's -1 to vLLM), vLLM's consumer must see the load fail
    # for exactly those blocks, and not one byte may land there.
    if hasattr(cons, "unregister_kv_caches"):
        cons.unregister_kv_caches()
    else:
        assert cw.engine.batch_unregister_memory(cw.seen_base_addresses) == 0
    src, dst = [13, 14], [46, 47]
    move("f", src, dst)
    wait(lambda: (poll(), "d-f" in recvd)[1], "the refused push to be reported")
    errs = cons.get_block_ids_with_load_errors()
    assert errs == set(dst), errs
    for n in LAYERS:
        for d in dst:
            assert not kv_c[n][d].any(), ("bytes landed in unregistered memory", n, d)
    assert pw.engine.last_error is not None, "our engine reported no error"
    out["refused"] = str(pw.engine.last_error)
    st = prod.get_kv_connector_stats()
    out["failed_transfers"] = st.reduce()["Num failed transfers"] if st is not None else 0

    out["engine_stats_end"] = {k: v for k, v in pw.engine.get_stats().items() if "bytes" in k}

    prod.shutdown()
    cons.shutdown()
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # vLLM's daemon threads (uvicorn, event loops) need no join


if __name__ == "__main__":
    main()
