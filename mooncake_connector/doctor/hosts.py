"""What doctor's checks ask of this host: its addresses, names, routes and
sysfs files."""
from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import socket
import struct
import subprocess

from mooncake_connector.hostport import join_hostport


_hp = join_hostport


def _split_hp(s):
    """(host, port) of "host:port" / "[v6]:port"; ValueError naming what is
    wrong unless the port is 1..65535 in ASCII digits (int() took "+80",
    " 80", "8_0" and non-ASCII digits)."""
    if s.startswith("["):
        host, _, port = s[1:].partition("]:")
    else:
        host, _, port = s.rpartition(":")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"port {port!r} is not a number in 1..65535")
    return host, int(port)


def _resolve(host):
    try:
        return sorted({ai[4][0] for ai in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except socket.gaierror:
        return []


def _local_addrs():
    """{address: interface} of this host (ip -j addr, else ioctl for IPv4)."""
    out = {}
    try:
        res = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True,
                             timeout=5)
        for link in json.loads(res.stdout or "[]"):
            for a in link.get("addr_info", []):
                out[a["local"]] = link["ifname"]
        if out:
            return out
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                out[socket.inet_ntoa(raw[20:24])] = name
            except OSError:
                pass
    return out


def _route_src(host):
    """The source address this host would use towards host (a UDP connect
    sends nothing), or None."""
    for fam, _, _, _, sa in socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM):
        try:
            with socket.socket(fam, socket.SOCK_DGRAM) as s:
                s.connect(sa)
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def _is_loopback(addr):
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _read(path, default=""):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _sysfs():
    return os.environ.get("MC_DOCTOR_SYSFS", "/sys")
