"""Small random Hugging Face checkpoints, built with transformers' save_pretrained, one per
architecture feature msinfer must serve. Shared by the parity, sharding and CLI tests."""

from __future__ import annotations

from pathlib import Path

VARIANTS = {
    # name: (config class, overrides)
    "llama_gqa_tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama_mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1)),
    "llama_mha_bias": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, attention_bias=True,
                                           mlp_bias=True)),
    "qwen2_qkv_bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3_qknorm_odd_head_dim": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
    # saved in bfloat16, as most checkpoints are: its matmuls run on bfloat16 tiles where the CPU has AMX
    "llama_gqa_tied_bfloat16": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                                    tie_word_embeddings=True)),
    # mixtures of experts: top 2 of 8 renormalized, the second layer dense; top 4 of 6 as they
    # come, a shared expert, tied embeddings, an expert size (24) the grouped kernel runs unfused
    "qwen3_moe_top2_dense_layer": ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                                          moe_intermediate_size=32, mlp_only_layers=[1])),
    "qwen2_moe_top4_shared_tied": ("Qwen2MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                                          num_experts=6, num_experts_per_tok=4, norm_topk_prob=False,
                                                          moe_intermediate_size=24, shared_expert_intermediate_size=96,
                                                          tie_word_embeddings=True)),
    # five layers, tied embeddings: pipeline stages of uneven size (tests/test_pipeline.py); with a
    # tokenizer (build_tokenizer's 301 tokens, the vocabulary padded to 320), for structured outputs
    "qwen2_tied_5_layers": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                                num_hidden_layers=5, vocab_size=320)),
    # DeepSeek's latent attention: V3 with q_lora_rank, YaRN (the ramp inside the rotary dims),
    # sigmoid routing with a correction bias, 4 groups of which 2 are chosen, a shared expert and
    # a dense first layer; V2 without q_lora_rank, softmax routing limited to 2 of 3 groups, two
    # shared experts, every layer sparse
    "deepseek_v3_yarn_groups": ("DeepseekV3Config", dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, moe_intermediate_size=32, routed_scaling_factor=2.5,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, mscale=0.707,
                             mscale_all_dim=1.0, beta_fast=32, beta_slow=1))),
    "deepseek_v2_groups_no_q_lora": ("DeepseekV2Config", dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=6, topk_method="group_limited_greedy", n_group=3,
        topk_group=2, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=0, moe_intermediate_size=24,
        routed_scaling_factor=1.5)),
}
WITH_TOKENIZER = {"qwen2_tied_5_layers"}
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build_checkpoint(name: str, root: Path, seed: int = 0, rope_theta: float = 10000.0, **extra) -> Path:
    import torch
    import transformers

    out = Path(root) / name
    if (out / "config.json").is_file():
        return out
    cls_name, overrides = VARIANTS[name]
    rope = {"rope_type": "default", "rope_theta": rope_theta, **overrides.get("rope_parameters", {})}
    cfg = getattr(transformers, cls_name)(**{**BASE, **overrides, **extra, "rope_parameters": rope})
    cfg.rope_parameters = rope
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger than default init so that logits are decisive and bugs show
        for p in model.parameters():
            if p.dim() == 1 and "norm" in getattr(p, "_name", ""):
                continue
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "bias" in n:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5) * 2)
        for n, b in model.named_buffers():     # DeepSeek-V3's routing bias, which changes the experts chosen
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    if name.endswith("_bfloat16"):
        model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    if name in WITH_TOKENIZER:
        build_tokenizer(out)
    return out


def fp8_checkpoint(name: str, root: Path, block: tuple[int, int] = (32, 48)) -> tuple[Path, Path]:
    """Checkpoint `name` as DeepSeek releases its weights: every projection's weight float8_e4m3fn
    with a float32 `weight_scale_inv` per block (max|w| / 448 of the block, FP8's largest value),
    config.json's quantization_config `quant_method: fp8`; the rest float. Blocks of 32 x 48 need
    not divide the layers (a 64-wide input is one whole block and a part). Returns (the FP8
    checkpoint, the float checkpoint of its dequantized weights: transformers' reference)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    src = build_checkpoint(name, root)
    fp8, ref = Path(root) / f"{name}-fp8", Path(root) / f"{name}-fp8-dequantized"
    if (fp8 / "config.json").is_file() and (ref / "config.json").is_file():
        return fp8, ref
    (files,) = [list(src.glob("*.safetensors"))]
    quantized, dequantized = {}, {}
    br, bc = block
    for f in files:
        for n, w in load_file(f).items():
            if not (n.endswith("_proj.weight") and w.dim() == 2):
                quantized[n] = dequantized[n] = w
                continue
            rows, cols = w.shape
            pad = torch.zeros(-(-rows // br) * br, -(-cols // bc) * bc)
            pad[:rows, :cols] = w
            blocks = pad.reshape(pad.shape[0] // br, br, pad.shape[1] // bc, bc)
            scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            q = (blocks / scale[:, None, :, None]).reshape(pad.shape)[:rows, :cols].to(torch.float8_e4m3fn)
            full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
            quantized[n], quantized[n[:-len("weight")] + "weight_scale_inv"] = q, scale.contiguous()
            dequantized[n] = q.float() * full
    for out, tensors in ((fp8, quantized), (ref, dequantized)):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (fp8 / "config.json").write_text(json.dumps(config, indent=2))
    return fp8, ref


TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' and loop.first %}"
            "{{ raise_exception('the first message must not be the assistant') }}{% endif %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["hello world", "the capital of France is Paris", "stop here please", "be brief", "héllo wörld ✓"]


def build_tokenizer(folder, chat_template=TEMPLATE):
    """A byte-level BPE trained on a few strings, saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(folder)
    return folder


def quantized_checkpoint(name: str, scheme: str, root: Path) -> Path:
    """Checkpoint `name` quantized by compressed-tensors (scripts/quantize_model.py), once per session."""
    from scripts.quantize_model import quantize
    out = Path(root) / f"{name}-{scheme}"
    return out if (out / "config.json").is_file() else quantize(build_checkpoint(name, root), out, scheme)
