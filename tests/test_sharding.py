"""Tier 1: the tensor-parallel layout and the shard math of every parallel layer.

Each layer is built for every rank of a group, loads its slice of a full numpy tensor the way it
loads a checkpoint, and the ranks' outputs re-assembled (concatenated, or summed by a stand-in
all-reduce) must equal the full computation."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

from msinfer.sharding.config import ModelConfig, ModelConfigError
from msinfer.sharding.layers import (HUGE_PAGE, ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                     QKVParallelLinear, RowParallelLinear, ShapeMismatch, VocabParallelEmbedding,
                                     huge_pages, new_param)
from msinfer.sharding.layout import LayoutError, TPInfo, bytes_per_rank, check_tp, plan_tensors, valid_tp_sizes
from tests.checkpoints import VARIANTS

ms.set_device("CPU")
rng = np.random.default_rng(0)
SMOLLM2 = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)


def cfg(**kw):
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=16, intermediate_size=32,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    return ModelConfig.from_dict({**base, **kw})


def t(x):
    return Tensor(x.astype(np.float32))


class SumOverRanks:
    """Stands in for AllReduce: first records each rank's partial, then returns their sum."""

    def __init__(self):
        self.partials = []

    def __call__(self, x):
        self.partials.append(x.asnumpy())
        return x


def test_column_parallel_concatenates_to_the_full_matmul():
    W, b, x = rng.normal(size=(12, 8)), rng.normal(size=12), rng.normal(size=(3, 8))
    outs = []
    for r in range(3):
        layer = ColumnParallelLinear(8, 12, True, TPInfo(r, 3), ms.float32)
        layer.weight_loader(layer.weight, W, "w")
        layer.weight_loader(layer.bias, b, "b")
        assert layer.weight.shape == (4, 8)
        outs.append(layer(t(x)).asnumpy())
    np.testing.assert_allclose(np.concatenate(outs, 1), x @ W.T + b, rtol=1e-5, atol=1e-5)


def test_row_parallel_sums_partials_and_adds_the_bias_once():
    W, b, x = rng.normal(size=(6, 12)), rng.normal(size=6), rng.normal(size=(3, 12))
    tp = 3
    layers = []
    for r in range(tp):
        layer = RowParallelLinear(12, 6, True, TPInfo(r, tp), ms.float32)
        layer.weight_loader(layer.weight, W, "w")
        layer.weight_loader(layer.bias, b, "b")
        layers.append(layer)
    reducer = SumOverRanks()
    for r, layer in enumerate(layers):
        layer.all_reduce = reducer
        layer(t(x[:, r * 4:(r + 1) * 4]))
    total = sum(reducer.partials)
    for layer in layers:     # second pass: the "all-reduce" hands every rank the sum
        layer.all_reduce = lambda _y, total=total: t(total)
    outs = [layer(t(x[:, r * 4:(r + 1) * 4])).asnumpy() for r, layer in enumerate(layers)]
    for out in outs:
        np.testing.assert_allclose(out, x @ W.T + b, rtol=1e-5, atol=1e-5)


def test_merged_column_holds_gate_and_up_slices_side_by_side():
    G, U, x = rng.normal(size=(8, 4)), rng.normal(size=(8, 4)), rng.normal(size=(2, 4))
    gate, up = [], []
    for r in range(2):
        layer = MergedColumnParallelLinear(4, [8, 8], False, TPInfo(r, 2), ms.float32)
        layer.weight_loader(layer.weight, G, "gate", 0)
        layer.weight_loader(layer.weight, U, "up", 1)
        y = layer(t(x)).asnumpy()
        gate.append(y[:, :4]); up.append(y[:, 4:])
    np.testing.assert_allclose(np.concatenate(gate, 1), x @ G.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(up, 1), x @ U.T, rtol=1e-5, atol=1e-5)


class Int8Source:
    """A checkpoint tensor as sharding.quant.QuantizedWeight reads it: int8 levels with a scale per
    row, each region dequantized, carrying its scales and levels."""

    def __init__(self, rows: int, cols: int):
        self.q = rng.integers(-127, 128, (rows, cols)).astype(np.int8)
        self.scales = rng.uniform(0.01, 0.02, rows).astype(np.float32)

    def get_shape(self):
        return self.q.shape

    def __getitem__(self, index):
        from msinfer.sharding.quant import Dequantized
        q = self.q[index]
        return Dequantized.of(q * self.scales[index[0], None], row_scales=self.scales[index[0]], levels=q)


def test_a_merged_projection_takes_its_parts_in_any_order_in_its_dtype_with_their_scales_and_levels():
    """q, k and v arrive in any order (gathered on the host, sharding.layers.gather_part): the
    float16 parameter holds each at its rows, and a quantized part's scales (per row) stand at its
    rows of the parameter's, NaN at the float parts' rows. The int8 levels the parts loaded as go
    to the device as they are (carried_levels) only where every part carries them."""
    from msinfer.sharding.layers import carried_levels
    D = 3
    c = cfg(num_attention_heads=4, num_key_value_heads=2, hidden_size=12, head_dim=D)
    rows = {"q": 4 * D, "k": 2 * D, "v": 2 * D}
    W = {s: rng.normal(size=(n, 12)) for s, n in rows.items()}
    W["k"] = Int8Source(2 * D, 12)
    layer = QKVParallelLinear(c, False, TPInfo(0, 1), ms.float16)
    for s in "vqk":
        layer.weight_loader(layer.weight, W[s], s, s)
    held = layer.weight.asnumpy()
    assert held.dtype == np.float16
    np.testing.assert_array_equal(held, np.concatenate([W["q"], W["k"][:, :], W["v"]]).astype(np.float16))
    scales = layer.weight.row_scales
    np.testing.assert_array_equal(scales[4 * D:6 * D], W["k"].scales)
    assert np.isnan(scales[:4 * D]).all() and np.isnan(scales[6 * D:]).all()
    assert not layer.host and carried_levels(layer.weight) is None      # q and v are floats: none carried
    all_int8 = {s: Int8Source(n, 12) for s, n in rows.items()}
    layer = QKVParallelLinear(c, False, TPInfo(0, 1), ms.float16)
    for s in "kvq":
        layer.weight_loader(layer.weight, all_int8[s], s, s)
    np.testing.assert_array_equal(carried_levels(layer.weight), np.concatenate([all_int8[s].q for s in "qkv"]))


@pytest.mark.parametrize("heads,kv_heads,tp", [(4, 2, 2), (4, 1, 2), (4, 2, 4), (4, 4, 2)])
def test_qkv_parallel_splits_query_heads_and_replicates_kv_heads_when_needed(heads, kv_heads, tp):
    D = 3
    c = cfg(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=heads * D, head_dim=D)
    Wq, Wk, Wv = (rng.normal(size=(n * D, c.hidden_size)) for n in (heads, kv_heads, kv_heads))
    x = rng.normal(size=(2, c.hidden_size))
    q_parts = []
    for r in range(tp):
        layer = QKVParallelLinear(c, False, TPInfo(r, tp), ms.float32)
        for s, W in zip("qkv", (Wq, Wk, Wv)):
            layer.weight_loader(layer.weight, W, s, s)
        y = layer(t(x)).asnumpy()
        q = y[:, : layer.q_heads * D]
        k = y[:, layer.q_heads * D: (layer.q_heads + layer.kv_heads) * D]
        q_parts.append(q)
        # the KV head(s) this rank holds are the ones its query heads attend to
        group = heads // kv_heads
        first_kv = (r * layer.q_heads) // group
        np.testing.assert_allclose(k, x @ Wk[first_kv * D:(first_kv + layer.kv_heads) * D].T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(q_parts, 1), x @ Wq.T, rtol=1e-5, atol=1e-5)


def test_vocab_parallel_embedding_and_lm_head_cover_the_vocab_with_padding():
    V, H, tp = 10, 4, 3                     # 10 rows over 3 ranks: 4 + 4 + 2 (padded to 4)
    E, ids, x = rng.normal(size=(V, H)), np.array([0, 3, 4, 9]), rng.normal(size=(2, H))
    reducer, logits = SumOverRanks(), []
    for r in range(tp):
        emb = VocabParallelEmbedding(V, H, TPInfo(r, tp), ms.float32)
        emb.weight_loader(emb.weight, E, "embed")
        emb.all_reduce = reducer
        emb(Tensor(ids.astype(np.int32)))
        head = ParallelLMHead(V, H, TPInfo(r, tp), ms.float32, tied=emb)
        head.all_gather = None
        logits.append(head(t(x)).asnumpy())
    np.testing.assert_allclose(sum(reducer.partials), E[ids], rtol=1e-6)
    full = np.concatenate(logits, 1)[:, :V]
    np.testing.assert_allclose(full, x @ E.T, rtol=1e-5, atol=1e-5)
    assert np.all(np.concatenate(logits, 1)[:, V:] == 0)   # padded rows hold zeros


def test_a_tensor_of_the_wrong_shape_is_named():
    layer = ColumnParallelLinear(8, 12, False, TPInfo(0, 1), ms.float32)
    with pytest.raises(ShapeMismatch, match=r"'model.layers.0.mlp.up_proj.weight' has shape \[12, 7\]"):
        layer.weight_loader(layer.weight, np.zeros((12, 7)), "model.layers.0.mlp.up_proj.weight")


def _advised(address: int) -> bool:
    """Whether the mapping holding `address` is advised into huge pages (smaps' VmFlags `hg`)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="a kernel without transparent huge pages refuses MADV_HUGEPAGE")
def test_a_stacks_memory_is_advised_into_huge_pages_before_it_is_written_and_keeps_its_values():
    """CausalLM.stack_weights asks for 2 MB pages for a stack's own memory (a zero Parameter's)
    before writing the layers' weights into it: the mapping of its 2 MB-aligned interior is then
    advised (VmFlags `hg`), whatever the allocator did with it before, and the values written
    are read back. Memory too small to hold an aligned 2 MB page is left as it is."""
    whole = new_param((4, HUGE_PAGE // 4), ms.float32, "stack.test")      # 8 MB
    held = whole.asnumpy()
    assert huge_pages(held)
    inside = -(-held.ctypes.data // HUGE_PAGE) * HUGE_PAGE
    assert _advised(inside) and _advised(inside + HUGE_PAGE)
    values = rng.standard_normal(held.shape).astype(np.float32)
    held[...] = values
    np.testing.assert_array_equal(whole.asnumpy(), values)
    small = np.ones(HUGE_PAGE // 8, np.float32)                           # 1 MB: no aligned page inside
    assert not huge_pages(small)


def test_layout_for_smollm2_names_the_sizes_that_work():
    c = ModelConfig.from_dict(SMOLLM2)
    assert valid_tp_sizes(c) == [1, 3]
    with pytest.raises(LayoutError) as e:
        check_tp(c, 2)
    msg = str(e.value)
    assert "num_attention_heads=9" in msg and "num_key_value_heads=3" in msg and "Sizes that work: 1, 3" in msg


def test_plan_gives_every_rank_an_equal_share_of_the_sharded_bytes():
    c = ModelConfig.from_dict(SMOLLM2)
    one, three = bytes_per_rank(c, 1), bytes_per_rank(c, 3)
    replicated = sum(4 * np.prod(p.rank_shape) for p in plan_tensors(c, 1) if p.split_dim is None)
    assert three == pytest.approx((one - replicated) / 3 + replicated, rel=1e-6)
    plans = {p.name: p for p in plan_tensors(c, 3)}
    assert plans["model.layers.0.self_attn.o_proj.weight"].split_dim == 1
    assert plans["model.layers.0.self_attn.k_proj.weight"].rank_shape == (64, 576)
    assert "lm_head.weight" not in plans                      # tied to the embedding


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"MistralForCausalLM.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        ModelConfig.from_dict({**SMOLLM2, "architectures": ["MistralForCausalLM"]})


def test_an_activation_other_than_silu_is_refused_rather_than_computed_as_silu():
    """The MLPs compute SiLU: a checkpoint trained with another hidden_act would run with wrong
    tokens and no word, so its config is refused by name."""
    assert ModelConfig.from_dict({**SMOLLM2, "hidden_act": "swish"}).family == "llama"
    for act in ("gelu", "relu"):
        with pytest.raises(ModelConfigError, match=f"config.json: hidden_act '{act}' is not supported: msinfer's "
                                                   f"MLPs and experts compute SiLU"):
            ModelConfig.from_dict({**SMOLLM2, "hidden_act": act})


def test_a_tied_config_with_its_own_lm_head_in_the_checkpoint_says_the_head_is_unused(checkpoint, tmp_path):
    """A config that ties the head to the embedding, over a checkpoint that also holds lm_head.weight:
    msinfer computes with the embedding (as vLLM), and plan's notes say the head is not used."""
    import shutil

    from safetensors.numpy import load_file, save_file
    from msinfer.worker.loader import check_checkpoint
    folder = tmp_path / "tied"
    shutil.copytree(checkpoint("llama_gqa_tied"), folder)
    config = ModelConfig.from_dir(folder)
    plans = plan_tensors(config, 1)
    notes = []
    check_checkpoint(folder, plans, notes=notes)
    assert notes == []
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] * 2}, str(folder / "model.safetensors"))
    check_checkpoint(folder, plans, notes=notes)
    assert len(notes) == 1 and "tie_word_embeddings: true), so the checkpoint's own lm_head.weight is not used" in notes[0]


def test_rope_theta_is_read_at_top_level_and_inside_rope_parameters():
    top = ModelConfig.from_dict({**SMOLLM2, "rope_theta": 100000.0})
    nested = ModelConfig.from_dict({**SMOLLM2, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}})
    assert top.rope_theta == nested.rope_theta == 100000.0


@pytest.mark.integration
@pytest.mark.parametrize("name", ["llama_mha_bias", "qwen2_tied_5_layers", "qwen3_qknorm_odd_head_dim",
                                  "qwen3_moe_top2_dense_layer", "qwen2_moe_top4_shared_tied",
                                  "deepseek_v3_yarn_groups", "deepseek_v2_groups_no_q_lora"])
def test_the_plan_lists_the_tensors_each_stage_and_rank_loads(name, checkpoint):
    """The layout is written twice, as the planner's list (plan_tensors: what plan checks in the
    checkpoint and sizes) and as the network's loaders (CausalLM.named_loaders: what a rank
    reads): for every architecture, at tp 1 and 2, one stage or two (three), with experts sliced
    or whole per rank, both name the same tensors."""
    from msinfer.sharding.layout import Stage, stage_layers
    from msinfer.worker.model import CausalLM
    from msinfer.worker.device import select_ops
    from msinfer.worker.positions import make_scheme
    config = ModelConfig.from_dir(checkpoint(name))
    dev = select_ops("cpu")
    for tp, ep in ((1, False), (2, False), (2, True)):
        if (ep and not config.is_moe) or check_tp_problem(config, tp, ep):
            continue
        for pp in (1, 2, 3):
            if pp > config.num_layers:
                continue
            ranges = stage_layers(config.num_layers, pp)
            for s in range(pp):
                stage = Stage.of(ranges, s)
                model = CausalLM(config, TPInfo(0, tp, ep), ms.float32, dev, 4, make_scheme().freq_matrix(config),
                                 16, stage)
                planned = {p.name for p in plan_tensors(config, tp, ep, stage) if all(p.rank_shape)}
                assert set(model.named_loaders()) == planned, (name, tp, ep, pp, s)


def check_tp_problem(config, tp, ep) -> bool:
    try:
        check_tp(config, tp, ep)
    except LayoutError:
        return True
    return False


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_plan_and_the_loaders_agree_on_every_tensor_and_its_slice(name, checkpoint):
    """The planner's tensor list (sharding.layout.plan_tensors: what plan checks and sizes) and the
    network's loaders (CausalLM.named_loaders and each layer's weight_loader) are two statements of
    one layout. For every test architecture, at tp 1 and 2 (a mixture of experts sliced and expert
    parallel), whole and as each stage of pp 2: they name the same tensors, and rank 0's
    parameters hold exactly the slices the plan gives it (every checkpoint tensor filled with
    values no other holds, loaded through the layers' own weight_loader)."""
    from msinfer.sharding.layout import Stage, stage_layers
    from msinfer.worker.model import CausalLM
    from msinfer.worker.ops import MsOps
    from msinfer.worker.positions import make_scheme
    c = ModelConfig.from_dir(checkpoint(name))
    freq = make_scheme("rope").freq_matrix(c)
    for tp in (1, 2):
        for ep in (False, True) if c.is_moe else (False,):
            for stage in (Stage(), *(Stage.of(stage_layers(c.num_layers, 2), s) for s in range(2))):
                where = f"{name} tp {tp} ep {ep} layers {stage.layers(c.num_layers)}"
                plans = [p for p in plan_tensors(c, tp, ep, stage) if np.prod(p.rank_shape) > 0]   # held here
                model = CausalLM(c, TPInfo(0, tp, ep), ms.float32, MsOps, 2, freq, 16, stage)
                table = model.named_loaders()
                assert sorted(table) == sorted(p.name for p in plans), where
                want: dict[str, list] = {}
                start = 1
                for p in plans:
                    src = np.arange(start, start + np.prod(p.full_shape), dtype=np.float32).reshape(p.full_shape)
                    start += src.size
                    layer, param, shard = table[p.name]
                    layer.weight_loader(param, src, p.name, shard)
                    want.setdefault(param.name, []).append(src[tuple(slice(0, n) for n in p.rank_shape)].ravel())
                assert start < 2 ** 24, "values past float32's whole numbers"
                held = {param.name: param.asnumpy().ravel() for _, param, _ in table.values()}
                for pname, parts in want.items():
                    got = held[pname]
                    np.testing.assert_array_equal(np.sort(got[got != 0]), np.sort(np.concatenate(parts)),
                                                  err_msg=f"{where}: {pname}")
