"""The decoder network (Llama / Qwen2 / Qwen3) over a paged KV cache, in MindSpore.

One `construct` serves every step: it writes the new tokens' K/V rows into the cache at `slots`,
then each token attends over the first positions of its own sequence, read through the
sequence's block table (a paged-attention kernel, `worker.ops`). A step's tokens are packed one
after another, whatever sequence they belong to, so prefill and decode steps differ only in how
many tokens each sequence brings. All index tensors are built by the engine (`worker.runner`),
never by a caller.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
import numpy as np

from sharding.config import ModelConfig
from sharding.layers import (LinearBase, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RMSNorm,
                             RowParallelLinear, VocabParallelEmbedding, new_param)
from sharding.layout import TPInfo
from worker.ops import GLU_GROUP


class Attention(nn.Cell):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, dtype, dev, num_slots: int):
        super().__init__()
        self.dev = dev
        self.qkv_proj = QKVParallelLinear(cfg, cfg.qkv_bias, tp, dtype, dev.linear_op)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp, dtype,
                                        dev.linear_op)
        self.heads, self.kv_heads, self.head_dim = self.qkv_proj.q_heads, self.qkv_proj.kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, dev.rms_norm)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, dev.rms_norm)
        else:
            self.q_norm = self.k_norm = None
        shape = (num_slots * self.kv_heads, cfg.head_dim)
        self.k_cache = new_param(shape, dtype, "k_cache")
        self.v_cache = new_param(shape, dtype, "v_cache")
        self.attend = dev.attention_op(self.q_size)
        if dev.fused_attention:      # one kernel from the qkv projection on: slices, norms and all
            ones = Tensor(np.ones(cfg.head_dim), dtype)
            self.qk_norm = (self.q_norm.weight, self.k_norm.weight) if cfg.qk_norm else (ones, ones)
            self.norm_meta = Tensor(np.array([cfg.rms_norm_eps, float(cfg.qk_norm)], np.float32))

    def construct(self, x, rope_q, rope_k, write_index, block_tables, token_seq, token_len, meta):
        N = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.dev.fused_attention:
            return self.o_proj(self.attend(qkv, *self.qk_norm, self.norm_meta, *rope_q, self.k_cache, self.v_cache,
                                           write_index, block_tables, token_seq, token_len, meta))
        q = qkv[:, : self.q_size].reshape(N, self.heads, self.head_dim)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].reshape(N, self.kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].reshape(N, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        out = self.dev.attend(self.attend, q, k, v, rope_q, rope_k, self.k_cache, self.v_cache, write_index,
                              block_tables, token_seq, token_len, meta)
        return self.o_proj(out.reshape(N, self.q_size))


class MLP(nn.Cell):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, dtype, dev):
        super().__init__()
        self.dev = dev
        I = cfg.intermediate_size
        # silu(gate) * up computed by the projection itself where the device has such a kernel
        glu = dev.glu_linear_op is not None and not cfg.mlp_bias and (I // tp.size) % GLU_GROUP == 0
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [I, I], cfg.mlp_bias, tp, dtype,
                                                       dev.glu_linear_op if glu else dev.linear_op)
        self.gate_up_proj.glu = glu                 # its weight is packed for it (dev.pack_weight)
        self.down_proj = RowParallelLinear(I, cfg.hidden_size, cfg.mlp_bias, tp, dtype, dev.linear_op)

    def construct(self, x):
        h = self.gate_up_proj(x)
        return self.down_proj(h if self.gate_up_proj.glu else self.dev.silu_mul(h))


class DecoderLayer(nn.Cell):
    # Compiled once and reused for every layer: a 30-layer step compiles in ~2/3 of the time.
    @ms.lazy_inline(policy="front")
    def __init__(self, cfg, tp, dtype, dev, num_slots):
        super().__init__()
        self.self_attn = Attention(cfg, tp, dtype, dev, num_slots)
        self.mlp = MLP(cfg, tp, dtype, dev)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, dev.rms_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, dev.rms_norm)

    def construct(self, x, rope_q, rope_k, write_index, block_tables, token_seq, token_len, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope_q, rope_k, write_index, block_tables, token_seq,
                               token_len, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Cell):
    """Inputs of one step (N tokens of up to M sequences; see ModelRunner.prepare):
        input_ids      [N]      int32   the new tokens, packed one sequence after another
        rope_pos       [N, P]   float32 rotary position components (P = 1 for plain RoPE)
        slots          [N]      int32   cache slot each new token's K/V is written to
        block_tables   [M, MB]  int32   the cache blocks of each sequence
        token_seq      [N]      int32   which sequence (row of block_tables) each token is of
        token_len      [N]      int32   how many positions of its sequence it sees: its position + 1
                                        (causal), 0 for a padding token
        out_index      [M]      int32   rows of the N tokens whose logits are returned (-1: padding,
                                        whose logits are not computed where the device can skip them)
    The attention scale is 1/sqrt(head_dim), as in every supported family.
    Returns logits [M, vocab] in float32 (all ranks hold the full vocab after the gather)."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, dtype, dev, num_slots: int, freq_matrix: np.ndarray,
                 block_size: int = 16):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, dev.embed_op)
        self.layers = nn.CellList([DecoderLayer(cfg, tp, dtype, dev, num_slots) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, dev.rms_norm)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, tied=tied, linear=dev.linear_op)
        # [P, head_dim/2]: which position component drives each rotary frequency, times inv_freq.
        self.freq_matrix = Parameter(Tensor(freq_matrix, ms.float32), name="freq_matrix", requires_grad=False)
        self.dtype = dtype
        self.dev = dev
        attn = self.layers[0].self_attn
        self.heads, self.kv_heads = attn.heads, attn.kv_heads
        # what the attention kernel needs besides its tensors: block size, KV heads
        self.attn_meta = Tensor(np.array([block_size, self.kv_heads], np.int32))
        self.packed: dict = {}               # name of a weight in the device's order -> its unpack

    def construct(self, input_ids, rope_pos, slots, block_tables, token_seq, token_len, out_index):
        x = self.embed_tokens(input_ids)
        angles = ops.matmul(rope_pos, self.freq_matrix)                 # [N, D/2]
        cos, sin = ops.cos(angles).astype(self.dtype), ops.sin(angles).astype(self.dtype)
        rope_q = self.dev.rope_tables(cos, sin, self.heads)
        rope_k = self.dev.rope_tables(cos, sin, self.kv_heads)
        write_index = self.dev.write_index(slots, self.kv_heads)
        for layer in self.layers:
            x = layer(x, rope_q, rope_k, write_index, block_tables, token_seq, token_len, self.attn_meta)
        x = self.norm(self.dev.rows(x, out_index))
        return self.lm_head(x).astype(ms.float32)

    def score(self, input_ids, rope_pos, slots, block_tables, token_seq, token_len, out_index, score_index,
              targets):
        """A prefill that also scores: returns (logits [M, vocab] at out_index, as `construct`
        returns them; log p(targets[i] | the tokens up to row score_index[i]) [S], float32). The
        log-softmax and the pick run in the graph, so a scoring step hands back S floats, not
        S x vocab logits."""
        m = out_index.shape[0]
        logits = self.construct(input_ids, rope_pos, slots, block_tables, token_seq, token_len,
                                ops.concat((out_index, score_index)))
        logp = ops.log_softmax(logits[m:], -1)
        return logits[:m], ops.gather_elements(logp, 1, targets.reshape(-1, 1)).reshape(-1)

    def pack_weights(self) -> None:
        """Every matmul and embedding weight into the device's element order (`dev.pack_weight`),
        once all are loaded; the layers were built with the device's ops, which read that order.
        A weight may change its dtype (bfloat16 tiles are int16), so it becomes a new Parameter of
        the same name, set on every cell that holds it (a tied LM head shares the embedding's)."""
        if self.dev.pack_weight is None:
            return
        done: dict[str, Parameter] = {}
        for _, cell in self.cells_and_names():
            w = getattr(cell, "weight", None)
            if not isinstance(cell, (LinearBase, VocabParallelEmbedding)):
                continue
            if w.name not in done:
                if w.name in self.packed:        # by an earlier call
                    continue
                data, self.packed[w.name] = self.dev.pack_weight(w.asnumpy(), getattr(cell, "glu", False))
                done[w.name] = Parameter(Tensor(data), name=w.name, requires_grad=False)
            cell.weight = done[w.name]

    def weights(self) -> dict[str, np.ndarray]:
        """name -> value of every parameter but the KV cache, in the Hugging Face layout."""
        return {p.name: self.packed[p.name](p.asnumpy()) if p.name in self.packed else p.asnumpy()
                for p in self.get_parameters() if "cache" not in p.name}

    def named_loaders(self):
        """checkpoint tensor name -> (layer, parameter, shard id), for the streaming loader."""
        table = {}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for s in ("q", "k", "v"):
                table[p + f"self_attn.{s}_proj.weight"] = (attn.qkv_proj, attn.qkv_proj.weight, s)
                if attn.qkv_proj.bias is not None:
                    table[p + f"self_attn.{s}_proj.bias"] = (attn.qkv_proj, attn.qkv_proj.bias, s)
            table[p + "self_attn.o_proj.weight"] = (attn.o_proj, attn.o_proj.weight, None)
            if attn.o_proj.bias is not None:
                table[p + "self_attn.o_proj.bias"] = (attn.o_proj, attn.o_proj.bias, None)
            if attn.q_norm is not None:
                table[p + "self_attn.q_norm.weight"] = (attn.q_norm, attn.q_norm.weight, None)
                table[p + "self_attn.k_norm.weight"] = (attn.k_norm, attn.k_norm.weight, None)
            for j, name in enumerate(("gate_proj", "up_proj")):
                table[p + f"mlp.{name}.weight"] = (mlp.gate_up_proj, mlp.gate_up_proj.weight, j)
                if mlp.gate_up_proj.bias is not None:
                    table[p + f"mlp.{name}.bias"] = (mlp.gate_up_proj, mlp.gate_up_proj.bias, j)
            table[p + "mlp.down_proj.weight"] = (mlp.down_proj, mlp.down_proj.weight, None)
            if mlp.down_proj.bias is not None:
                table[p + "mlp.down_proj.bias"] = (mlp.down_proj, mlp.down_proj.bias, None)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                cell = getattr(layer, norm)
                table[p + f"{norm}.weight"] = (cell, cell.weight, None)
        table["model.embed_tokens.weight"] = (self.embed_tokens, self.embed_tokens.weight, None)
        table["model.norm.weight"] = (self.norm, self.norm.weight, None)
        if not self.cfg.tie_word_embeddings:
            table["lm_head.weight"] = (self.lm_head, self.lm_head.weight, None)
        return table
