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

  python benchmarks/layer_gate_cost.py [--rounds 20] [--blocks 32] [--gpu-lag-ms 2] [--cpu]

--cpu: CPU KV caches (vLLM's CPU backend; no stand-in, no events): the
landing thread and the outbox telling each layer (push_layer_gate false)
against the engine sending the 'layer' notification with the layer's write
batch (true); also the harness process's CPU time per prompt (both sides
and every thread of this process: a paired difference, not a server's).
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(args):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_push_gate as tpg
    from vllm_harness import tiny_model_dir

    md = tiny_model_dir(tempfile.mkdtemp(prefix="mc-gate-bench-"))
    res = {False: {"save_s": [], "forward_s": [], "wake": [], "layers": 0, "cpu_s": 0.0,
                   "save_cpu_s": []},
           True: {"save_s": [], "forward_s": [], "wake": [], "layers": 0, "cpu_s": 0.0,
                   "save_cpu_s": []}}
    for rep in range(args.reps):
        for gate in (False, True) if rep % 2 == 0 else (True, False):
            tm = {}
            per, wakes, _, _ = tpg._layer_load_rounds(md, tpg._urls(), gate, rounds=args.rounds,
                                                      gpu_lag_s=args.gpu_lag_ms / 1e3,
                                                      blocks=args.blocks, timings=tm,
                                                      cuda=not args.cpu)
            r = res[gate]
            r["cpu_s"] += tm["cpu_s"]
            r["save_cpu_s"] += tm["save_cpu_s"]
            r["save_s"] += tm["save_s"]
            r["forward_s"] += tm["forward_s"]
            r["wake"].append(wakes["waiter"] + wakes["landing"] + wakes["outbox_layer"])
            r["layers"] += wakes["saves"]
    out = {}
    names = {False: "landing" if args.cpu else "waiter", True: "engine" if args.cpu else "gate"}
    for gate, r in res.items():
        name = names[gate]
        save = [x * 1e6 for x in r["save_s"]]
        fwd = [x * 1e3 for x in r["forward_s"]]
        scpu = [x * 1e6 for x in r["save_cpu_s"]]
        out[name] = (statistics.median(save), statistics.fmean(save), statistics.median(fwd),
                     sum(r["wake"]) / max(1, r["layers"]),
                     r["cpu_s"] * 1e3 / max(1, len(fwd)), statistics.median(scpu))
        print(f"{name:7s}: save_kv_layer p50 {out[name][0]:7.1f} us mean {out[name][1]:7.1f} us "
              f"(its thread's CPU p50 {out[name][5]:6.1f} us; {len(save)} calls); forward p50 "
              f"{out[name][2]:6.2f} ms ({len(fwd)} prompts); wake-ups/layer "
              f"{out[name][3]:.2f}; process CPU {out[name][4]:.2f} ms/prompt")
    g, w = out[names[True]], out[names[False]]
    print(f"ratio {names[True]}/{names[False]}: save_kv_layer p50 {g[0] / w[0]:.2f}, mean "
          f"{g[1] / w[1]:.2f}, its CPU p50 {g[5] / w[5]:.2f}, forward p50 {g[2] / w[2]:.2f}, "
          f"process CPU per prompt {g[4] / w[4]:.2f}")
    print("(the harness runs both sides in one process: the decode's thread and the "
          "prefill's forward share its GIL, unlike two servers; the CPU columns are the "
          "comparable ones)")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="prompts per run")
    ap.add_argument("--reps", type=int, default=4, help="runs per mode (alternating)")
    ap.add_argument("--blocks", type=int, default=32, help="full blocks per prompt (16 tokens)")
    ap.add_argument("--gpu-lag-ms", type=float, default=2.0,
                    help="each layer's event completes this long after its save")
    ap.add_argument("--cpu", action="store_true",
                    help="CPU KV caches: landing thread vs the engine-sent notification")
    ap.add_argument("--transport", choices=["tcp", "same-host"], default="tcp",
                    help="--cpu: TCP loopback (MC_SAME_HOST_CPU=0) or the same-host CPU path")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.cpu:
        env = dict(os.environ, MC_SAME_HOST_CPU="0" if args.transport == "tcp" else "1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                            *sys.argv[1:]], env=env)
        sys.exit(r.returncode)
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
