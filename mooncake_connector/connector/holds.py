"""Blocks a consumer keeps from vLLM's reuse after their push load ended
(push.PushConsumer._hold): the load's same-host producer process may still
copy into them itself and has not answered.  The worker tells the scheduler
side through vLLM's worker -> scheduler channel (build_connector_worker_meta,
HoldEvents); the scheduler side (BlockHolds) takes one reference on each
such block in vLLM's block pool, so neither the request's end, its failed
load's free nor a preemption puts the block back in the free queue, and
drops it once every worker rank that held it let go.  docs/connector.md,
"The lease"."""
import logging

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # a vLLM without the channel: the holds stay worker-side only
    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        pass

logger = logging.getLogger("vllm.mooncake_connector")


class HoldEvents(KVConnectorWorkerMetadata):
    """One step's hold events of the workers: (worker, "hold", req_id,
    [block ids per KV-cache group]) / (worker, "release", req_id)."""

    def __init__(self, events=None):
        self.events = list(events or ())

    def aggregate(self, other):
        if isinstance(other, HoldEvents):
            self.events.extend(other.events)
        return self

    def __reduce__(self):
        return (HoldEvents, (self.events,))


class BlockHolds:
    """Scheduler side: the references held, req_id -> (blocks, worker ranks
    holding them)."""

    def __init__(self, kvm_getter):
        self._kvm = kvm_getter
        self.held = {}

    def __len__(self):
        return len(self.held)

    def _blocks(self, groups):
        kvm = self._kvm()
        if kvm is None:
            return None
        out = []
        coord = getattr(kvm, "coordinator", None)
        managers = getattr(coord, "single_type_managers", None)
        for gi, ids in enumerate(groups):
            pool = getattr(managers[gi], "block_pool", None) if managers and \
                gi < len(managers) else kvm.block_pool
            if pool is None:
                pool = kvm.block_pool
            for b in ids:
                if isinstance(b, int) and 0 < b < len(pool.blocks):
                    blk = pool.blocks[b]
                    if not getattr(blk, "is_null", False):
                        out.append(blk)
        return out

    def on_events(self, meta):
        for ev in getattr(meta, "events", None) or ():
            try:
                worker, kind, rid = ev[0], ev[1], ev[2]
                if kind == "hold":
                    self._hold(worker, rid, ev[3])
                elif kind == "release":
                    self._release(worker, rid)
            except Exception as e:  # noqa: BLE001 - never fail vLLM's step over it
                logger.error("MooncakeConnector: hold event %r not applied: %s", ev[:3], e)

    def _hold(self, worker, rid, groups):
        ent = self.held.get(rid)
        if ent is not None:
            ent[1].add(worker)
            return
        blocks = self._blocks(groups)
        if blocks is None:
            logger.error("MooncakeConnector: no KV-cache manager: the blocks of %s (its "
                         "same-host producer has not answered) cannot be held", rid)
            return
        kvm = self._kvm()
        for blk in blocks:  # one reference more: not in the free queue while held
            (getattr(blk, "pool", None) or kvm.block_pool).touch([blk])
        self.held[rid] = (blocks, {worker})

    def _release(self, worker, rid):
        ent = self.held.get(rid)
        if ent is None:
            return
        ent[1].discard(worker)
        if ent[1]:
            return
        del self.held[rid]
        self._kvm().block_pool.free_blocks(ent[0])  # each to its own pool
