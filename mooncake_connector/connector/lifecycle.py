"""A worker's engine from start to close: the transfer engine under this
rank's name, the registered KV regions, the lookup buffer (producer), the
KVTransfer, the push flow's outbox and sides, the peer routes; the bootstrap
server of vLLM's in-tree contract (producer, TP 0 / PP 0).  Functions of the
WorkerSide (worker.py), which holds what they start.
"""
import json
import logging
import os
import sys

from mooncake_connector.connector import tp_map
from mooncake_connector.connector.layout import KVLayout
from mooncake_connector.connector.settings import dp_base, shift_port
from mooncake_connector.hostport import join_hostport

logger = logging.getLogger("vllm.mooncake_connector")


def start_bootstrap(w):
    """Producer, TP rank 0 of PP stage 0: the bootstrap server of vLLM's
    in-tree MooncakeConnector contract (bootstrap.py), naming every rank's
    engine.  Once per process: it outlives a sleep-mode restart of the
    engine (the names stay)."""
    if (not w.s.is_producer or w.tp_rank != 0 or w.pp_rank != 0
            or w.bootstrap is not None):
        return
    if w.dp_local:
        # vLLM data parallelism: the server's first engine serves the port
        # (vLLM's in-tree connector does the same); it names this engine too
        # where vLLM tells it how many there are (dp_count)
        return
    from mooncake_connector.connector import bootstrap
    base = w._base
    pp_size = int(w.facts.get("pp_size") or 1)
    w.bootstrap = bootstrap.start(
        w.s, shift_port(base, 0), w.dp_rank, w.tp_size, pp_size,
        lambda t, p: shift_port(base, p * w.tp_size + t), os.environ,
        dp_count=w.dp_count, dp_found=_dp_found(w, base))


def _dp_found(w, base):
    """() -> how many data-parallel engines of this server the metadata
    server knows (peer_record.dp_engines); None without one (P2P).  Its own
    metadata client, made at the first call (the bootstrap server calls it
    from its threads, one at a time)."""
    url = getattr(w, "_meta_url", None)
    if not url:
        return None
    from mooncake_connector.connector import peer_record
    client = []

    def found():
        if not client:
            from mooncake_connector import _core
            client.append(_core.MetadataClient(url))
        return len(peer_record.dp_engines(client[0], base))
    return found


def _layout(w):
    heads = w.facts.get("kv_heads")
    if heads and not w.facts.get("mla"):
        heads = tp_map.heads_per_rank(heads, w.tp_size)
    return KVLayout(w._kv_caches, w.num_blocks, heads=heads,
                    block_size=w.block_size, layer_groups=w.layer_groups)


def _name(w, cfg):
    """This engine's base address and this rank's engine name in it: the
    configured address, moved past the ranks of the server's previous
    data-parallel engines (settings.dp_base)."""
    if w.s.local_hostname:
        base = w.s.local_hostname
    elif w.s.role == "kv_consumer":
        base = join_hostport(cfg['decode_host'], cfg['decode_port'])
    else:
        base = join_hostport(cfg['prefill_host'], cfg['prefill_port'])
    # vLLM data parallelism inside one server: each engine its own ports
    base = dp_base(base, w.dp_local, w.tp_size, int(w.facts.get("pp_size") or 1))
    return base, shift_port(base, w.pp_rank * w.tp_size + w.tp_rank)


def _gil_switch_interval():
    """MC_GIL_SWITCH_US (experiment, issue 31): this worker process's GIL
    switch interval (Python's default 5000 us).  A thread of ours woken by
    the engine (the push outbox's sender, a pull's completion) waits for
    vLLM's forward thread to hand over the GIL up to that long."""
    v = os.environ.get("MC_GIL_SWITCH_US", "").strip()
    if not v:
        return
    if not v.isdigit() or not 50 <= int(v) <= 100000:
        logger.warning("MooncakeConnector worker: MC_GIL_SWITCH_US=%r is not a number of "
                       "microseconds in 50..100000; Python's switch interval kept", v)
        return
    sys.setswitchinterval(int(v) / 1e6)
    logger.info("MooncakeConnector worker: GIL switch interval %d us (MC_GIL_SWITCH_US)", int(v))


def start_engine(w):
    """Engine, registered KV regions, lookup buffer (producer), KVTransfer,
    for the addresses the KV cache tensors have now."""
    from mooncake_connector import _core  # the extension: workers only

    _gil_switch_interval()

    w.layout = _layout(w)
    text = json.dumps({k: v for k, v in w.s.mooncake.items() if v is not None})
    cfg = _core.parse_config(text, w.s.config_path or "kv_connector_extra_config")
    w._base, w.name = _name(w, cfg)
    w._meta_url = cfg["metadata_server"] if cfg.get("metadata_backend") != "p2p" else None
    w.default_producer = join_hostport(cfg['prefill_host'], cfg['prefill_port'])
    w.engine = eng = _core.TransferEngine()
    try:
        _start(w, eng, cfg, _core)
    except BaseException:
        # A refused start (a peer this instance cannot exchange KV with, a
        # region the engine refuses...) must not leave the engine listening on
        # this instance's port until the garbage collector finds it: a retry
        # in the same process (or the next test) would find the port taken.
        stop_engine(w)
        raise
    if w.tp_rank == 0 and w.pp_rank == 0:
        _log_start(w, cfg)


def _start(w, eng, cfg, _core):
    from mooncake_connector.connector import push
    from mooncake_connector.connector.routes import Routes

    # auth_secret None: the engine reads MC_AUTH_SECRET (docs/security.md).
    eng.initialize(w.name, cfg["metadata_server"], cfg["protocol"], cfg["device_name"],
                   auth_secret=cfg["auth_secret"] or None,
                   same_host_cpu=cfg["same_host_cpu"])
    for addr, n, dev in w.layout.regions():
        eng.register_memory(addr, n, dev)
    if w.s.is_producer:
        w.lb = _core.LookupBuffer(w.s.kv_buffer_size, block_size=w.block_size,
                                  mode="consume", policy="evict",
                                  ttl_s=w.s.hold_timeout_s,
                                  extents_per_block=w.layout.extents_per_block,
                                  track_freed=True)
    w.kv = _core.KVTransfer(eng, w.lb, workers=max(2, w.s.load_workers))
    w.push_outbox = push.Outbox(eng, describe=w.s.is_consumer)
    if w.s.is_consumer:
        w.push_c = push.PushConsumer(w)
    if w.s.role == "kv_producer":
        w.push_p = push.PushProducer(w)
    w.routes = Routes(w, cfg)
    w.routes.check_at_start(_core, cfg)
    if any(d.startswith("cuda") for d in w.layout.devices):
        import torch
        w.cuda_sync = torch.cuda.current_stream().synchronize


def _log_start(w, cfg):
    if w.dp_local or w.dp_rank:
        logger.info("MooncakeConnector worker: vLLM data-parallel engine %d of this server (DP "
                    "rank %d): its engines from %s", w.dp_local, w.dp_rank, w._base)
    logger.info("MooncakeConnector worker: engine %s (%s, metadata %s), %d layers, %d "
                "extents x %d bytes per block, %d blocks on %s", w.name,
                cfg["protocol"], cfg["metadata_server"], len(w.layout.layers),
                w.layout.extents_per_block, w.layout.layers[0].block_bytes,
                w.layout.num_blocks, ",".join(w.layout.devices))
    if w.layout.num_groups > 1:
        logger.info("MooncakeConnector worker: %d KV-cache groups %s (sliding-window "
                    "blocks outside the window are not moved)",
                    w.layout.num_groups, w.facts.get("groups"))


def stop_engine(w):
    """Close the push flow, the KVTransfer, the engine and the metadata client."""
    if w.push_p is not None:
        w.push_p.close()
    if w.push_c is not None:  # nothing of ours is written any more: held blocks go back
        w.push_c.release_all_holds()
        w.hold_events.extend(w.push_c.take_hold_events())
    if w.push_outbox is not None:
        w.push_outbox.close()
    w.push_outbox = w.push_c = w.push_p = None
    for obj in (w.kv, w.engine):
        if obj is not None:
            try:
                obj.close()
            except Exception:  # already closed
                pass
    if w.routes is not None:
        w.routes.close()
    w.kv = w.lb = w.engine = None


def unregister_for_sleep(w):
    """Before vLLM frees the KV cache memory.  Every load is over (vLLM
    drained them; any left are waited for, fenced), every published prompt
    is dropped and its request reported finished (its KV is about to be
    gone), and the engine is closed: its regions are unregistered, its
    segment unpublished, its connections closed, so every peer drops what it
    cached about our regions (address, RDMA keys, GPU IPC handles) and can
    only reach us again through a new connection, which carries the regions
    registered at wake-up.  Idempotent."""
    if w.engine is None:
        return
    w.loads.end_for_sleep()
    dropped = w.publishes.drop_all()
    name = w.name
    stop_engine(w)
    logger.info("MooncakeConnector worker: KV cache unregistered for sleep mode (engine %s "
                "closed, %d published prompts dropped)", name, dropped)


def restore_after_sleep(w):
    """After vLLM remapped the KV cache: register it where it is now, with a
    new engine under the same name (peers reconnect and learn these regions
    before their first transfer).  Idempotent."""
    if w.engine is not None or getattr(w, "_kv_caches", None) is None:
        return
    start_engine(w)
    logger.info("MooncakeConnector worker: KV cache registered again after sleep mode "
                "(engine %s, %d regions)", w.name, len(w.layout.regions()))
