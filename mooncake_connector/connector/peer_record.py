"""The fingerprint each worker publishes so the other side can check, at first
contact and before any block moves, that the two instances can exchange
blocks: model shape, KV dtype, KV layout, block size, TP/PP, KV-cache groups,
connector version.  Key: mooncake/kvconnector/<engine name>, in the metadata
server of mooncake.json (nothing is published in P2PHANDSHAKE mode: then the
consumer assumes the producer's TP size equals its own, and a wrong guess
shows as a load error naming the extent sizes).

Different TP sizes are not a mismatch when tp_map can map the KV heads;
check() returns the consumer rank's read plan then.
"""
import json

from mooncake_connector import json_in
from mooncake_connector.connector import tp_map

KEY = "mooncake/kvconnector/{name}"
VERSION = 2  # the record's format; 1 had no fingerprint (tp_size, block layout only)

# field: how to make the two sides agree
_SAME = {
    "pp_size": "start both instances with the same --pipeline-parallel-size",
    "block_size": "start both instances with the same --block-size",
    "kv_dtype": "use the same --dtype / --kv-cache-dtype on both sides",
    "mla": "serve the same model on both sides (one uses MLA, the other does not)",
    "kv_heads": "serve the same model on both sides",
    "head_size": "serve the same model on both sides",
    "layers": "serve the same model on both sides",
    "groups": "serve the same model with the same hybrid KV-cache setting on both sides "
              "(--disable-hybrid-kv-cache-manager on both or neither)",
}


def make(role, tp_rank, tp_size, layout, block_size, facts=None, dp_local=0):
    """This worker's record.  facts: model facts from the vLLM config
    (connector.model_facts), None in tools that have none.  dp_local: the
    engine's index among its server's vLLM data-parallel engines (a flow-A
    consumer's probe finds a producer's engines by it: probe.py)."""
    f = dict(facts or {})
    return {"version": VERSION, "role": role, "tp_rank": tp_rank, "tp_size": tp_size,
            "dp_local": dp_local,
            "block_size": block_size, "extents_per_block": layout.extents_per_block,
            "bytes_per_block": layout.bytes_per_block(), "layers": len(layout.layers),
            "extent_bytes": [L.block_bytes for L in layout.layers],
            "outer": [len(L.outer) for L in layout.layers],
            "layout": getattr(layout, "head_order", tp_map.UNKNOWN),
            "model": f.get("model"), "kv_dtype": f.get("kv_dtype"),
            "kv_heads": f.get("kv_heads"), "head_size": f.get("head_size"),
            "mla": bool(f.get("mla", False)), "pp_size": f.get("pp_size", 1),
            "groups": f.get("groups"), "connector": f.get("connector")}


def _sides(mine, theirs):
    p, d = (theirs, mine) if mine.get("role") == "kv_consumer" else (mine, theirs)
    return (f"prefill: TP {p.get('tp_size')}, PP {p.get('pp_size', 1)}, block size "
            f"{p.get('block_size')}, KV {p.get('kv_dtype')}; decode: TP {d.get('tp_size')}, "
            f"PP {d.get('pp_size', 1)}, block size {d.get('block_size')}, KV "
            f"{d.get('kv_dtype')}")


def check(mine, theirs, their_name, consumer_rank=None):
    """(error sentence or None, tp_map.Plan or None).  mine/theirs: records;
    the plan maps producer ranks to consumer ranks (prefill side = the one
    whose role is not kv_consumer)."""
    if not theirs:
        return None, None
    who = f"{their_name} ({theirs.get('role')}, connector {theirs.get('connector')})"
    if theirs.get("version", 1) < VERSION:
        if theirs.get("tp_size") != mine["tp_size"]:
            return (f"{who} has tp_size={theirs.get('tp_size')} but this instance has "
                    f"tp_size={mine['tp_size']}, and its connector is too old to map different "
                    f"TP sizes: upgrade mooncake-connector there"), None
        return None, None
    for k, fix in _SAME.items():
        a, b = mine.get(k), theirs.get(k)
        if a is not None and b is not None and a != b:
            return (f"{who} has {k}={b} but this instance has {k}={a}: {fix} "
                    f"({_sides(mine, theirs)})"), None
    consumer_is_me = mine.get("role") == "kv_consumer"
    prod, cons = (theirs, mine) if consumer_is_me else (mine, theirs)
    heads = mine.get("kv_heads")
    if heads is None:  # a tool without model facts: only rank r -> rank r
        if prod["tp_size"] != cons["tp_size"]:
            return (f"{who} has tp_size={prod['tp_size'] if consumer_is_me else cons['tp_size']}"
                    f" but this instance has tp_size={mine['tp_size']} and does not know the "
                    f"model's KV heads to map them"), None
        heads = mine["tp_size"]
    # Slicing heads needs them outermost on both sides; whole extents move anyway.
    lay = mine.get("layout") if mine.get("layout") == theirs.get("layout") else tp_map.UNKNOWN
    try:
        pl = tp_map.plan(prod["tp_size"], cons["tp_size"], heads, mla=bool(mine.get("mla")))
        ranks = [consumer_rank] if consumer_rank is not None else range(cons["tp_size"])
        pe, ce = prod.get("extent_bytes") or [], cons.get("extent_bytes") or []
        if len(pe) != len(ce):
            return (f"{who} has {len(pe)} KV layers but this instance has {len(ce)}: serve the "
                    f"same model on both sides"), None
        for d in ranks:
            for a, b in zip(pe, ce):
                tp_map.pieces(pl, d, a, b, lay or tp_map.UNKNOWN)
    except tp_map.TPMapError as e:
        return f"{who} cannot exchange KV with this instance: {e}", None
    return None, pl


def publish(client, name, record):
    client.put(KEY.format(name=name), json.dumps(record))


def fetch(client, name):
    raw = client.get(KEY.format(name=name))
    if not raw:
        return None
    try:
        return json_in.loads(raw)
    except ValueError:
        return None


def dp_engines(client, base, max_dp=64):
    """Base names of the vLLM data-parallel engines of the server whose first
    engine is `base` (itself first): engine k's rank-0 record, at base +
    k * tp_size * pp_size (settings.dp_base), says dp_local k.  [base] when
    base publishes no record (not up yet, or P2P handshake: nothing is
    published).  Raises the client's errors."""
    from mooncake_connector.connector.settings import shift_port
    found = [base]
    rec = fetch(client, base)
    if not rec:
        return found
    stride = int(rec.get("tp_size") or 1) * int(rec.get("pp_size") or 1)
    role = rec.get("role")
    for k in range(1, max_dp):
        try:
            b = shift_port(base, k * stride)
        except ValueError:  # past the last port
            break
        r = fetch(client, b)
        if not r or r.get("dp_local") != k or r.get("role") != role:
            break
        found.append(b)
    return found
