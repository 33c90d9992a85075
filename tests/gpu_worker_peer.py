"""One vLLM worker's half of MooncakeConnector (connector/worker.py's
WorkerSide, the real class vLLM's worker process drives) holding CUDA KV
caches in vLLM's FlashAttention layout, one tensor per layer of shape
(2, num_blocks, block_size, num_kv_heads, head_size), driven over stdin/stdout
with JSON lines.  Stands in for vLLM's worker process where vLLM itself is
not installed (the GPU machine): the hooks are called as vLLM calls them,
with the connector metadata the scheduler half would send.

    python tests/gpu_worker_peer.py --role kv_producer --device cuda:0 --urls JSON

First line printed: {"ready": true, "extents_per_block": n}.  Commands:
    {"cmd": "fill", "seed": S} / {"cmd": "sums"} -> {"sums": [layer][k/v][block]}
    {"cmd": "publish", "req_id", "tokens", "block_ids"}        (producer)
    {"cmd": "finished", "req_ids": [...]} -> {"sending": [...], "recving": [...]}
    {"cmd": "load", "req_id", "tokens", "block_ids"}           (consumer)
        -> {"secs", "invalid": [...], "stats": {...}}
    {"cmd": "push_load", "req_id", "tokens", "block_ids", "tid"}  (consumer: push target)
        ["layer_read": true: a layer load in read mode (push_layer_read): the
         decode READs each layer the producer announces]
    {"cmd": "layer_wait"} -> {"waited": {layer: s}}   (consumer: wait_for_layer_load
        for each layer in order, as the decode's forward does)
    {"cmd": "engine_stats"} -> the engine's counters
    {"cmd": "push_forward", "req_id", "tokens", "block_ids", "tid", "seed"}  (producer)
        -> {"queued", "landed": {layer: s}, "gpu_done_at_save", "gate", "bytes"}
    {"cmd": "exit"}
"""
import argparse
import json
import os
import sys
import time

import torch

from mooncake_connector.connector.metadata import (LoadSpec, MooncakeConnectorMetadata,
                                                   PublishSpec)
from mooncake_connector.connector.settings import Settings
from mooncake_connector.connector.worker import WorkerSide

# The helper protocol lives beside this script (CI runs with PYTHONSAFEPATH,
# which keeps a script's own directory off sys.path).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from line_peer import answer as out, requests  # noqa: E402


def load_vllm034_allocator():
    """vLLM 0.34's own allocator code (vllm/utils/extensible_tensor.py and
    vmm_driver.py, unchanged, from $VLLM034_SRC: the wheel's files) without
    importing the rest of vLLM: only `vllm.logger` is stood in for."""
    import importlib
    import logging
    import types
    src = os.environ["VLLM034_SRC"]
    if "vllm" not in sys.modules:
        pkg = types.ModuleType("vllm")
        pkg.__path__ = [os.path.join(src, "vllm")]
        utils = types.ModuleType("vllm.utils")
        utils.__path__ = [os.path.join(src, "vllm", "utils")]
        logger = types.ModuleType("vllm.logger")
        logger.init_logger = logging.getLogger
        sys.modules.update({"vllm": pkg, "vllm.utils": utils, "vllm.logger": logger})
    return importlib.import_module("vllm.utils.extensible_tensor")


def vllm034_kv(a, dev, shape, handle_types):
    """One ExtensibleTensor with a segment per layer, as vLLM 0.34's
    ExtensibleKVCache builds it; each segment committed in two steps (two
    physical chunks per layer, mapped back to back), then viewed as the
    layers' FlashAttention tensors."""
    et = load_vllm034_allocator()
    per = 2 * a.blocks * a.block_size * a.kv_heads * a.head_size * 2  # bf16
    gran = et.granule_size(dev.index or 0)
    per_padded = (per + 2 * gran - 1) // (2 * gran) * (2 * gran)
    buf = et.ExtensibleTensor(per_padded * a.layers, device=dev,
                              segment_capacities=[per_padded] * a.layers,
                              export_handle_types=handle_types)
    buf.resize_per_segment_(per_padded // 2, zero_new=True)
    buf.resize_per_segment_(per_padded, zero_new=True)
    full = buf.full_view()
    kv = {f"model.layers.{i}.self_attn.attn":
          full[i * per_padded:i * per_padded + per].view(torch.bfloat16).view(shape)
          for i in range(a.layers)}
    return buf, kv


def _warm_kernels(kv, dev, n):
    """One untimed pass of the kernels push_forward queues per layer (CUDA
    lazy module loading makes a kernel's first launch cost tens of ms of
    host time, which would let the GPU finish every layer before the last
    one is queued)."""
    t = next(iter(kv.values()))
    scratch = torch.empty((2, n) + tuple(t.shape[2:]), dtype=torch.int16, device=dev)
    idx = torch.arange(n, device=dev)
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    torch.cuda._sleep(1000)
    big = torch.empty((2, t.shape[1]) + tuple(t.shape[2:]), dtype=torch.int16, device=dev)
    big[:, idx] = torch.randint(-32768, 32768, scratch.shape, dtype=torch.int16, device=dev,
                                generator=g)
    torch.cuda.synchronize(dev)


def _landed_layers(w, job, landed, t0):
    """Notes (seconds after t0) each layer whose writes to every target
    completed in the engine - on either CUDA path (the engine's gate, or
    the layer-event thread): a batch the engine reports done, or one the
    producer already reaped (tg.landed)."""
    with w.push_p.lock:
        tgs = [(dict(tg.blayers), set(tg.landed)) for tg in job.targets.values()]
    now = time.monotonic() - t0
    per_target = []
    for blayers, done in tgs:
        for bid, layers in blayers.items():
            try:
                fin = w.engine.transfer_wait(bid, 0)
            except ValueError:  # reaped meanwhile: its layers are in tg.landed
                continue
            if fin:
                done.update(layers)
        per_target.append(done)
    if per_target:
        for li in set.intersection(*per_target):
            landed.setdefault(li, now)


def push_forward(w, kv, dev, req):
    """Producer, push layer by layer: a prefill step as vLLM runs it on the
    GPU.  Per layer a slow kernel (the layer's "attention", ~15 ms), then the
    layer's new KV written into the prompt's blocks, then save_kv_layer -
    all queued on the stream, none waited for.  A watcher thread notes when
    each layer's writes to the decode side completed, during the queueing
    and until wait_for_save."""
    import threading

    rid, tid, blocks = req["req_id"], req["tid"], req["block_ids"]
    _warm_kernels(kv, dev, len(blocks))
    t_end = time.monotonic() + 10
    while tid not in w.push_p.early and time.monotonic() < t_end:
        w.drain_notifies()  # the decode side's target (it admitted the request first)
        time.sleep(0.001)
    if tid not in w.push_p.early:
        return {"error": "no push target arrived in 10 s"}
    meta = MooncakeConnectorMetadata(publishes=[PublishSpec(
        rid, req["tokens"], blocks, push_tid=tid, layerwise=True)], held=[rid])
    w.on_metadata(meta)
    job = w.push_p.jobs[tid]
    idx = torch.tensor(blocks, device=dev)
    g = torch.Generator(device=dev)
    g.manual_seed(req["seed"])
    landed, stop = {}, threading.Event()
    t0 = time.monotonic()

    def watch():
        while not stop.is_set() and len(landed) < len(kv) and \
                time.monotonic() - t0 < req.get("watch_s", 5.0):
            _landed_layers(w, job, landed, t0)
            time.sleep(0.0002)

    watcher = threading.Thread(target=watch, name="landed-watch", daemon=True)
    watcher.start()
    for name, t in kv.items():
        torch.cuda._sleep(req.get("cycles", 30_000_000))
        raw = t.view(torch.int16)
        raw[:, idx] = torch.randint(-32768, 32768, (2, len(blocks)) + tuple(raw.shape[2:]),
                                    dtype=torch.int16, device=dev, generator=g)
        w.save_kv_layer(name)
    queued = time.monotonic() - t0
    gpu_done = torch.cuda.current_stream().query()
    watcher.join()
    stop.set()
    w.publish(meta)  # wait_for_save
    return {"queued": queued, "landed": landed, "gpu_done_at_save": gpu_done,
            "gate": w.push_p._gate_on(), "bytes": job.bytes}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--urls", required=True, help="mooncake.json fields as JSON")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--settings", default="{}",
                    help="more connector settings as JSON (kv_connector_extra_config keys)")
    ap.add_argument("--alloc", default="torch", choices=["torch", "vllm034-fd", "vllm034-none"],
                    help="vllm034-*: vLLM 0.34's extensible KV cache allocator (its wheel's "
                         "Python files under $VLLM034_SRC), with POSIX fd handles (what "
                         "KVCacheAccess.EXPORTS_FD requests) or none (IN_PROCESS)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.cuda.set_device(dev)
    shape = (2, a.blocks, a.block_size, a.kv_heads, a.head_size)
    keep = None
    if a.alloc == "torch":
        kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.bfloat16,
                                                              device=dev)
              for i in range(a.layers)}
    else:
        keep, kv = vllm034_kv(a, dev, shape, 1 if a.alloc == "vllm034-fd" else 0)
    s = Settings(role=a.role, mooncake=json.loads(a.urls), hold_timeout_s=60.0,
                 load_timeout_s=60.0, **json.loads(a.settings))
    w = WorkerSide(s, a.block_size, tp_rank=0, tp_size=1, num_blocks=a.blocks)
    w.register_kv_caches(kv)


    out({"ready": True, "extents_per_block": w.layout.extents_per_block})
    for req in requests():
        cmd = req["cmd"]
        if cmd == "fill":
            g = torch.Generator(device=dev)
            g.manual_seed(req["seed"])
            for t in kv.values():
                raw = t.view(torch.int16)
                raw.copy_(torch.randint(-32768, 32768, raw.shape, dtype=torch.int16, device=dev,
                                        generator=g))
            torch.cuda.synchronize(dev)
            out({})
        elif cmd == "sums":
            # Per (layer, K/V, block): position-weighted sum of its 8-byte words.
            res = []
            for t in kv.values():
                words = t.view(torch.int64).reshape(2, a.blocks, -1)
                wts = (torch.arange(1, words.shape[2] + 1, dtype=torch.int64, device=dev)
                       * 2654435761) | 1
                res.append((words * wts).sum(dim=2).tolist())
            out({"sums": res})
        elif cmd == "publish":
            meta = MooncakeConnectorMetadata(publishes=[PublishSpec(
                req["req_id"], req["tokens"], req["block_ids"])], held=[req["req_id"]])
            w.on_metadata(meta)
            w.publish(meta)
            out({})
        elif cmd == "finished":
            snd, rcv = w.get_finished(set(req.get("req_ids", [])))
            out({"sending": sorted(snd or []), "recving": sorted(rcv or [])})
        elif cmd == "load":
            rid = req["req_id"]
            meta = MooncakeConnectorMetadata(loads=[LoadSpec(
                rid, req["tokens"], req["block_ids"], 0, None)])
            t0 = time.monotonic()
            w.on_metadata(meta)
            w.start_load(meta)
            done = False
            while not done and time.monotonic() - t0 < 90:  # vLLM polls once per step
                _snd, rcv = w.get_finished(set())
                done = bool(rcv and rid in rcv)
                if not done:
                    time.sleep(0.0005)
            if not done:
                out({"error": "load did not finish in 90 s"})
                continue
            stats = w.take_stats()
            out({"secs": time.monotonic() - t0, "invalid": sorted(w.take_invalid_blocks()),
                 "stats": stats.data if stats is not None and hasattr(stats, "data") else {}})
        elif cmd == "push_load":
            rd = bool(req.get("layer_read"))
            meta = MooncakeConnectorMetadata(loads=[LoadSpec(
                req["req_id"], req["tokens"], req["block_ids"], 0, None, flow="P",
                push_tid=req["tid"], sync=rd, layer_load=rd, layer_read=rd)])
            w.on_metadata(meta)
            w.start_load(meta)  # sends the target (our blocks) to the producer
            out({})
        elif cmd == "layer_wait":
            t0, waited = time.monotonic(), {}
            for i, name in enumerate(kv):
                w.wait_for_layer_load(name)
                waited[i] = time.monotonic() - t0
            out({"waited": waited})
        elif cmd == "engine_stats":
            out(w.engine.get_stats())
        elif cmd == "load_errors":
            out({"invalid": sorted(w.take_invalid_blocks())})
        elif cmd == "push_forward":
            out(push_forward(w, kv, dev, req))
        else:
            out({"error": f"unknown command {cmd}"})
    w.shutdown()
    del keep


if __name__ == "__main__":
    main()
