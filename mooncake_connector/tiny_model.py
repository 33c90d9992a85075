"""A tiny random-weight Llama with a locally trained tokenizer, built offline.

    python -m mooncake_connector.tiny_model [DIR]      # prints the directory

vLLM needs a model directory; the end-to-end tests, the serving demo and the
serving benchmark use this one so that nothing is fetched from a hub.  The
build is deterministic (fixed seeds, fixed corpus): the same spec gives the
same weights, so outputs can be compared across servers and runs.

Constraints of vLLM's CPU attention backend (docs/vllm-cpu.md): head size
>= 32 (hidden / heads) and a KV block size that is a multiple of 32.

torch, transformers and tokenizers are imported only when a model is built.
"""
import hashlib
import json
import os
import shutil
import sys
import tempfile

#: The default spec: 2 layers, hidden 128, 4 heads (head size 32), 2 KV heads.
DEFAULT_SPEC = {
    "layers": 2,
    "hidden": 128,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 256,
    "vocab": 512,
    "max_positions": 4096,
    "seed": 0,
    # > 0: every other layer (0, 2, ...) is sliding-window attention over this
    # many tokens (config layer_types, as Gemma/Qwen-style hybrids have it):
    # vLLM's hybrid KV-cache manager then keeps two KV-cache groups.
    "sliding_window": 0,
    # "mla": a DeepSeek-V2-style model instead (multi-head latent attention:
    # one latent KV of MLA_LATENT values per token and layer, the same on
    # every TP rank; no MoE layer).  vLLM's CPU MLA kernel takes only a
    # 512-wide latent with 64 rope dims and forces 16-token blocks.
    "attention": "gqa",
}

MLA_KV_LORA_RANK, MLA_ROPE_DIM = 512, 64
MLA_LATENT = MLA_KV_LORA_RANK + MLA_ROPE_DIM

# A small chat template (the tokenizer has none of its own); vLLM's chat
# endpoint needs one.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world this is a tiny model for testing vllm",
    "disaggregated prefill and decode with a kv connector",
    "one two three four five six seven eight nine ten",
    "a prompt is prefilled on one server and decoded on another",
    "the key value cache moves over tcp between the two servers",
]

_BUILD_VERSION = 1  # bump when the build procedure changes


def spec_with(**overrides):
    unknown = set(overrides) - set(DEFAULT_SPEC)
    if unknown:
        raise ValueError(f"unknown tiny-model field(s) {sorted(unknown)}; "
                         f"known: {sorted(DEFAULT_SPEC)}")
    spec = dict(DEFAULT_SPEC, **overrides)
    if spec["hidden"] % spec["heads"] or spec["heads"] % spec["kv_heads"]:
        raise ValueError(f"hidden must divide by heads and heads by kv_heads: {spec}")
    if spec["attention"] not in ("gqa", "mla"):
        raise ValueError(f"attention must be 'gqa' or 'mla', not {spec['attention']!r}")
    if spec["attention"] == "mla" and spec["sliding_window"]:
        raise ValueError("the MLA tiny model has no sliding-window layers")
    if spec["sliding_window"] and spec["layers"] < 2:
        raise ValueError("a sliding-window tiny model needs >= 2 layers (one of each kind)")
    if spec["hidden"] // spec["heads"] < 32:
        raise ValueError(f"head size {spec['hidden'] // spec['heads']} < 32: vLLM's CPU "
                         "attention backend rejects it")
    return spec


def spec_id(spec):
    spec = {k: v for k, v in spec.items() if not (k == "sliding_window" and not v)
            and not (k == "attention" and v == "gqa")}
    blob = json.dumps({"v": _BUILD_VERSION, **spec}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def kv_bytes_per_token(spec, dtype_bytes=4):
    """Bytes of K and V per token over all layers (float32 by default)."""
    if spec.get("attention") == "mla":
        return spec["layers"] * MLA_LATENT * dtype_bytes
    head = spec["hidden"] // spec["heads"]
    return spec["layers"] * 2 * spec["kv_heads"] * head * dtype_bytes


def default_cache_root():
    root = os.environ.get("MC_MODEL_CACHE")
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mooncake_connector")


def _build_into(out, spec):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec["vocab"],
                                  special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.model_max_length = spec["max_positions"]
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(spec["seed"])
    if spec["attention"] == "mla":
        model = _mla_model(spec, tok.get_vocab_size())
    else:
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
            num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
            num_key_value_heads=spec["kv_heads"], vocab_size=tok.get_vocab_size(),
            max_position_embeddings=spec["max_positions"], bos_token_id=1, eos_token_id=2,
            pad_token_id=3, tie_word_embeddings=False, dtype="float32",
            **_window_fields(spec)))
    model.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "tiny_model.json"), "w") as f:
        json.dump({"spec": spec, "id": spec_id(spec),
                   "kv_bytes_per_token": kv_bytes_per_token(spec)}, f, indent=1)


def _mla_model(spec, vocab):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    # first_k_dense_replace = layers: every layer a dense MLP (transformers
    # still wants expert counts).
    cfg = DeepseekV2Config(
        hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
        num_key_value_heads=spec["heads"], vocab_size=vocab,
        max_position_embeddings=spec["max_positions"], q_lora_rank=None,
        kv_lora_rank=MLA_KV_LORA_RANK, qk_rope_head_dim=MLA_ROPE_DIM, qk_nope_head_dim=32,
        v_head_dim=32, first_k_dense_replace=spec["layers"], n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
        dtype="float32")
    return DeepseekV2ForCausalLM(cfg)


def _window_fields(spec):
    w = spec.get("sliding_window") or 0
    if not w:
        return {}
    types = ["sliding_attention" if i % 2 == 0 else "full_attention"
             for i in range(spec["layers"])]
    return {"sliding_window": w, "layer_types": types}


def build(out_dir=None, **overrides):
    """Returns a directory holding the model for this spec, building it once.

    Without out_dir the model is cached under $MC_MODEL_CACHE (default
    ~/.cache/mooncake_connector) in tiny-llama-<spec hash>.  The build goes to
    a temporary sibling and is renamed into place, so concurrent builders and
    interrupted builds never leave a half-written model behind.
    """
    spec = spec_with(**overrides)
    if out_dir is None:
        kind = "deepseek-v2" if spec["attention"] == "mla" else "llama"
        out_dir = os.path.join(default_cache_root(), f"tiny-{kind}-{spec_id(spec)}")
    out_dir = os.path.abspath(out_dir)
    marker = os.path.join(out_dir, "tiny_model.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f).get("id") == spec_id(spec):
                return out_dir
        raise RuntimeError(f"{out_dir} holds a different tiny model; remove it or pick another "
                           "directory")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-build-", dir=parent)
    try:
        _build_into(tmp, spec)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not os.path.exists(marker):  # not a concurrent builder that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0])
        return 0
    if len(argv) > 1 or argv and argv[0].startswith("-"):
        what = (f"unknown option {argv[0]!r}" if argv[0].startswith("-")
                else f"one DIR only, got {len(argv)} arguments")
        print(f"usage: python -m mooncake_connector.tiny_model [DIR]\nerror: {what}",
              file=sys.stderr)
        return 2
    print(build(argv[0] if argv else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
