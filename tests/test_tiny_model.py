"""The offline tiny model: deterministic, within vLLM's CPU limits, cached."""
import hashlib
import importlib.util
import json
import os

import pytest

from mooncake_connector import tiny_model

needs_stack = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "tokenizers")),
    reason="torch/transformers/tokenizers not installed (scripts/env.sh installs them with vLLM)")


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_spec_checks_without_building():
    assert tiny_model.spec_with()["hidden"] // tiny_model.spec_with()["heads"] >= 32
    with pytest.raises(ValueError, match="head size 16 < 32"):
        tiny_model.spec_with(hidden=64)
    with pytest.raises(ValueError, match="unknown tiny-model field"):
        tiny_model.spec_with(hiden=128)
    assert tiny_model.spec_id(tiny_model.spec_with()) != tiny_model.spec_id(
        tiny_model.spec_with(layers=3))
    # 2 layers x K,V x 2 KV heads x head size 32 x 4 bytes
    assert tiny_model.kv_bytes_per_token(tiny_model.spec_with()) == 1024


@needs_stack
def test_build_is_deterministic_and_cached(tmp_path):
    a = tiny_model.build(str(tmp_path / "a"))
    b = tiny_model.build(str(tmp_path / "b"))
    for name in ("model.safetensors", "tokenizer.json"):
        assert _sha(os.path.join(a, name)) == _sha(os.path.join(b, name)), name
    cfg = json.load(open(os.path.join(a, "config.json")))
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32
    tok = json.load(open(os.path.join(a, "tokenizer.json")))
    assert cfg["vocab_size"] >= len(tok["model"]["vocab"])  # every token id has an embedding
    assert os.path.exists(os.path.join(a, "chat_template.jinja")) or "chat_template" in open(
        os.path.join(a, "tokenizer_config.json")).read()
    # Cached: a second call returns at once without rebuilding.
    mtime = os.path.getmtime(os.path.join(a, "model.safetensors"))
    assert tiny_model.build(str(tmp_path / "a")) == a
    assert os.path.getmtime(os.path.join(a, "model.safetensors")) == mtime
    # A different spec in the same directory is refused, not silently reused.
    with pytest.raises(RuntimeError, match="different tiny model"):
        tiny_model.build(str(tmp_path / "a"), layers=3)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tiny-build-")]


def test_mla_spec_checks_without_building():
    with pytest.raises(ValueError, match="attention must be 'gqa' or 'mla'"):
        tiny_model.spec_with(attention="mha")
    with pytest.raises(ValueError, match="no sliding-window"):
        tiny_model.spec_with(attention="mla", sliding_window=64)
    # The default model keeps its id (its cache directory) with the new field.
    assert tiny_model.spec_id(tiny_model.spec_with()) == tiny_model.spec_id(
        tiny_model.spec_with(attention="gqa"))
    assert tiny_model.spec_id(tiny_model.spec_with(attention="mla")) != tiny_model.spec_id(
        tiny_model.spec_with())
    # 2 layers x one 576-wide latent (512 + 64 rope) x 4 bytes
    assert tiny_model.kv_bytes_per_token(tiny_model.spec_with(attention="mla")) == 4608


@needs_stack
def test_mla_build_is_deepseek_v2_shaped_for_vllms_cpu_mla(tmp_path):
    d = tiny_model.build(str(tmp_path / "mla"), attention="mla")
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    # vLLM's CPU MLA decode kernel: latent 512 + rope 64 = head size 576
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"]  # no MoE layer
    assert os.path.exists(os.path.join(d, "tokenizer.json"))


def test_cli_options_and_extra_arguments_are_usage_errors(tmp_path, monkeypatch, capsys):
    """`python -m mooncake_connector.tiny_model --size 5` built a model into
    a directory named --size (and ignored 5); nothing is built now."""
    monkeypatch.chdir(tmp_path)
    assert tiny_model.main(["--size", "5"]) == 2
    assert "unknown option '--size'" in capsys.readouterr().err
    assert tiny_model.main(["a", "b"]) == 2
    assert "one DIR only" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
