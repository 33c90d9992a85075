"""rdma: libibverbs, each device of device_name, its ports ACTIVE, a usable GID,
the MTU (from sysfs; MC_DOCTOR_SYSFS points it elsewhere)."""
from __future__ import annotations

import ctypes
import os

from .hosts import _read, _sysfs
from .report import FAIL, OK, SKIP


def rdma_devices():
    base = os.path.join(_sysfs(), "class", "infiniband")
    try:
        return sorted(os.listdir(base))
    except OSError:
        return []


_IB_MTU = (256, 512, 1024, 2048, 4096)


def check_rdma(rep, cfg):
    present = rdma_devices()
    if cfg["protocol"] != "rdma":
        rep.add("rdma", "-", SKIP, "protocol tcp" + (f" (RDMA devices here: {', '.join(present)})"
                                                     if present else ""))
        return
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError as e:
        rep.add("rdma", "libibverbs", FAIL, f"cannot load libibverbs.so.1: {e}",
                "install the verbs library and providers (Debian/Ubuntu: apt-get install "
                "libibverbs1 ibverbs-providers; RHEL: dnf install rdma-core libibverbs)")
    else:
        rep.add("rdma", "libibverbs", OK, "libibverbs.so.1 loads")
    base = os.path.join(_sysfs(), "class", "infiniband")
    gid_override = os.environ.get("MC_GID_INDEX")
    if gid_override is not None and not gid_override.strip().isdigit():
        rep.add("rdma", "MC_GID_INDEX", FAIL, f"MC_GID_INDEX={gid_override!r} is not a number",
                "unset MC_GID_INDEX (the engine chooses) or set it to a GID index like 3")
        gid_override = None
    for dev in [d for d in cfg["device_name"].split(",") if d]:
        if dev not in present:
            rep.add("rdma", dev, FAIL, "no such RDMA device"
                    + (f" (present: {', '.join(present)})" if present else " (none on this host)"),
                    (f'set device_name to one of {", ".join(present)} (see `ibv_devices` or '
                     "`rdma link`)") if present else
                    'no RDMA NIC here: load its driver (`rdma link`, `ibv_devices`), or use '
                    '"protocol": "tcp"')
            continue
        try:
            ports = sorted(os.listdir(os.path.join(base, dev, "ports")), key=int)
        except (OSError, ValueError):
            ports = []
        for p in ports:
            pdir = os.path.join(base, dev, "ports", p)
            state = _read(os.path.join(pdir, "state"))
            layer = _read(os.path.join(pdir, "link_layer"), "?")
            item = f"{dev} port {p}"
            if not state.endswith("ACTIVE"):
                rep.add("rdma", item, FAIL, f"{layer}, state {state or '?'}"
                        f", physical {_read(os.path.join(pdir, 'phys_state'), '?')}",
                        "the port is not ACTIVE: check the cable/switch port and the subnet "
                        "manager (InfiniBand) or the netdev link (`ip link`, RoCE)")
                continue
            gids = []
            gdir = os.path.join(pdir, "gids")
            for g in sorted(os.listdir(gdir) if os.path.isdir(gdir) else [], key=int):
                v = _read(os.path.join(gdir, g))
                if v and set(v.replace(":", "")) != {"0"}:
                    typ = _read(os.path.join(pdir, "gid_attrs", "types", g))
                    gids.append((int(g), v, typ))
            if not gids:
                rep.add("rdma", item, FAIL, f"{layer}, ACTIVE, but its GID table is empty",
                        "give the netdev of this port an IP address (RoCE GIDs come from it)")
                continue
            if gid_override is not None and int(gid_override) not in [g[0] for g in gids]:
                rep.add("rdma", item, FAIL, f"MC_GID_INDEX={gid_override} is not a valid GID here"
                        f" (valid: {', '.join(str(g[0]) for g in gids)})",
                        "unset MC_GID_INDEX (the engine picks RoCE v2 IPv4 first) or use a "
                        "valid index")
                continue
            mtu = ""
            if layer == "Ethernet":
                nd = _read(os.path.join(pdir, "gid_attrs", "ndevs", str(gids[0][0])))
                nmtu = _read(os.path.join(_sysfs(), "class", "net", nd, "mtu")) if nd else ""
                if nmtu.isdigit():
                    roce = max([m for m in _IB_MTU if m <= int(nmtu) - 100] or [256])
                    mtu = f", netdev {nd} MTU {nmtu} (RoCE MTU {roce})"
                v2 = [g for g in gids if "v2" in g[2]]
                mtu += f", {len(gids)} GIDs ({len(v2)} RoCE v2)"
            else:
                mtu = f", {len(gids)} GIDs"
            rep.add("rdma", item, OK, f"{layer}, ACTIVE{mtu}")
        if not ports:
            rep.add("rdma", dev, FAIL, "device has no ports", "check the driver (`rdma link`)")
