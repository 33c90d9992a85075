"""The layout record each worker publishes so the other side can check, at
start-up, that the two instances can exchange blocks (same TP size, same
block layout).  Key: mooncake/kvconnector/<engine name>, in the metadata
server of mooncake.json (nothing is published in P2PHANDSHAKE mode; the
first load then reports a mismatch instead)."""
import json

KEY = "mooncake/kvconnector/{name}"


def make(role, tp_rank, tp_size, layout, block_size):
    return {"version": 1, "role": role, "tp_rank": tp_rank, "tp_size": tp_size,
            "block_size": block_size, "extents_per_block": layout.extents_per_block,
            "bytes_per_block": layout.bytes_per_block(), "layers": len(layout.layers)}


def mismatch(mine, theirs, their_name):
    """A sentence saying why the two cannot exchange KV, or None."""
    if not theirs:
        return None
    fixes = {
        "tp_size": "start both instances with the same --tensor-parallel-size (MooncakeConnector "
                   "pairs TP rank r with TP rank r)",
        "block_size": "start both instances with the same --block-size",
        "layers": "serve the same model on both sides",
        "extents_per_block": "serve the same model with the same KV-cache layout on both sides",
        "bytes_per_block": "use the same model, --dtype / --kv-cache-dtype and --block-size on "
                           "both sides",
    }
    for k, fix in fixes.items():
        if k in theirs and theirs[k] != mine[k]:
            return (f"{their_name} ({theirs.get('role')}) has {k}={theirs[k]} but this instance "
                    f"has {k}={mine[k]}: {fix}")
    return None


def publish(client, name, record):
    client.put(KEY.format(name=name), json.dumps(record))


def fetch(client, name):
    raw = client.get(KEY.format(name=name))
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None
