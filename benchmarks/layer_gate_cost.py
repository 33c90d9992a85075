"""What one layer costs the prefill's forward thread with CUDA KV caches:
the layer-event path (push_layer_gate false: a waiter thread, the landing
thread and the outbox thread each take the GIL per layer) against the
engine's gate (push_layer_gate true: one engine call per layer, no Python
thread woken), measured in the same run, alternating, on the CPU VM.

CUDA does not run here: the producer's "CUDA" events are the host-memory
libcuda stand-in's (tests/c/fakecuda.c; each layer's event completes
--gpu-lag-ms after its save_kv_layer), the harness is vLLM's real
scheduler with our real connector and engines over TCP
(tests/test_push_gate.py, tests/vllm_harness.py); push_layer_load rounds,
the decode's attention waiting per layer.  Prints per mode: the producer's
save_kv_layer per call (p50 / mean, microseconds), its forward per prompt
(p50, ms), the Python wake-ups per layer; and the ratios gate / waiter.

  python benchmarks/layer_gate_cost.py [--rounds 20] [--blocks 32] [--gpu-lag-ms 2]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(args):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_push_gate as tpg
    from vllm_harness import tiny_model_dir

    md = tiny_model_dir(tempfile.mkdtemp(prefix="mc-gate-bench-"))
    res = {False: {"save_s": [], "forward_s": [], "wake": [], "layers": 0},
           True: {"save_s": [], "forward_s": [], "wake": [], "layers": 0}}
    for rep in range(args.reps):
        for gate in (False, True) if rep % 2 == 0 else (True, False):
            tm = {}
            per, wakes, _, _ = tpg._layer_load_rounds(md, tpg._urls(), gate, rounds=args.rounds,
                                                      gpu_lag_s=args.gpu_lag_ms / 1e3,
                                                      blocks=args.blocks, timings=tm)
            r = res[gate]
            r["save_s"] += tm["save_s"]
            r["forward_s"] += tm["forward_s"]
            r["wake"].append(wakes["waiter"] + wakes["landing"] + wakes["outbox_layer"])
            r["layers"] += wakes["saves"]
    out = {}
    for gate, r in res.items():
        name = "gate" if gate else "waiter"
        save = [x * 1e6 for x in r["save_s"]]
        fwd = [x * 1e3 for x in r["forward_s"]]
        out[name] = (statistics.median(save), statistics.fmean(save), statistics.median(fwd),
                     sum(r["wake"]) / max(1, r["layers"]))
        print(f"{name:6s}: save_kv_layer p50 {out[name][0]:7.1f} us mean {out[name][1]:7.1f} us "
              f"({len(save)} calls); forward p50 {out[name][2]:6.2f} ms ({len(fwd)} prompts); "
              f"wake-ups/layer {out[name][3]:.2f}")
    g, w = out["gate"], out["waiter"]
    print(f"ratio gate/waiter: save_kv_layer p50 {g[0] / w[0]:.2f}, mean {g[1] / w[1]:.2f}, "
          f"forward p50 {g[2] / w[2]:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="prompts per run")
    ap.add_argument("--reps", type=int, default=4, help="runs per mode (alternating)")
    ap.add_argument("--blocks", type=int, default=32, help="full blocks per prompt (16 tokens)")
    ap.add_argument("--gpu-lag-ms", type=float, default=2.0,
                    help="each layer's event completes this long after its save")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("needs a C compiler (the libcuda stand-in is built first)")
    d = tempfile.mkdtemp(prefix="mc-fakecuda-")
    subprocess.run([cc, "-std=gnu11", "-O2", "-fPIC", "-shared", "-pthread",
                    "-Wl,-soname,libcuda.so.1", os.path.join(ROOT, "tests", "c", "fakecuda.c"),
                    "-o", os.path.join(d, "libcuda.so.1")], check=True)
    env = dict(os.environ, MC_TEST_FAKECUDA="1", MC_SAME_HOST_CPU="0",
               LD_LIBRARY_PATH=d + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:]],
                       env=env)
    shutil.rmtree(d, ignore_errors=True)
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
