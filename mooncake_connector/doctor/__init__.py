"""mooncake-connector doctor: checks a host's setup before the first request does.

    mooncake-connector doctor [--config mooncake.json] [--peer HOST:PORT] [--json]
                              [--role prefill|decode] [--tp N] [--pp N] [--dp N]
                              [--kv-transfer-config JSON] [--timeout S]
    mooncake-connector doctor --serve [--listen HOST:PORT] [--config mooncake.json]
    python -m mooncake_connector doctor ...            (the same)

Checks, in order (docs/doctor.md lists what each catches and the fix):
  config    each field of mooncake.json, through the package's own parser; with
            --kv-transfer-config, vLLM's flag with that file as a server's start
            takes them (mooncake_connector.config; its kv_role is --role's default)
  metadata  the metadata server: reach, put/get/delete of a scratch key, latency;
            on failure, what actually listens there (etcd, Redis, an HTTP
            metadata server, nothing) and the URL that would work
  auth      peer authentication: on or off, where the secret comes from, a short
            secret, a secret in both mooncake.json and MC_AUTH_SECRET that differ,
            engines on non-loopback addresses without a secret
  engine    this host's engine address (prefill_url or decode_url, whichever is
            an address here): an address of this host, on which interface, the
            port (and the next --tp x --pp x --dp - 1 ports: TP ranks, PP stages,
            vLLM data-parallel engines) free to bind, reachable by the peer
  rdma      (protocol rdma) libibverbs, each device of device_name present, its
            ports ACTIVE, a usable GID, the MTU
  gpu       CUDA GPUs and their GPUDirect capability (DMA-BUF, nvidia_peermem)
  vllm      the installed vLLM against the supported range, the plugin registered,
            the KV-cache access flags declared (>= 0.34), the model runner a GPU
            server runs (V2: no in-step loads under "recompute")
  peer      (--peer) a 64 MiB WRITE and READ against `doctor --serve` on the
            other host, byte-checked, with GB/s each way

Prints a table (or JSON with --json).  Exit status: 0 all checks passed (warnings
allowed), 1 at least one failed (each failure says how to fix it), 2 usage error.

One module a concern (report, hosts, config, metadata, auth, engine, rdma, gpu,
same_host, vllm_plugin, peer) and a runner; this package re-exports their names.
"""
from __future__ import annotations

# The one-module doctor.py's names, private helpers included, stay importable from here.
from .auth import MIN_SECRET_BYTES, _secret, check_auth
from .config import _mask, _raw_field, check_config
from .engine import _check_bind, check_engine
from .gpu import check_gpu
from .hosts import _hp, _is_loopback, _local_addrs, _read, _resolve, _route_src, _split_hp, _sysfs
from .metadata import (SLOW_METADATA_MS, _endpoints, _served_path, _url_for, check_metadata,
                       curl_proxy, diagnose_metadata, sniff)
from .peer import HELLO, PEER_BYTES, _engine, check_peer, serve
from .rdma import check_rdma, rdma_devices
from .report import FAIL, OK, SKIP, WARN, Report, Row
from .runner import _default_listen, build_parser, main, run
from .same_host import _ptrace_scope, check_same_host
from .vllm_plugin import (_in_range, _vtuple, check_kv_cache_access, check_model_runner,
                          check_vllm, supported_vllm)

__all__ = ["OK", "WARN", "FAIL", "SKIP", "Row", "Report", "PEER_BYTES", "HELLO", "SLOW_METADATA_MS",
           "MIN_SECRET_BYTES", "check_config", "check_metadata", "diagnose_metadata", "curl_proxy",
           "sniff", "check_auth", "check_engine", "check_rdma", "rdma_devices", "check_gpu",
           "check_same_host", "check_vllm", "check_kv_cache_access", "check_model_runner",
           "supported_vllm",
           "check_peer", "serve", "build_parser", "run", "main"]
