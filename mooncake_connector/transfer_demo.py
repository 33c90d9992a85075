"""Two-process KV-cache transfer demo on the embedded default (no vLLM).

    python -m mooncake_connector.transfer_demo [--layers 32] [--blocks 512] [--block-kib 32]
    python -m mooncake_connector.demo --transfer-only [...]      (the same)

This process starts the embedded HTTP metadata server and plays the prefill
side; a second OS process plays the decode side.  Each side owns a paged KV
cache (per layer, a K and a V tensor of `blocks` blocks).  The prefill side
pushes the blocks of one prompt into the decode side's cache at different
block ids (as vLLM's block tables would map them) with batched WRITEs, the
decode side then checks every block byte for byte.  Prints bytes moved and
GB/s (1e9 bytes per second).
"""
import argparse
import ctypes
import json
import os
import random
import subprocess
import sys
import time
import zlib

import mooncake_connector as mc
from mooncake_connector.metadata_server import MetadataServer


def _kv_cache(layers, blocks, block_bytes, device="cpu"):
    """One contiguous allocation per layer for K and V, like vLLM's tensors
    (device "cuda": torch tensors on the current GPU, as vLLM's CUDA KV cache)."""
    if device == "cuda":
        import torch
        tensors = [torch.zeros(blocks * block_bytes, dtype=torch.uint8, device="cuda")
                   for _ in range(layers * 2)]
        return tensors, [t.data_ptr() for t in tensors]
    tensors = [(ctypes.c_ubyte * (blocks * block_bytes))() for _ in range(layers * 2)]
    return tensors, [ctypes.addressof(t) for t in tensors]


def _location(args):
    """The engine's memory location of the KV tensors (--device)."""
    return "cuda:0" if args.device == "cuda" else "cpu"


def _host_bytes(t):
    """A KV tensor's bytes in host memory (a CUDA tensor is copied out)."""
    if hasattr(t, "data_ptr"):
        return memoryview(t.cpu().numpy()).cast("B")
    return memoryview(t).cast("B")


def _fill_random(tensors, rng):
    for t in tensors:
        if hasattr(t, "data_ptr"):
            import torch
            t.copy_(torch.frombuffer(bytearray(rng.randbytes(t.numel())), dtype=torch.uint8))
        else:
            ctypes.memmove(t, rng.randbytes(len(t)), len(t))


def _block_crcs(tensors, block_ids, block_bytes):
    out = []
    for t in tensors:
        view = _host_bytes(t)
        out.append([zlib.crc32(view[b * block_bytes:(b + 1) * block_bytes]) for b in block_ids])
    return out


def run_decode(args):
    """The decode side: registers its KV cache, waits, verifies."""
    eng = mc.TransferEngine()
    eng.initialize(args.hostname, args.metadata, args.protocol, args.device_name)
    block_bytes = args.block_kib << 10
    tensors, addrs = _kv_cache(args.layers, args.blocks, block_bytes, args.device)
    eng.batch_register_memory(addrs, [args.blocks * block_bytes] * len(addrs), _location(args))
    print(json.dumps({"segment": eng.get_segment_name(), "addrs": addrs}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "verify":
            print(json.dumps(_block_crcs(tensors, req["blocks"], block_bytes)), flush=True)
        elif req["cmd"] == "exit":
            break
    eng.close()


class _External:
    """Stands in for the embedded server when the config names one."""

    def __init__(self, url):
        self.url = url

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_prefill(args):
    block_bytes = args.block_kib << 10
    decode_host = args.hostname
    same_host_cpu = True
    if args.config:
        cfg = mc.load_config(args.config)
        if cfg.get("notes"):
            print(f"config note: {cfg['notes']}")
        args.hostname, decode_host = cfg["prefill_url"], cfg["decode_url"]
        args.protocol, args.device_name = cfg["protocol"], cfg["device_name"]
        same_host_cpu = cfg["same_host_cpu"]  # the prefill (initiator) side decides
        server = _External(cfg["metadata_server"])
        print(f"config {cfg['origin']}: prefill {cfg['prefill_url']}, decode {cfg['decode_url']}, "
              f"metadata {cfg['metadata_server']}, protocol {cfg['protocol']}")
    else:
        server = MetadataServer(port=0)
    with server as meta:
        if not args.config:
            print(f"metadata server (embedded): {meta.url}")
        decode = subprocess.Popen(
            [sys.executable, "-m", "mooncake_connector.transfer_demo", "--role", "decode",
             "--metadata", meta.url, "--hostname", decode_host, "--protocol", args.protocol,
             "--device-name", args.device_name, "--layers", str(args.layers),
             "--blocks", str(args.blocks), "--block-kib", str(args.block_kib),
             "--device", args.device],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            # Run next to the package this process imported, so the child
            # imports the same (built) one rather than a source tree in cwd.
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(mc.__file__))))
        try:
            line = decode.stdout.readline()
            if not line:
                decode.wait(timeout=10)
                print("decode process failed to start (its error is above)", file=sys.stderr)
                return 1
            info = json.loads(line)
            eng = mc.TransferEngine()
            eng.initialize(args.hostname, meta.url, args.protocol, args.device_name,
                           same_host_cpu=same_host_cpu)
            tensors, addrs = _kv_cache(args.layers, args.blocks, block_bytes, args.device)
            eng.batch_register_memory(addrs, [args.blocks * block_bytes] * len(addrs),
                                      _location(args))
            print(f"prefill segment {eng.get_segment_name()} -> decode segment "
                  f"{info['segment']} (separate process, pid {decode.pid})")
            rng = random.Random(0)
            _fill_random(tensors, rng)  # the "computed" KV cache: random bytes
            if args.device == "cuda":
                import torch
                torch.cuda.synchronize()
            # A prompt occupying `prompt_blocks` blocks: prefill block ids and
            # the decode side's block ids are different permutations.
            n = args.prompt_blocks or args.blocks
            src_ids = rng.sample(range(args.blocks), n)
            dst_ids = rng.sample(range(args.blocks), n)
            src, dst, lens = [], [], []
            for layer_addr, peer_addr in zip(addrs, info["addrs"]):
                for s, d in zip(src_ids, dst_ids):
                    src.append(layer_addr + s * block_bytes)
                    dst.append(peer_addr + d * block_bytes)
                    lens.append(block_bytes)
            total = sum(lens)
            best = None
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                eng.batch_transfer_sync_write(info["segment"], src, dst, lens)
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
                print(f"  moved {total:,} bytes in {len(lens):,} blocks: "
                      f"{dt * 1e3:.1f} ms, {total / dt / 1e9:.2f} GB/s")
            want = _block_crcs(tensors, src_ids, block_bytes)
            decode.stdin.write(json.dumps({"cmd": "verify", "blocks": dst_ids}) + "\n")
            decode.stdin.flush()
            got = json.loads(decode.stdout.readline())
            ok = got == want
            shc = int(eng.get_stats().get("same_host_cpu_bytes_written", 0))
            summary = {"bytes": total, "blocks": len(lens), "best_seconds": best,
                       "best_GBps": total / best / 1e9, "verified": ok,
                       "same_host_cpu_bytes": shc}
            print(f"  {shc:,} of {total * args.repeat:,} bytes went through the same-host CPU "
                  "path (cross-memory attach; the rest over the network path"
                  + (", MC_SAME_HOST_CPU=0)" if os.environ.get("MC_SAME_HOST_CPU") == "0"
                     else ", \"same_host_cpu\": false)" if not same_host_cpu else ")"))
            print(("OK" if ok else "MISMATCH") +
                  f": {total / 2**20:.0f} MiB of KV cache ({args.layers} layers x K,V x {n} "
                  f"blocks of {args.block_kib} KiB) moved prefill -> decode; best "
                  f"{summary['best_GBps']:.2f} GB/s; every block verified byte for byte"
                  if ok else "MISMATCH: decode-side blocks differ from prefill-side blocks")
            if args.json:
                print(json.dumps(summary))
            eng.close()
            return 0 if ok else 1
        finally:
            if decode.poll() is None:
                try:
                    decode.stdin.write('{"cmd":"exit"}\n')
                    decode.stdin.flush()
                    decode.wait(timeout=10)
                except Exception:
                    decode.kill()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mooncake_connector.transfer_demo",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["prefill", "decode"], default="prefill")
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--metadata", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--protocol", default="tcp", help=argparse.SUPPRESS)
    ap.add_argument("--device-name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=512, help="blocks per KV tensor")
    ap.add_argument("--block-kib", type=int, default=32, help="bytes per block per tensor")
    ap.add_argument("--prompt-blocks", type=int, default=0,
                    help="blocks of the prompt to move (default: all)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="also print a JSON summary")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where both sides' KV caches live (cuda: GPU 0, torch tensors; the "
                         "engine picks the same-host GPU path, or TCP with GPU staging when "
                         "MC_GPU_IPC=0)")
    ap.add_argument("--config", default=None, metavar="PATH",
                    help="take prefill_url, decode_url and metadata_server from a "
                         "mooncake.json instead of the embedded default")
    args = ap.parse_args(argv)
    for name in ("layers", "blocks", "block_kib", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompt_blocks > args.blocks:
        ap.error("--prompt-blocks cannot exceed --blocks")
    if args.role == "decode":
        try:
            run_decode(args)
        except mc.MooncakeError as e:
            print(f"error (decode side): {e}", file=sys.stderr)
            return 2
        return 0
    try:
        return run_prefill(args)
    except mc.MooncakeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
