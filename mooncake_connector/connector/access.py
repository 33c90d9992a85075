"""What MooncakeConnector declares to vLLM >= 0.34 about its KV cache access
(KVCacheAccess flags); no vLLM import, so doctor can ask it cheaply."""

# The same-host GPU path exports driver-mapped (cuMem) KV memory as POSIX
# file descriptors (csrc/transport/same_host_gpu).  If that export is not
# available, set this to False: kv_cache_access() then declares LEGACY_IPC
# and vLLM allocates the KV cache classically (one log line says why).
SAME_HOST_GPU_EXPORTS_FD = True


MODES = ("auto", "exports_fd", "legacy_ipc")


def kv_cache_access_for(flags, is_cuda, mode="auto"):
    """What this connector needs from vLLM's device KV allocation (vLLM >= 0.34's
    KVCacheAccess flags), and why, as (flags, reason).

    The engine registers every KV region with its transports (RDMA, TCP with
    GPU staging), which needs one physical allocation per segment: REGISTERS,
    as vLLM's in-tree MooncakeConnector declares.  On CUDA the same-host GPU
    path also hands the region to the peer process: EXPORTS_FD when it exports
    driver-mapped memory as POSIX fds (SAME_HOST_GPU_EXPORTS_FD), else
    LEGACY_IPC, which makes vLLM keep its extensible KV cache off (legacy CUDA
    IPC cannot export driver-mapped memory).  Off CUDA (CPU KV cache) there is
    no extensible cache and no export: REGISTERS only (EXPORTS_FD would make
    vLLM refuse a non-CUDA platform).

    mode (kv_connector_extra_config "kv_cache_access"): "auto" as above;
    "legacy_ipc" for deployments where vLLM's extensible KV cache cannot be on
    (--kv-cache-memory-bytes, --num-gpu-blocks-override, elastic EP,
    --no-enable-extensible-kv-cache: with EXPORTS_FD vLLM 0.34 refuses to
    start there); "exports_fd" forces the fd export.
    """
    if mode not in MODES:
        raise ValueError(f"kv_connector_extra_config.kv_cache_access must be one of "
                         f"{', '.join(MODES)}, not {mode!r}")
    if not is_cuda:
        return flags.REGISTERS, "the engine registers the KV cache (not CUDA: no GPU export)"
    if mode == "legacy_ipc":
        return (flags.REGISTERS | flags.LEGACY_IPC,
                "kv_connector_extra_config asks for legacy CUDA IPC (kv_cache_access: "
                "legacy_ipc): vLLM's extensible KV cache is turned off, KV allocated "
                "classically")
    if mode == "exports_fd" or SAME_HOST_GPU_EXPORTS_FD:
        return (flags.REGISTERS | flags.EXPORTS_FD,
                "the engine registers the KV cache and the same-host GPU path exports "
                "driver-mapped KV memory to the peer as POSIX file descriptors")
    return (flags.REGISTERS | flags.LEGACY_IPC,
            "the same-host GPU path shares KV memory through legacy CUDA IPC, which "
            "cannot export driver-mapped memory: vLLM's extensible KV cache is turned off")
