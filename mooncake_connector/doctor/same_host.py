"""same-host: whether two engines on this host can use the same-host CPU path
(cross-memory attach), probed with a real process_vm_readv."""
from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys

from .hosts import _read
from .report import OK, SKIP, WARN


# Run in another process: reads `n` bytes at `addr` in its PARENT (not its
# descendant, as a peer engine is not) with process_vm_readv, the call the
# same-host CPU path copies with; prints them in hex, or "errno N".
_CMA_PROBE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
f = libc.process_vm_readv
f.restype = ctypes.c_ssize_t
f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
              ctypes.c_ulong]
n = int(sys.argv[2])
buf = ctypes.create_string_buffer(n)
loc, rem = iovec(ctypes.addressof(buf), n), iovec(int(sys.argv[1]), n)
got = f(os.getppid(), ctypes.byref(loc), 1, ctypes.byref(rem), 1, 0)
print(buf.raw.hex() if got == n else "errno %d" % ctypes.get_errno())
"""


def _ptrace_scope():
    try:
        return int(_read("/proc/sys/kernel/yama/ptrace_scope", "-1").strip() or -1)
    except ValueError:
        return -1


def check_same_host(rep, cfg):
    """Can two engines on this host use the same-host CPU path (cross-memory
    attach)?  A real process_vm_readv from another process, as the engine
    does; off switches and the kernel's ptrace policy explain a no."""
    env = os.environ.get("MC_SAME_HOST_CPU")
    if env and env.lower() in ("0", "false", "off", "no"):
        rep.add("same-host", "cpu", SKIP, f"switched off (MC_SAME_HOST_CPU={env}): engines on "
                "this host move host memory over the network path (TCP/RDMA)")
        return
    if env and env.lower() not in ("1", "true", "on", "yes"):
        # The engine warns and keeps the path on (as unset).
        rep.add("same-host", "switch", WARN, f"MC_SAME_HOST_CPU={env[:40]!r} is neither on (1, "
                "true, on, yes) nor off (0, false, off, no): engines ignore it (with a warning) "
                "and keep the same-host CPU path on; set MC_SAME_HOST_CPU=0 to switch it off")
    if cfg and cfg.get("same_host_cpu") is False:
        rep.add("same-host", "cpu", SKIP, "switched off in mooncake.json (\"same_host_cpu\": "
                "false): engines on this host move host memory over the network path")
        return
    data = os.urandom(32)
    buf = ctypes.create_string_buffer(data, len(data))
    try:
        r = subprocess.run([sys.executable, "-c", _CMA_PROBE, str(ctypes.addressof(buf)),
                            str(len(data))], capture_output=True, text=True, timeout=30)
        out = r.stdout.strip() or r.stderr.strip()[-200:]
    except (OSError, subprocess.SubprocessError) as e:
        out = f"probe did not run: {e}"
    if out == data.hex():
        rep.add("same-host", "cpu", OK, "cross-memory attach works (process_vm_readv from "
                "another process): engines on this host move host-memory KV without sockets")
        return
    scope = _ptrace_scope()
    fix = "nothing needed for correctness: TCP is used (docs/doctor.md, \"same-host\")"
    if out.startswith("errno "):
        e = int(out.split()[1])
        if e == errno.ENOSYS:
            why = "process_vm_readv is not available (kernel without CONFIG_CROSS_MEMORY_ATTACH)"
        elif e == errno.EPERM and scope > 0 and os.geteuid() != 0:
            why = (f"kernel.yama.ptrace_scope is {scope}: a process may not read another "
                   "one's memory (cross-memory attach needs 0, or CAP_SYS_PTRACE)")
            fix = ("`sysctl -w kernel.yama.ptrace_scope=0` (persist it in /etc/sysctl.d/), or "
                   "give the vLLM processes CAP_SYS_PTRACE; TCP is used meanwhile")
        elif e == errno.EPERM:
            why = ("process_vm_readv is refused (EPERM): a seccomp profile (containers: Docker's "
                   "default blocks it without CAP_SYS_PTRACE) or the process is not dumpable")
            fix = ("run the container with --cap-add SYS_PTRACE (or a seccomp profile allowing "
                   "process_vm_readv/writev); TCP is used meanwhile")
        else:
            why = f"process_vm_readv failed: {os.strerror(e)}"
    else:
        why = f"the probe read the wrong bytes or did not run ({out})"
    rep.add("same-host", "cpu", WARN, f"the same-host CPU path is unusable here: {why}; "
            "engines on this host use the network path (TCP/RDMA) instead", fix)
