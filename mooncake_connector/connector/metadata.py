"""What the scheduler-side connector tells the worker-side connector, once per
step (pickled inside vLLM's SchedulerOutput)."""
from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # vLLM absent: the dataclasses still work (unit tests, tools)
    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass


@dataclass
class LoadSpec:
    """Consumer: pull the prompt's full blocks [skip_blocks, n) from a producer."""
    req_id: str
    tokens: list          # the prompt's first n full blocks of token ids
    block_ids: list       # local block ids for blocks skip_blocks..n-1
    skip_blocks: int      # blocks already computed locally (prefix cache)
    producer: str | None  # producer base engine name; None = the configured prefill_url
    flow: str = "A"       # "A" (token hashes, configured producer) or "B" (kv_transfer_params)
    sync: bool = False    # load inside this step (vLLM schedules the request now)
    producer_tp: int | None = None  # flow B: the producer's TP size from its params
    more_groups: list = field(default_factory=list)  # HMA: block ids of KV-cache groups 1..
    push_tid: str | None = None  # flow "P" (push): the transfer id both legs carry
    layer_load: bool = False  # push, in this step: attention waits per layer (push_layer_load)
    layer_read: bool = False  # layer load: the decode READs each announced layer (push_layer_read)


@dataclass
class PublishSpec:
    """Producer: the prompt's full blocks are computed; make them available."""
    req_id: str
    tokens: list          # token ids of the full blocks
    block_ids: list       # local block ids of those blocks
    more_groups: list = field(default_factory=list)  # HMA: block ids of KV-cache groups 1..
    push_tid: str | None = None  # push: written into the consumer's blocks, not published
    layerwise: bool | None = None  # push: per-request override of push_layerwise
    watch: bool | None = None      # push: per-request override of push_layer_watch
    push_optional: bool = False  # a bare transfer_id: published for a pull as well, pushed
                                 # if a decode side sends a target (the in-tree shape)


@dataclass
class MooncakeConnectorMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)        # LoadSpec
    publishes: list = field(default_factory=list)    # PublishSpec
    held: list = field(default_factory=list)         # req ids whose blocks the connector holds
    unpublish: list = field(default_factory=list)    # req ids preempted after publishing
    push_dropped: list = field(default_factory=list)  # push transfer ids ended without KV
    # consumer: (transfer id, producer, producer_tp) of push requests that end
    # without a target sent (the producers are told: a cancel)
    push_gone: list = field(default_factory=list)
    # consumer, flows A/B: (tokens, producer, producer_tp) of prompts it will
    # not pull (in its prefix cache): the producers are told to free them
    releases: list = field(default_factory=list)
    # producer: (req id, full-block tokens, X-Request-Id; each or None) of prompts no
    # consumer will pull (the proxy's release: no decode leg followed):
    # one pull's worth of their lookup entries consumed on every rank
    drops: list = field(default_factory=list)
    idle: bool = False  # the step schedules no tokens (producer: may wait for releases)
    load_errors: list = field(default_factory=list)  # consumer: block ids to report failed
                                                     # again (SchedulerSide.on_load_errors)
