"""vLLM servers on one CUDA GPU: what the demo (`--device cuda`) and
scripts/vllm_gpu_e2e.py add to serving.py's CPU defaults (docs/vllm-gpu.md).

Tested with vLLM 0.26.0 on an H200 (the newest vLLM that pins that
machine's torch 2.11), trimmed by scripts/vllm-gpu-prepare.sh: no
FlashAttention, so the servers ask for vLLM's TRITON_ATTN backend, which
also runs fp32 (the tiny model's dtype: exact comparisons) and head size 32.
Its KV cache is (blocks, kv_heads, block_size, 2*head_size) stored
tokens-first, which connector/layout.py reads as one extent per block.
"""
import os


#: The environment every GPU server gets on top of serving.VLLM_ENV:
#: VLLM_USE_FLASHINFER_SAMPLER=0: vLLM 0.26 otherwise imports FlashInfer
#: (not carried) when it builds the sampler; VLLM_USE_V2_MODEL_RUNNER=0: the
#: V1 GPU model runner, whose KV-connector path is the one vLLM's CPU
#: backend (the CPU end-to-end tests) also runs.  On the V2 runner (=1) a
#: decode under load_failure_policy "recompute" makes no in-step load
#: (connector.stale_recompute_runner): layer loads there need "fail".
GPU_ENV = {"VLLM_TARGET_DEVICE": "cuda", "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "VLLM_USE_V2_MODEL_RUNNER": "0"}


def gpu_vllm_args(memory_fraction=0.2, attention_backend="TRITON_ATTN"):
    """vLLM flags for one of several servers sharing a GPU: each may take
    memory_fraction of it (vLLM checks that much is free at start; the KV
    cache itself is the explicit --kv-cache-memory-bytes serving.py sets)."""
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], not {memory_fraction!r}")
    args = ["--gpu-memory-utilization", f"{memory_fraction:g}"]
    if attention_backend:
        args += ["--attention-backend", attention_backend]
    return args


def device_settings(device, servers=3, environ=None, attention_backend="TRITON_ATTN"):
    """(env, extra vLLM args) for `device` ("cpu" or "cuda"), with `servers`
    vLLM servers sharing the one GPU.  VLLM_USE_V2_MODEL_RUNNER set in the
    caller's environment (`environ`, default os.environ) is kept: =1 runs
    vLLM's V2 GPU model runner, 0.26's default for Llama and 0.34's only
    one (GPU_ENV's 0 otherwise).  attention_backend: vLLM's
    --attention-backend on cuda, None or "auto" to leave vLLM its own
    choice (FlashAttention on Hopper, as users run it)."""
    if device == "cpu":
        return {}, []
    if device == "cuda":
        if servers < 1:
            raise ValueError("servers must be >= 1")
        env = dict(GPU_ENV)
        mine = (os.environ if environ is None else environ).get("VLLM_USE_V2_MODEL_RUNNER")
        if mine is not None:
            env["VLLM_USE_V2_MODEL_RUNNER"] = mine
        if attention_backend == "auto":
            attention_backend = None
        return env, gpu_vllm_args(min(0.9, 0.75 / servers), attention_backend)
    raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")


def bench_settings(device, gpu_path="on", dtype="float32", servers=3, cuda_graphs=False,
                   attention_backend="TRITON_ATTN"):
    """(env, extra vLLM args) of the benchmarks' servers (serving_bench.py,
    ttft_timeline.py): device_settings, and on cuda the engine's route
    between the GPU KV caches (gpu_path "on": the same-host GPU path, "off":
    MC_GPU_IPC=0, TCP with GPU staging) and the servers' dtype (after
    serving.py's own --dtype: the later flag wins); cuda_graphs: vLLM's CUDA
    graphs as production runs them (--no-enforce-eager after serving.py's
    --enforce-eager; start-up compiles and captures); attention_backend as
    device_settings."""
    if cuda_graphs and device != "cuda":
        raise ValueError("cuda_graphs needs device 'cuda'")
    if gpu_path not in ("on", "off"):
        raise ValueError(f"gpu_path must be 'on' or 'off', not {gpu_path!r}")
    env, args = device_settings(device, servers=servers, attention_backend=attention_backend)
    if device == "cuda":
        env = dict(env, MC_GPU_IPC="1" if gpu_path == "on" else "0")
        args = args + ["--dtype", dtype] + (["--no-enforce-eager"] if cuda_graphs else [])
    return env, args
