"""What the connector's hooks cost a producer per step, on vLLM's real
scheduler (tests/vllm_harness.py: the scheduler, our scheduler- and
worker-side connector with a real paged KV cache; the model's forward is a
stand-in, so only the connector's own time is measured).

    .venv/bin/python benchmarks/connector_hooks_bench.py [--requests 30] [--tokens 512]

Each request is a prompt of --tokens tokens with max_tokens=1 (a prefill
server's request), one per step; prints p50/max per hook.  The KV cache
holds --blocks blocks, so once held prompts fill it, steps have nothing to
schedule and get_finished shows the producer's idle wait (idle_wait_ms).
"""
import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

WORKER_HOOKS = ("bind_connector_metadata", "start_load_kv", "wait_for_save", "get_finished",
                "get_kv_connector_stats")
SCHED_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
               "request_finished")


def timed(obj, name, times):
    f = getattr(obj, name)

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            times.setdefault(name, []).append(time.perf_counter() - t)
    setattr(obj, name, g)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4096)
    args = ap.parse_args(argv)
    import random
    from vllm_harness import Side, make_request, tiny_model_dir

    from mooncake_connector.serving import free_port

    model = tiny_model_dir(tempfile.mkdtemp(prefix="mc-hooks-"))
    p = free_port()
    urls = {"prefill_url": f"127.0.0.1:{p}", "decode_url": f"127.0.0.1:{free_port(away=[p])}",
            "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}
    side = Side(model, "kv_producer", urls, num_blocks=args.blocks, block_size=16)
    times = {}
    for n in WORKER_HOOKS:
        timed(side.worker, n, times)
    for n in SCHED_HOOKS:
        timed(side.sched.connector, n, times)
    rng = random.Random(1)
    try:
        for i in range(args.requests):
            side.add(make_request(f"r{i}", [rng.randrange(3, 50000) for _ in range(args.tokens)],
                                  max_tokens=1))
            side.step()
    finally:
        side.close()
    total = 0.0
    for name in SCHED_HOOKS + WORKER_HOOKS:
        v = sorted(times.get(name, []))
        if not v:
            continue
        p50 = v[len(v) // 2]
        total += p50 * len(v) / args.requests
        print(f"{name:28s} calls {len(v):4d}  p50 {p50 * 1e6:8.1f} us  max {v[-1] * 1e6:8.1f} us")
    print(f"per request (p50 x calls per request, all hooks): {total * 1e6:.1f} us "
          f"({args.tokens}-token prompts, {args.requests} requests)")


if __name__ == "__main__":
    sys.exit(main())
