"""Issue 30's rows for NIXL: the same cases as benchmarks/gpu_fixed_cost_bench.py
(two processes on cuda:0, 1 GiB buffers, shuffled 64 KiB / 2 MiB blocks in
batches of 128 / 1024, each batch waited for before the next ("seq") or all
batches of a pass in flight ("pipe"), 4 KiB round trips), moved by NIXL's
Python API the way vLLM's NixlConnector uses it (prep_xfer_dlist once,
make_prepped_xfer + transfer per batch, polled with check_xfer_state), with
torch's own on-GPU copy of the same shuffled blocks (index_copy_, one call)
measured in the same process as the reference.  Bytes are checked after
every case (the target compares its buffer with the expected blocks).

    python benchmarks/gpu_nixl_bench.py [--passes 5] [--iters 2000]
        [--backend UCX] [--out nixl.json]

NIXL comes from its wheel (nixl-cu13 / nixl-cu12 on PyPI; the GPU machine
gets it carried, docs/device.md).  UCX picks its transports itself
(cuda_ipc for GPU memory of two processes on one host); set UCX_TLS to
force others.
"""
import argparse
import importlib
import json
import multiprocessing as mp
import statistics
import sys
import time

GiB = 1 << 30
# --cpu (a smoke test of this script where no GPU is): host memory, DRAM.
DEV, MEM = "cuda:0", "VRAM"
SIZES = (65536, 2 << 20)
CASES = (("seq", 128), ("pipe", 128), ("seq", 1024), ("pipe", 1024))


def _nixl():
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        try:
            return importlib.import_module(name + "._api")
        except ImportError:
            continue
    raise SystemExit("NIXL is not installed: pip install nixl-cu13 (or nixl-cu12 for CUDA 12)")


def _agent(name, backend):
    api = _nixl()
    return api, api.nixl_agent(name, api.nixl_agent_config(backends=[backend]))


def _sync():
    import torch
    if DEV != "cpu":
        torch.cuda.synchronize()


def _setup(cpu):
    global DEV, MEM, GiB
    if cpu:
        DEV, MEM, GiB = "cpu", "DRAM", 64 << 20
    else:
        import torch
        torch.cuda.set_device(0)


def _fill(buf, seed):
    import torch
    g = torch.Generator(device=buf.device)
    g.manual_seed(seed)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device=buf.device,
                            generator=g))


def _perm(n, seed):
    import torch
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randperm(n, generator=g)


def target(conn, backend, cpu):
    """Holds the 1 GiB the initiator writes into / reads from, and checks it."""
    import torch
    _setup(cpu)
    buf = torch.empty(GiB, dtype=torch.uint8, device=DEV)
    _, agent = _agent("target", backend)
    agent.register_memory([buf])
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            break
        if msg[0] == "fill":  # before a READ: the blocks to be read
            _fill(buf, msg[1])
            _sync()
            conn.send("ok")
        elif msg[0] == "check":  # after a WRITE: dst[perm[i]] == src[i]
            _, bb, seed, pseed = msg
            n = GiB // bb
            want = torch.empty_like(buf)
            _fill(want, seed)
            perm = _perm(n, pseed).to(DEV)
            ok = torch.equal(buf.view(n, bb).index_select(0, perm), want.view(n, bb))
            del want
            buf.zero_()
            _sync()
            conn.send(bool(ok))


def _wait(agent, handles):
    for h in handles:
        while True:
            s = agent.check_xfer_state(h)
            if s == "DONE":
                break
            if s == "ERR":
                raise RuntimeError("NIXL transfer failed")
    for h in handles:
        agent.release_xfer_handle(h)


def _pass(agent, op, loc, rem, perm, batch, mode):
    """One pass over all blocks; returns seconds."""
    import numpy as np
    n = len(perm)
    idx = np.arange(n, dtype=np.int32)
    rperm = perm.numpy().astype(np.int32)
    t0 = time.perf_counter()
    pending = []
    for k in range(0, n, batch):
        h = agent.make_prepped_xfer(op, loc, idx[k:k + batch], rem, rperm[k:k + batch])
        if agent.transfer(h) == "ERR":
            raise RuntimeError("NIXL transfer failed to post")
        if mode == "seq":
            _wait(agent, [h])
        else:
            pending.append(h)
    _wait(agent, pending)
    return time.perf_counter() - t0


def _torch_rows(src, passes, iters):
    import torch
    dst = torch.empty_like(src)
    rows = {}
    a, b = src[:4096], dst[8192:8192 + 4096]
    for _ in range(200):
        b.copy_(a)
        _sync()
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        b.copy_(a)
        _sync()
        t.append((time.perf_counter() - t0) * 1e6)
    rows["4k_p50_us"] = statistics.median(t)
    for bb in SIZES:
        n = GiB // bb
        perm = _perm(n, bb).to(src.device)
        best = None
        for dt, es in ((torch.uint8, 1), (torch.int64, 8)):
            s2, d2 = src.view(dt).view(n, bb // es), dst.view(dt).view(n, bb // es)
            for i in range(passes + 1):
                _sync()
                t0 = time.perf_counter()
                d2.index_copy_(0, perm, s2)
                _sync()
                dt_s = time.perf_counter() - t0
                if i and (best is None or dt_s < best):
                    best = dt_s
        rows[f"{bb}_one_GBps"] = GiB / best / 1e9
    del dst
    return rows


def initiator(args):
    import torch
    _setup(args.cpu)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, args.backend, args.cpu), daemon=True)
    proc.start()
    out = {"nixl": {}, "torch": {}}
    try:
        meta, raddr = conn.recv()
        src = torch.empty(GiB, dtype=torch.uint8, device=DEV)
        _fill(src, 1)
        out["torch"] = _torch_rows(src, args.passes, args.iters)
        api, agent = _agent("initiator", args.backend)
        agent.register_memory([src])
        peer = agent.add_remote_agent(meta)
        laddr = src.data_ptr()
        # Metadata may take a moment to be usable; the first prep retries.
        for bb in SIZES:
            n = GiB // bb
            loc = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                        [(laddr + i * bb, bb, 0) for i in range(n)], MEM)
            rem = agent.prep_xfer_dlist(peer, [(raddr + i * bb, bb, 0) for i in range(n)],
                                        MEM)
            perm = _perm(n, bb)
            for op in ("WRITE", "READ"):
                for mode, batch in CASES:
                    if op == "READ":
                        conn.send(("fill", 2))
                        conn.recv()
                    _pass(agent, op, loc, rem, perm, batch, mode)  # warm-up
                    best = min(_pass(agent, op, loc, rem, perm, batch, mode)
                               for _ in range(args.passes))
                    if op == "WRITE":
                        conn.send(("check", bb, 1, bb))
                        ok = conn.recv()
                    else:
                        want = torch.empty_like(src)
                        _fill(want, 2)
                        ok = torch.equal(src.view(n, bb),
                                         want.view(n, bb).index_select(0, perm.to(DEV)))
                        del want
                        _fill(src, 1)
                    if not ok:
                        raise SystemExit(f"wrong bytes: NIXL {op} {bb} {mode} {batch}")
                    gbps = GiB / best / 1e9
                    out["nixl"][f"{bb}_{mode}{batch}_{op}_GBps"] = gbps
                    print(f"NIXL {op:5} {bb >> 10:5} KiB x{batch:<5} {mode:4}: {gbps:8.1f} GB/s"
                          f" = {gbps / out['torch'][f'{bb}_one_GBps']:.3f}x torch one call",
                          flush=True)
            agent.release_dlist_handle(loc)
            agent.release_dlist_handle(rem)
        # 4 KiB round trips: one prepared 4 KiB transfer re-posted.
        loc = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(laddr, 4096, 0)], MEM)
        rem = agent.prep_xfer_dlist(peer, [(raddr + 8192, 4096, 0)], MEM)
        for op in ("WRITE", "READ"):
            h = agent.make_prepped_xfer(op, loc, [0], rem, [0])
            t = []
            for i in range(200 + args.iters):
                t0 = time.perf_counter()
                s = agent.transfer(h)
                while s == "PROC":
                    s = agent.check_xfer_state(h)
                if s != "DONE":
                    raise RuntimeError("NIXL 4 KiB transfer failed")
                if i >= 200:
                    t.append((time.perf_counter() - t0) * 1e6)
            agent.release_xfer_handle(h)
            out["nixl"][f"4k_{op}_p50_us"] = statistics.median(t)
            print(f"NIXL {op:5} 4 KiB round trip p50 {statistics.median(t):.1f} us "
                  f"(torch copy_+sync {out['torch']['4k_p50_us']:.1f} us)", flush=True)
        out["nixl_version"] = getattr(api, "__version__", None) or _version()
    finally:
        conn.send(("quit",))
        proc.join(30)
    for bb in SIZES:
        print(f"torch index_copy_ one call, {bb >> 10} KiB blocks: "
              f"{out['torch'][f'{bb}_one_GBps']:.1f} GB/s")
    return out


def _version():
    from importlib import metadata
    for name in ("nixl-cu13", "nixl-cu12", "nixl"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--backend", default="UCX")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true",
                    help="smoke-test the script on host memory (64 MiB, DRAM), no GPU")
    args = ap.parse_args(argv)
    out = initiator(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
