"""vllm_gpu.py: the flags and environment the GPU servers get (the GPU
end-to-end run itself: scripts/vllm_gpu_e2e.py on the GPU machine,
docs/vllm-gpu.md)."""
import pytest

from mooncake_connector.vllm_gpu import GPU_ENV, bench_settings, device_settings, gpu_vllm_args


def test_cpu_adds_nothing():
    assert device_settings("cpu") == ({}, [])


def test_cuda_splits_the_gpu_between_the_servers():
    env, args = device_settings("cuda", servers=3, environ={})
    assert env == GPU_ENV and env["VLLM_TARGET_DEVICE"] == "cuda"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    i = args.index("--gpu-memory-utilization")
    assert float(args[i + 1]) == pytest.approx(0.25)
    assert args[args.index("--attention-backend") + 1] == "TRITON_ATTN"
    _, one = device_settings("cuda", servers=1)
    assert float(one[one.index("--gpu-memory-utilization") + 1]) == pytest.approx(0.75)


def test_bad_values_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        device_settings("rocm")
    with pytest.raises(ValueError, match="servers must be >= 1"):
        device_settings("cuda", servers=0)
    with pytest.raises(ValueError, match=r"memory_fraction must be in \(0, 1\]"):
        gpu_vllm_args(1.5)
    assert "--attention-backend" not in gpu_vllm_args(0.5, attention_backend=None)


def test_attention_backend_is_the_callers_or_vllms_own():
    """serving_bench.py --attention-backend: TRITON_ATTN by default (fp32,
    exact comparisons), another named backend passed on, auto leaves
    vLLM its own choice (no flag: FlashAttention on Hopper)."""
    _, args = bench_settings("cuda")
    assert args[args.index("--attention-backend") + 1] == "TRITON_ATTN"
    _, args = bench_settings("cuda", attention_backend="FLASH_ATTN")
    assert args[args.index("--attention-backend") + 1] == "FLASH_ATTN"
    for own in ("auto", None):
        _, args = bench_settings("cuda", "on", "bfloat16", attention_backend=own)
        assert "--attention-backend" not in args and args[-2:] == ["--dtype", "bfloat16"]
    assert bench_settings("cpu", attention_backend="auto") == ({}, [])


def test_bench_settings_route_and_dtype():
    """The benchmarks' servers (serving_bench.py, ttft_timeline.py --device
    cuda): the engine's GPU route and the dtype on top of device_settings."""
    assert bench_settings("cpu") == ({}, [])
    env, args = bench_settings("cuda", "off", "bfloat16")
    assert env["MC_GPU_IPC"] == "0" and env["VLLM_TARGET_DEVICE"] == "cuda"
    assert args[-2:] == ["--dtype", "bfloat16"]
    assert "--gpu-memory-utilization" in args
    env, args = bench_settings("cuda")
    assert env["MC_GPU_IPC"] == "1" and args[-2:] == ["--dtype", "float32"]
    assert "MC_GPU_IPC" not in GPU_ENV  # a copy, not the shared dict
    with pytest.raises(ValueError, match="gpu_path must be 'on' or 'off'"):
        bench_settings("cuda", "ipc")



def test_cuda_graphs_undo_the_servers_enforce_eager():
    """--cuda-graphs (serving_bench.py / ttft_timeline.py): the servers get
    serving.py's --enforce-eager and then --no-enforce-eager; vLLM's own
    command-line parser must end with eager mode off (the later flag wins)."""
    vllm = pytest.importorskip("vllm", reason="vllm is not installed")  # noqa: F841
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from mooncake_connector.serving import BASE_VLLM_ARGS
    _, args = bench_settings("cuda", cuda_graphs=True)
    assert args[-1] == "--no-enforce-eager"
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    # (the API server's own flags, e.g. --disable-uvicorn-access-log, left over)
    on = parser.parse_known_args(["--model", "m", *BASE_VLLM_ARGS])[0]
    off = parser.parse_known_args(["--model", "m", *BASE_VLLM_ARGS, *args])[0]
    assert on.enforce_eager is True and off.enforce_eager is False
    assert "--no-enforce-eager" not in bench_settings("cuda")[1]
    with pytest.raises(ValueError, match="cuda_graphs needs device 'cuda'"):
        bench_settings("cpu", cuda_graphs=True)


def test_the_callers_model_runner_choice_is_kept():
    """VLLM_USE_V2_MODEL_RUNNER in the caller's environment wins over
    GPU_ENV's 0 (the V2 runner: 0.26's default for Llama, 0.34's only GPU
    runner; docs/vllm-gpu.md), and only that variable."""
    assert device_settings("cuda", environ={})[0]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    env, _ = device_settings("cuda", environ={"VLLM_USE_V2_MODEL_RUNNER": "1",
                                             "VLLM_USE_FLASHINFER_SAMPLER": "1"})
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert GPU_ENV["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # the shared dict untouched
