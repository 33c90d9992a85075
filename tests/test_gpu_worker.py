"""The vLLM connector's worker half (connector/worker.py, WorkerSide) with
CUDA KV caches: two processes, one per GPU where two are visible, each
holding 8 layers of vLLM's FlashAttention layout (2, num_blocks, block_size,
num_kv_heads, head_size) in bf16 and registering them through
register_kv_caches as vLLM's worker does.  The producer publishes a prompt's
blocks (publish, as in wait_for_save); the consumer loads them into other,
scattered block ids (start_load + get_finished polling, as vLLM's step
loop); every K and V block must arrive byte-exact, no other block may
change, and the producer must report the request finished sending once it
was pulled.  Over the same-host GPU path and over TCP with staging.  vLLM
itself is not needed (the GPU machine has none): the metadata objects are
the ones the scheduler half sends.  `pytest -m gpu`."""
import json
import os
import random
import sys
import time

import pytest
from conftest import cuda_torch
from line_peer import LinePeer

from mooncake_connector.serving import free_port

pytestmark = pytest.mark.gpu

torch = cuda_torch()

HERE = os.path.dirname(os.path.abspath(__file__))
NGPU = torch.cuda.device_count()
BS, NB, LAYERS = 16, 256, 8


class WorkerPeer(LinePeer):
    def __init__(self, role, device, urls, env, alloc="torch", settings=None):
        super().__init__(os.path.join(HERE, "gpu_worker_peer.py"),
                         ["--role", role, "--device", device, "--urls", json.dumps(urls),
                          "--layers", str(LAYERS), "--blocks", str(NB), "--block-size", str(BS),
                          "--alloc", alloc, "--settings", json.dumps(settings or {})],
                         env, f"{role} worker")


@pytest.mark.parametrize("ipc", ["1", "0"], ids=["same-host", "tcp"])
def test_worker_cuda_kv_caches_between_gpus(ipc):
    run_worker_pair(ipc)


VLLM034 = os.environ.get("VLLM034_SRC", "")


@pytest.mark.skipif(not os.path.isfile(os.path.join(VLLM034, "vllm/utils/extensible_tensor.py")),
                    reason="set VLLM034_SRC to vLLM 0.34.0's unpacked wheel (its Python files)")
@pytest.mark.parametrize("alloc,ipc,path", [
    ("vllm034-fd", "1", "same host: GPU memory moves directly"),
    ("vllm034-fd", "0", None),
    ("vllm034-none", "1", "TCP with pinned staging"),
], ids=["fd-same-host", "fd-tcp", "no-handle-tcp-fallback"])
def test_worker_vllm034_extensible_kv_cache(alloc, ipc, path):
    """Both workers' KV caches allocated by vLLM 0.34's own extensible KV
    cache allocator (driver-mapped, two physical chunks per layer): with
    POSIX fd handles (KVCacheAccess.EXPORTS_FD) the same-host GPU path maps
    them; without, TCP with staging (and the producer says why); byte-exact
    every time."""
    logs = run_worker_pair(ipc, alloc)
    if path:
        assert path in logs
    if ipc == "0":
        assert "moves directly" not in logs
    if alloc == "vllm034-none":
        assert "KVCacheAccess.EXPORTS_FD" in logs


def pair_settings(ipc):
    """Two workers' connector settings (ports at least 50 apart: each engine
    takes a few above its own) and environment (MC_GPU_IPC=ipc)."""
    p = free_port()
    d = free_port(away=[p])
    urls = {"prefill_url": f"127.0.0.1:{p}", "decode_url": f"127.0.0.1:{d}",
            "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}
    return urls, {"MC_GPU_IPC": ipc, "MC_LOG_LEVEL": "info"}


def start_pair(urls, env, made, alloc="torch", settings=None):
    """The producer's and the consumer's WorkerPeer (the consumer on the
    second GPU where there is one, with `settings`), each put in `made` as
    it starts (close_all closes them)."""
    prod = WorkerPeer("kv_producer", "cuda:0", urls, env, alloc)
    made.append(prod)
    cons = WorkerPeer("kv_consumer", "cuda:1" if NGPU > 1 else "cuda:0", urls, env, alloc,
                      settings)
    made.append(cons)
    return prod, cons


def close_all(made):
    """Closes each peer, its log written to stderr; returns the logs."""
    logs = ""
    for m in made:
        err = m.close()
        logs += err
        sys.stderr.write(err)
    return logs


def block_sums(prod, cons, src, dst):
    """Both sides' per-layer K/V block sums, and the (layer, K/V, i) of each
    block src[i] of the producer whose copy dst[i] on the consumer differs."""
    sp, sc = prod.call(cmd="sums")["sums"], cons.call(cmd="sums")["sums"]
    bad = [(li, kv, i) for li in range(LAYERS) for kv in (0, 1) for i in range(len(src))
           if sc[li][kv][dst[i]] != sp[li][kv][src[i]]]
    return sp, sc, bad


def run_worker_pair(ipc, alloc="torch"):
    urls, env = pair_settings(ipc)
    made = []
    try:
        prod, cons = start_pair(urls, env, made, alloc)
        assert prod.info["extents_per_block"] == 2 * LAYERS  # K and V of every layer
        prod.call(cmd="fill", seed=7)
        rng = random.Random(3)
        nblk = 100
        tokens = [rng.randrange(32000) for _ in range(nblk * BS)]
        src = rng.sample(range(NB), nblk)  # scattered on both sides
        dst = rng.sample(range(NB), nblk)
        prod.call(cmd="publish", req_id="r1", tokens=tokens, block_ids=src)
        assert prod.call(cmd="finished", req_ids=[])["sending"] == []
        r = cons.call(cmd="load", req_id="r1", tokens=tokens, block_ids=dst)
        assert r["invalid"] == [], r
        sp, sc, bad = block_sums(prod, cons, src, dst)
        assert not bad, f"{len(bad)} K/V blocks differ, first {bad[:5]}"
        assert all(sp[li][kv][src[0]] != 0 for li in range(LAYERS) for kv in (0, 1))
        others = set(range(NB)) - set(dst)
        touched = [(li, kv, b) for li in range(LAYERS) for kv in (0, 1) for b in others
                   if sc[li][kv][b] != 0]
        assert not touched, f"{len(touched)} blocks outside the load changed"
        # The request finished on the producer: once the consumer pulled the
        # blocks (consume mode), vLLM may free them.
        deadline, sending = time.monotonic() + 20, []
        while time.monotonic() < deadline and "r1" not in sending:
            sending = prod.call(cmd="finished", req_ids=["r1"])["sending"]
            time.sleep(0.01)
        assert "r1" in sending
        mb = nblk * 2 * LAYERS * BS * 8 * 128 * 2 / 1e6
        sys.stderr.write(f"worker load ({'same-host' if ipc == '1' else 'TCP'}, {alloc}): "
                         f"{mb:.1f} MB in {r['secs'] * 1e3:.1f} ms\n")
    finally:
        logs = close_all(made)
    return logs


@pytest.mark.parametrize("ipc", ["1", "0"], ids=["same-host", "tcp"])
def test_push_layerwise_streams_cuda_layers_before_wait_for_save(ipc):
    """Push layer by layer with CUDA KV caches (issue #31): vLLM's
    save_kv_layer runs when a layer's kernels are queued, not done.  The
    producer queues 8 slow layers (~15 ms of GPU each) and returns at once;
    each layer's write to the decode side must land once that layer's
    kernels completed - layer 0's well before the last one's, all before
    wait_for_save - and every byte must be the layer's new KV (a write
    started before its kernels finished would carry the old values)."""
    urls, env = pair_settings(ipc)
    made = []
    try:
        prod, cons = start_pair(urls, env, made)
        prod.call(cmd="fill", seed=7)
        rng = random.Random(5)
        nblk = 40
        # Two requests: the first one also opens the path to the decode
        # side (same host: the CUDA IPC import, once per peer); the second
        # is the steady state, and must stream layer by layer.
        for n, rid in enumerate(("r1", "r2")):
            tokens = [rng.randrange(32000) for _ in range(nblk * BS)]
            src, dst = rng.sample(range(NB), nblk), rng.sample(range(NB), nblk)
            cons.call(cmd="push_load", req_id=rid, tokens=tokens, block_ids=dst, tid="t" + rid)
            f = prod.call(cmd="push_forward", req_id=rid, tokens=tokens, block_ids=src,
                          tid="t" + rid, seed=11 + n)
            assert "error" not in f, f
            landed = {int(k): v for k, v in f["landed"].items()}
            sys.stderr.write(f"push layerwise on CUDA, {rid} (gate {f['gate']}): queued in "
                             f"{f['queued'] * 1e3:.1f} ms, layers landed at "
                             f"{[round(landed[k] * 1e3, 1) for k in sorted(landed)]} ms\n")
            assert sorted(landed) == list(range(LAYERS)), \
                f"{rid}: only layers {sorted(landed)} landed before wait_for_save"
            # the forward thread did not wait for the GPU: queueing all 8
            # layers took less than the last 3 layers' GPU time, and the GPU
            # was busy then
            assert f["queued"] < landed[LAYERS - 1] - 0.045, f
            assert not f["gpu_done_at_save"], f
            if n:  # one by one, not at once
                assert landed[LAYERS - 1] - landed[0] > 0.05, landed
            deadline, recving = time.monotonic() + 20, []
            while time.monotonic() < deadline and rid not in recving:
                prod.call(cmd="finished", req_ids=[])
                recving = cons.call(cmd="finished", req_ids=[])["recving"]
                time.sleep(0.005)
            assert rid in recving
            assert cons.call(cmd="load_errors")["invalid"] == []
            bad = block_sums(prod, cons, src, dst)[2]
            assert not bad, f"{rid}: {len(bad)} K/V blocks differ, first {bad[:5]}"
    finally:
        close_all(made)


@pytest.mark.parametrize("ipc", ["1", "0"], ids=["same-host", "tcp"])
def test_layer_read_reads_cuda_layers_byte_exact_and_the_producer_writes_nothing(ipc):
    """push_layer_read with CUDA KV caches (docs/connector.md, "Layer
    read"): the decode READs each layer the producer announced; a layer is
    announced only once its kernels completed (the producer queues 8 slow
    layers, ~15 ms of GPU each, and returns from save_kv_layer at once), so
    every K and V block read is the layer's new KV (a read of a layer still
    being computed would carry the old values), and the producer writes no
    byte into the decode's blocks."""
    urls, env = pair_settings(ipc)
    made = []
    try:
        prod, cons = start_pair(urls, env, made,
                                settings={"push_layer_load": True, "push_layer_read": True,
                                          "push_layer_read_stall_s": 10.0,
                                          "push_layer_timeout_s": 20.0})
        prod.call(cmd="fill", seed=3)
        rng = random.Random(9)
        nblk = 40
        for n, rid in enumerate(("r1", "r2")):
            tokens = [rng.randrange(32000) for _ in range(nblk * BS)]
            src, dst = rng.sample(range(NB), nblk), rng.sample(range(NB), nblk)
            assert "error" not in cons.call(cmd="push_load", req_id=rid, tokens=tokens,
                                            block_ids=dst, tid="t" + rid, layer_read=True)
            f = prod.call(cmd="push_forward", req_id=rid, tokens=tokens, block_ids=src,
                          tid="t" + rid, seed=21 + n, watch_s=0.0)
            assert "error" not in f, f
            assert f["bytes"] == 0, f    # nothing written: the decode reads
            w = cons.call(cmd="layer_wait")
            assert "error" not in w, w
            sys.stderr.write(f"layer read on CUDA, {rid}: queued in {f['queued'] * 1e3:.1f} ms "
                             f"(GPU done at save: {f['gpu_done_at_save']}), layers waited "
                             f"{[round(v * 1e3, 1) for v in w['waited'].values()]} ms\n")
            # A layer load is in the step (vLLM's get_finished ends it: no
            # finished-receiving report; a failure is a load error).
            cons.call(cmd="finished", req_ids=[])
            assert cons.call(cmd="load_errors")["invalid"] == []
            prod.call(cmd="finished", req_ids=[])
            bad = block_sums(prod, cons, src, dst)[2]
            assert not bad, f"{rid}: {len(bad)} K/V blocks differ, first {bad[:5]}"
    finally:
        close_all(made)
