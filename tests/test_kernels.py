"""The CPU kernels against numpy, on the shapes the model tests do not reach: the matmul with a
last panel narrower than 32 columns (a tensor-parallel shard of an odd size), zero rows
(padding) and every row count up to three blocks of rows, the gate/up projection with its
activation, lookups with out-of-range indices, and paged attention with head sizes of 24 to 128,
float16, a step that mixes a prefill chunk, decode tokens and padding, and random steps of every
kind the runner packs; a mixture of experts' grouped experts; and the bfloat16 weights in AMX
tiles (where the CPU has AMX). All of it again with the library built for a CPU without AVX-512
(where this one has it)."""

from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor, ops

from msinfer.worker.cpu import CpuOps, load_kernels


@pytest.fixture(scope="module")
def kernels():
    load_kernels(2)                 # MindSpore's default device here is the CPU
    return CpuOps


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 2e-3)])
@pytest.mark.parametrize("M,K,N", [(1, 40, 70), (17, 64, 96), (33, 24, 45)])
def test_linear_over_packed_weights_equals_x_w_transposed(kernels, M, K, N, dtype, tol):
    rng = np.random.default_rng(M * N)
    x = rng.standard_normal((M, K)).astype(dtype)
    w = (rng.standard_normal((N, K)) * 0.1).astype(dtype)
    np.testing.assert_array_equal(kernels.unpack(kernels.pack(w)), w)
    y = kernels.linear_op()(Tensor(x), Tensor(kernels.pack(w))).asnumpy()
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(y, ref, atol=tol * np.abs(ref).max(), rtol=0)


def experts_reference(x, ids, weights, w13, w2, first):
    """sum_j weights[n, j] * down(silu(gate x[n]) * up x[n]) of expert ids[n, j] over the experts
    held (first .. first + len(w13) - 1), in float64."""
    inter = w2.shape[2]
    ref = np.zeros(x.shape)
    for n, j in np.ndindex(*ids.shape):
        e = ids[n, j] - first
        if 0 <= e < len(w13):
            h = w13[e].astype(np.float64) @ x[n].astype(np.float64)
            act = h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:]
            ref[n] += float(weights[n, j]) * (w2[e].astype(np.float64) @ act)
    return ref


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 4e-3)])
@pytest.mark.parametrize("inter,first,glu", [(32, 0, True), (24, 0, False), (32, 3, True)],
                         ids=["fused-gate-up", "unfused", "experts-3-to-6-held"])
def test_grouped_experts_sum_each_tokens_routed_experts_weighted(kernels, inter, first, glu, dtype, tol):
    """MoeExperts: 21 tokens (two of them padding) x top 3 of 8 experts, against numpy. Held
    experts first..first+E-1 only (expert parallel): a token's other experts add nothing."""
    rng = np.random.default_rng(inter + first)
    N, H, K, E_all = 21, 40, 3, 8
    E = E_all if first == 0 else 4
    x = rng.standard_normal((N, H)).astype(dtype)
    x[-2:] = 0
    ids = np.stack([rng.choice(E_all, K, replace=False) for _ in range(N)]).astype(np.int32)
    weights = rng.random((N, K)).astype(dtype)
    w13 = (rng.standard_normal((E, 2 * inter, H)) * 0.2).astype(dtype)
    w2 = (rng.standard_normal((E, H, inter)) * 0.2).astype(dtype)
    packed13, unpack13 = kernels.pack_experts(w13, glu)
    packed2, unpack2 = kernels.pack_experts(w2)
    np.testing.assert_array_equal(unpack13(packed13), w13)
    y = kernels.moe_op()(Tensor(x), Tensor(ids), Tensor(weights), Tensor(packed13), Tensor(packed2),
                         Tensor(np.array([first, int(glu)], np.int32))).asnumpy()
    ref = experts_reference(x, ids, weights, w13, w2, first)
    assert not y[-2:].any()
    np.testing.assert_allclose(y, ref, atol=tol * np.abs(ref).max(), rtol=0)



@pytest.mark.parametrize("routing", ["spread", "one hot expert", "held experts only"])
def test_grouped_experts_of_any_token_count_and_routing_sum_what_numpy_sums(kernels, routing):
    """MoeExperts over token counts from 1 to 260 (an expert's rows in groups and blocks of rows,
    or none), top 1, 2 or 4 of 8 experts, routed evenly, nearly all to one expert, or only to the
    experts held (4 of them, from expert 2, with and without the fused gate/up), against numpy."""
    rng = np.random.default_rng(["spread", "one hot expert", "held experts only"].index(routing))
    H, inter, E_all = 40, 32, 8
    for N in (1, 2, 5, 16, 33, 130, 260):
        K = int(rng.choice([1, 2, 4]))
        first = 2 if routing == "held experts only" else int(rng.choice([0, 2]))
        E = E_all if first == 0 else 4
        glu = bool(rng.random() < 0.5)
        if routing == "one hot expert":
            ids = np.stack([np.r_[first, rng.choice(np.arange(E_all)[np.arange(E_all) != first], K - 1, replace=False)]
                            for _ in range(N)])
        else:
            pool = np.arange(first, first + E) if routing == "held experts only" else np.arange(E_all)
            ids = np.stack([rng.choice(pool, K, replace=False) for _ in range(N)])
        ids = ids.astype(np.int32)
        x = rng.standard_normal((N, H)).astype(np.float32)
        weights = rng.random((N, K)).astype(np.float32)
        w13 = (rng.standard_normal((E, 2 * inter, H)) * 0.2).astype(np.float32)
        w2 = (rng.standard_normal((E, H, inter)) * 0.2).astype(np.float32)
        packed13, packed2 = kernels.pack_experts(w13, glu)[0], kernels.pack_experts(w2)[0]
        y = kernels.moe_op()(Tensor(x), Tensor(ids), Tensor(weights), Tensor(packed13), Tensor(packed2),
                             Tensor(np.array([first, int(glu)], np.int32))).asnumpy()
        ref = experts_reference(x, ids, weights, w13, w2, first)
        said = f"{routing}: {N} tokens, top {K}, experts {first}..{first + E - 1}, glu {glu}"
        np.testing.assert_allclose(y, ref, atol=1e-5 * np.abs(ref).max(), rtol=0, err_msg=said)

def test_grouped_experts_over_bfloat16_tiles_give_their_float32_panels_result(kernels):
    """Experts of a bfloat16 checkpoint (every value a bfloat16) go to AMX tiles where the CPU has
    them, the gate/up projection fused; the result is the float32 panels' to float32 accuracy."""
    from msinfer.worker.cpu import bfloat16_bits
    if not kernels.amx:
        pytest.skip("no AMX on this CPU: bfloat16 experts stay in float32 panels")
    rng = np.random.default_rng(5)
    N, H, I, E, K = 19, 64, 32, 6, 2

    def bf16(a):
        return (bfloat16_bits(a.astype(np.float32)).astype(np.uint32) << 16).view(np.float32)
    x = rng.standard_normal((N, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
    weights = rng.random((N, K)).astype(np.float32)
    w13, w2 = bf16(rng.standard_normal((E, 2 * I, H)) * 0.2), bf16(rng.standard_normal((E, H, I)) * 0.2)
    meta = Tensor(np.array([0, 1], np.int32))
    tiles13, unpack13 = kernels.pack_experts(w13, True)
    tiles2, unpack2 = kernels.pack_experts(w2)
    assert tiles13.dtype == tiles2.dtype == np.int16                  # half the bytes of float32
    np.testing.assert_array_equal(unpack13(tiles13), w13)
    np.testing.assert_array_equal(unpack2(tiles2), w2)
    args = (Tensor(x), Tensor(ids), Tensor(weights))
    y = kernels.moe_op()(*args, Tensor(tiles13), Tensor(tiles2), meta).asnumpy()
    panels = kernels.moe_op()(*args, Tensor(np.stack([kernels.pack_glu(e) for e in w13])),
                              Tensor(np.stack([kernels.pack(e) for e in w2])), meta).asnumpy()
    np.testing.assert_allclose(y, panels, atol=2e-6 * np.abs(panels).max(), rtol=0)


@pytest.mark.parametrize("zero", [[1, 4, 5], [3, 4, 5], [0, 1, 2, 3, 4, 5]], ids=["among", "trailing", "all"])
def test_zero_rows_give_zero_rows_and_the_others_are_unchanged(kernels, zero):
    """Zero rows (a step's padding, its padded logit rows) are skipped: trailing ones in place,
    others gathered out."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    x[zero] = 0
    w = rng.standard_normal((50, 32)).astype(np.float32)
    y = kernels.linear_op()(Tensor(x), Tensor(kernels.pack(w))).asnumpy()
    np.testing.assert_allclose(y, x @ w.T, atol=1e-4)
    assert not y[zero].any()


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 4e-3)])
def test_a_residual_add_and_the_norm_after_it_in_one_kernel_give_what_the_two_give(kernels, dtype, tol):
    """AddRmsNorm (a layer's residual add with the next norm): the sum the network's add gives
    and the RmsNorm kernel's result on it, bit for bit, near numpy's; zero rows (padding) stay
    zero in both outputs."""
    rng = np.random.default_rng(5)
    x, d = (rng.standard_normal((7, 3, 40)).astype(dtype) for _ in range(2))
    x[-1], d[-1] = 0, 0
    w = (1 + 0.1 * rng.standard_normal(40)).astype(dtype)
    s, y = kernels.add_rms_norm_op(1e-6)(Tensor(x), Tensor(d), Tensor(w))
    s, y = s.asnumpy(), y.asnumpy()
    added = (Tensor(x) + Tensor(d)).asnumpy()
    np.testing.assert_array_equal(s, added)
    np.testing.assert_array_equal(y, kernels.rms_norm_op(1e-6)(Tensor(added), Tensor(w)).asnumpy())
    ref = added.astype(np.float64)
    ref = ref / np.sqrt((ref**2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(y, ref, atol=tol * np.abs(ref).max(), rtol=0)
    assert not s[-1].any() and not y[-1].any()


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 4e-3)])
def test_linear_glu_is_silu_of_the_gate_times_the_up_projection(kernels, dtype, tol):
    """The MLP's gate/up projection with its activation (LinearGlu): 19 rows (a group of 14 and
    one of 5, the last two padding), 3 panels of 16 gate and 16 up columns."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((19, 40)).astype(dtype)
    x[-2:] = 0
    w = (rng.standard_normal((96, 40)) * 0.2).astype(dtype)          # gate rows 0-47, up rows 48-95
    np.testing.assert_array_equal(kernels.unpack_glu(kernels.pack_glu(w)), w)
    y = kernels.glu_linear_op()(Tensor(x), Tensor(kernels.pack_glu(w))).asnumpy()
    h = x.astype(np.float64) @ w.astype(np.float64).T
    ref = h[:, :48] / (1 + np.exp(-h[:, :48])) * h[:, 48:]
    assert y.shape == (19, 48)
    np.testing.assert_allclose(y, ref, atol=tol * np.abs(ref).max(), rtol=0)
    assert not y[-2:].any()


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 4e-3)])
@pytest.mark.parametrize("M,K,N,glu", [(1, 40, 70, False), (17, 64, 96, False), (19, 40, 96, True)])
def test_int8_panels_with_row_scales_equal_x_times_the_dequantized_weight(kernels, M, K, N, glu, dtype, tol):
    """A quantized checkpoint's int8 weight and its row scales (CpuOps.pack_int8): Linear and
    LinearGlu give x (q * s)^T, with a last panel narrower than 32 and padding rows; a weight
    that is not exactly q * s (an adapter merged into it) or a row without a scale stays float."""
    rng = np.random.default_rng(M + N)
    x = rng.standard_normal((M, K)).astype(dtype)
    x[-1:] = 0 if M > 1 else x[-1:]
    q = rng.integers(-128, 128, size=(N, K)).astype(np.float32)
    s = rng.uniform(1e-3, 1e-2, size=N).astype(np.float32)
    w = (q * s[:, None]).astype(dtype)
    packed, unpack = kernels.pack_weight(w, glu, s)
    assert packed.dtype == np.int8 and packed.shape == (N, K + 4)         # the scales, then a byte a weight
    np.testing.assert_array_equal(unpack(packed).astype(dtype), w)
    op = kernels.glu_linear_op() if glu else kernels.linear_op()
    y = op(Tensor(x), Tensor(packed)).asnumpy()
    h = x.astype(np.float64) @ w.astype(np.float64).T
    ref = h[:, :N // 2] / (1 + np.exp(-h[:, :N // 2])) * h[:, N // 2:] if glu else h
    np.testing.assert_allclose(y, ref, atol=tol * np.abs(ref).max(), rtol=0)
    if M > 1:
        assert not y[-1:].any()
    merged = w + np.asarray(1e-4, dtype)
    assert kernels.pack_weight(merged, glu, s)[0].dtype == dtype
    assert kernels.pack_weight(w, glu, np.where(np.arange(N) == 3, np.nan, s).astype(np.float32))[0].dtype == dtype


@pytest.mark.parametrize("divisor,away", [(127.5, False), (127.0, True)])
def test_quant_rows_gives_each_rows_int8_levels_as_compressed_tensors_and_modelslim_round(kernels, divisor, away):
    """A W8A8 layer's input (QuantRows): each row to round(x / s) * s, s = max|x| / divisor,
    clamped to -128..127, halves to even (compressed-tensors, torch.round) or away from zero
    (ModelSlim on CANN); a row of zeros stays zeros."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    x[1] = 0
    s = np.abs(x).max(1, keepdims=True) / np.float32(divisor)
    x[2, :4] = (np.array([0.5, 1.5, -2.5, 3.5], np.float32) * s[2])       # exact halves
    s = np.abs(x).max(1, keepdims=True) / np.float32(divisor)
    s[s == 0] = np.finfo(np.float32).eps
    v = x / s
    r = np.sign(v) * np.floor(np.abs(v) + 0.5) if away else np.rint(v)
    ref = np.clip(r, -128, 127) * s
    y = kernels.quant_rows_op()(Tensor(x), Tensor(np.array([divisor, float(away)], np.float32))).asnumpy()
    np.testing.assert_array_equal(y, ref.astype(np.float32))
    assert not y[1].any()


@pytest.fixture(scope="module")
def vnni(kernels):
    if not kernels.vnni:
        pytest.skip("no AVX512-VNNI on this CPU: W8A8 layers use int8 panels and float32 products")
    return kernels


def _per_token(x: np.ndarray, divisor: float, away: bool, amax=None):
    """x's rows quantized as sharding.layers.PerTokenInt8 does, in float32: (levels, scales)."""
    a = np.abs(x).max(1, keepdims=True) if amax is None else amax
    s = (a / np.float32(divisor)).astype(np.float32)
    s[s == 0] = np.finfo(np.float32).eps
    v = x / s
    return np.clip(np.sign(v) * np.floor(np.abs(v) + 0.5) if away else np.rint(v), -128, 127), s


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("M,K,N,glu,divisor,away,split", [(1, 40, 64, False, 127.5, False, False),
                                                           (17, 66, 96, False, 127.0, True, True),
                                                           (19, 64, 128, True, 127.5, False, False)])
def test_int8_inputs_and_weights_with_vnni_give_the_exact_sum_of_the_levels_scaled(vnni, M, K, N, glu, divisor,
                                                                                  away, split, dtype):
    """A W8A8 layer with VNNI (CpuInt8Linear): x's rows quantized as the layer's quantizer does
    (with the row's maximum over the ranks that split it, given), the int8 products summed
    exactly, times the row's and the column's scale; trailing padding rows are zeros; the packed
    weight unpacks to its levels."""
    from msinfer.sharding.layers import PerTokenInt8
    from msinfer.worker.cpu import CpuInt8Linear
    rng = np.random.default_rng(M + K + N)
    x = rng.standard_normal((M, K)).astype(dtype)
    x[0, :4] = 0.5                               # halves, once scaled: the rounding mode decides them
    if M > 1:
        x[-2:] = 0
    q = rng.integers(-128, 128, size=(N, K)).astype(np.int8)
    s = rng.uniform(1e-3, 1e-2, size=N).astype(np.float32)
    cell = CpuInt8Linear(PerTokenInt8(0, divisor, away), glu)
    data, unpack = cell.pack(q)
    assert data.dtype == np.int8 and data.shape == (N, -(-K // 4) * 4)
    np.testing.assert_array_equal(unpack(data), q)
    xf = x.astype(np.float32)
    amax = np.abs(xf).max(1, keepdims=True) * (1.5 if split else 1)    # another rank's part is larger
    levels, xs = _per_token(xf, divisor, away, amax if split else None)
    h = (levels.astype(np.float64) @ q.astype(np.float64).T) * xs * s
    ref = h[:, :N // 2] / (1 + np.exp(-h[:, :N // 2])) * h[:, N // 2:] if glu else h
    args = (Tensor(x), Tensor(data), cell.scales(s), cell.quantizer.meta) + ((Tensor(amax),) if split else ())
    y = cell.op(*args).asnumpy().astype(np.float64)
    tol = 1e-6 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(y, ref, atol=tol * np.abs(ref).max(), rtol=0)
    if M > 1:
        assert not y[-2:].any()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("M,K,N,group,glu", [(1, 64, 64, 32, False), (13, 64, 64, 16, True), (17, 96, 96, 32, True),
                                             (30, 256, 80, 128, False), (5, 32, 6, 16, False)])
def test_int4_groups_give_the_float32_panels_result_of_their_dequantized_weight(kernels, M, K, N, group, glu,
                                                                                dtype):
    """A W4A16 layer (CpuInt4Linear): int4 levels two a byte with a scale per group of inputs,
    each weight scaled to its dequantized value as it is read, give what the float32 panels of the
    dequantized weight give, bit for bit (float32), and numpy's product; trailing padding rows are
    zeros; the packing unpacks to the levels, at an eighth of float32's bytes. Up to 12 rows read
    the int4 panels; 13 or more read each panel widened once to float32; a last panel narrower
    than 32 columns (80, 6) is widened too."""
    from msinfer.worker.cpu import CpuInt4Linear
    if not kernels.int4:
        pytest.skip("no AVX-512 on this CPU: W4A16 weights are dequantized")
    rng = np.random.default_rng(M + K + N)
    x = rng.standard_normal((M, K)).astype(dtype)
    if M > 1:
        x[-2:] = 0
    q = rng.integers(-8, 8, size=(N, K)).astype(np.int8)
    s = rng.uniform(1e-2, 3e-2, size=(N, K // group)).astype(np.float32)
    w = q * np.repeat(s, group, axis=1)                          # float32: the loader's dequantized weight
    cell = CpuInt4Linear(group, glu)
    data, unpack = cell.pack(q)
    assert data.dtype == np.uint8 and data.nbytes * 8 == w.nbytes
    np.testing.assert_array_equal(unpack(data), q)
    y = cell(Tensor(x), Tensor(data), cell.scales(s)).asnumpy()
    panels = (kernels.glu_linear_op() if glu else kernels.linear_op())(
        Tensor(x), Tensor((kernels.pack_glu if glu else kernels.pack)(w.astype(dtype)))).asnumpy()
    if dtype == np.float32:
        np.testing.assert_array_equal(y, panels)
    h = x.astype(np.float64) @ w.astype(np.float64).T
    ref = h[:, :N // 2] / (1 + np.exp(-h[:, :N // 2])) * h[:, N // 2:] if glu else h
    tol = 1e-5 if dtype == np.float32 else 3e-3
    np.testing.assert_allclose(y.astype(np.float64), ref, atol=tol * np.abs(ref).max(), rtol=0)
    if M > 1:
        assert not y[-2:].any()


@pytest.mark.parametrize("M,I,group,first,glu", [(21, 32, 16, 0, True), (40, 24, 8, 3, False)],
                         ids=["fused-gate-up", "unfused-experts-3-to-6-held"])
def test_int4_experts_give_the_float32_panels_result_of_their_dequantized_weights(kernels, M, I, group, first, glu):
    """W4A16 experts (MoeExperts over CpuInt4Linear's layout, its group scales given): each
    expert's int4 levels, widened to their dequantized values as they are read, give what the same
    experts' dequantized weights in float32 panels give, bit for bit, and numpy's result; at 21
    tokens x top 3 of 8 every expert reads its panels as int4, at 40 some read them widened to
    float32 (more than 12 rows). The packing unpacks to the levels, at an eighth of float32's
    bytes; a step's padding rows give zeros."""
    if not kernels.int4:
        pytest.skip("no AVX-512 on this CPU: W4A16 experts are dequantized")
    rng = np.random.default_rng(M + I)
    H, K, E_all = 64, 3, 8
    E = E_all if first == 0 else 4
    x = rng.standard_normal((M, H)).astype(np.float32)
    x[-2:] = 0
    ids = np.stack([rng.choice(E_all, K, replace=False) for _ in range(M)]).astype(np.int32)
    if M > 30:
        ids[:20, 0] = first                           # 20 rows for one expert
    weights = rng.random((M, K)).astype(np.float32)
    q13, q2 = (rng.integers(-8, 8, shape).astype(np.int8) for shape in ((E, 2 * I, H), (E, H, I)))
    s13 = rng.uniform(1e-2, 3e-2, (E, 2 * I, H // group)).astype(np.float32)
    s2 = rng.uniform(1e-2, 3e-2, (E, H, I // group)).astype(np.float32)
    w13, w2 = q13 * np.repeat(s13, group, axis=-1), q2 * np.repeat(s2, group, axis=-1)
    (p13, unpack13), (p2, unpack2) = kernels.pack_experts(q13, glu, s13), kernels.pack_experts(q2, False, s2)
    assert p13.dtype == p2.dtype == np.uint8 and p13.nbytes * 8 == w13.nbytes
    np.testing.assert_array_equal(unpack13(p13), q13)
    np.testing.assert_array_equal(unpack2(p2), q2)
    meta = Tensor(np.array([first, int(glu)], np.int32))
    args = (Tensor(x), Tensor(ids), Tensor(weights))
    y = kernels.moe_op()(*args, Tensor(p13), Tensor(p2), meta, Tensor(kernels.expert_scales(s13, glu)),
                         Tensor(kernels.expert_scales(s2))).asnumpy()
    (f13, _), (f2, _) = kernels.pack_experts(w13, glu), kernels.pack_experts(w2)
    panels = kernels.moe_op()(*args, Tensor(f13), Tensor(f2), meta).asnumpy()
    np.testing.assert_array_equal(y, panels)
    ref = experts_reference(x, ids, weights, w13, w2, first)
    np.testing.assert_allclose(y, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
    assert not y[-2:].any()


def _routed(N, K, E_all, rng, pad=2):
    """Top-K ids of E_all experts for N tokens, the last `pad` of them padding."""
    ids = np.stack([rng.choice(E_all, K, replace=False) for _ in range(N)]).astype(np.int32)
    return ids, rng.random((N, K)).astype(np.float32)


def _silu_times(g, u, dtype):
    """silu(g) * u as the kernels compute it: silu rounded to dtype, then the product."""
    g = g.astype(np.float32)
    return (((g / (1 + np.exp(-g))).astype(dtype).astype(np.float32)) * u.astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-6), (np.float16, 2e-3)])
@pytest.mark.parametrize("first,divisor,away,split", [(0, 127.5, False, False), (3, 127.0, True, True)],
                         ids=["all-held", "experts-3-to-6-held-split-rows"])
def test_int8_experts_with_vnni_give_each_pairs_exact_level_sums_scaled(vnni, first, divisor, away, split, dtype,
                                                                        tol):
    """W8A8 experts with VNNI (CpuExperts' two calls). MoeUp: each (token, expert) pair's row of
    silu(gate) * up, from the token's row quantized per token and the int8 products summed exactly,
    times the row's and the column's scale (gate and up interleaved in the packing); zeros for a
    padding token and for experts held elsewhere. MoeDown: each pair's row quantized (with the
    row's maximum over the ranks that split it, given), through down, weighted and summed per
    token. Against numpy, each call from the same input as the kernel's."""
    from msinfer.sharding.layers import PerTokenInt8
    from msinfer.worker.cpu import CpuExperts
    rng = np.random.default_rng(first + int(split))
    N, H, I, K, E_all = 21, 64, 48, 3, 8
    E = E_all if first == 0 else 4
    x = rng.standard_normal((N, H)).astype(dtype)
    x[-2:] = 0
    ids, weights = _routed(N, K, E_all, rng)
    weights = weights.astype(dtype)
    q13 = rng.integers(-128, 128, (E, 2 * I, H)).astype(np.int8)
    q2 = rng.integers(-128, 128, (E, H, I)).astype(np.int8)
    s13 = rng.uniform(1e-3, 1e-2, (E, 2 * I)).astype(np.float32)
    s2 = rng.uniform(1e-3, 1e-2, (E, H)).astype(np.float32)
    p13, unpack13 = vnni.pack_experts(q13, True)
    p2, unpack2 = vnni.pack_experts(q2)
    np.testing.assert_array_equal(unpack13(p13), q13)
    np.testing.assert_array_equal(unpack2(p2), q2)
    cell = CpuExperts()
    xq, hq = PerTokenInt8(0, divisor, away), PerTokenInt8(0, divisor, away)
    meta = Tensor(np.array([first, 1], np.int32))
    h = cell.up(Tensor(x), Tensor(ids), Tensor(p13), meta, Tensor(vnni.expert_scales(s13, True)),
                xq.meta).asnumpy()
    assert h.shape == (N * K, I) and h.dtype == dtype
    levels, xs = _per_token(x.astype(np.float32), divisor, away)
    want = np.zeros((N * K, I), np.float32)
    for n in range(N - 2):
        for j in range(K):
            e = ids[n, j] - first
            if 0 <= e < E:
                g = (q13[e].astype(np.float64) @ levels[n]).astype(np.float32) * xs[n, 0] * s13[e]
                want[n * K + j] = _silu_times(g[:I].astype(dtype), g[I:].astype(dtype), dtype)
    np.testing.assert_allclose(h.astype(np.float32), want, atol=tol * np.abs(want).max(), rtol=0)
    assert not h[(N - 2) * K:].any()

    amax = np.abs(h.astype(np.float32)).max(1, keepdims=True) * (1.5 if split else 1)
    args = (Tensor(h), Tensor(ids), Tensor(weights), Tensor(p2), meta, Tensor(s2), hq.meta)
    y = cell.down(*args, *((Tensor(amax),) if split else ())).asnumpy()
    hl, hs = _per_token(h.astype(np.float32), divisor, away, amax if split else None)
    ref = np.zeros((N, H))
    for n in range(N):
        for j in range(K):
            e = ids[n, j] - first
            if 0 <= e < E and h[n * K + j].any():
                ref[n] += float(weights[n, j]) * ((q2[e].astype(np.float64) @ hl[n * K + j]) * hs[n * K + j, 0] * s2[e])
    assert not y[-2:].any()
    np.testing.assert_allclose(y.astype(np.float64), ref, atol=tol * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize("held", ["float", "int8-panels"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float-inputs", "inputs-to-levels-and-back"])
def test_experts_in_two_calls_over_float_weights_give_the_one_call_result(kernels, quantized, held):
    """CpuExperts over weights in float panels, or int8 levels with a scale per output channel in
    int8 panels (a weight-only checkpoint's experts, or W8A8 ones without VNNI; their unpack gives
    the dequantized values): without quantizers, MoeExperts in one call; with them (int8 inputs per
    token), MoeUp and MoeDown with each row taken to its levels and back in between, which with the
    quantizers left out is MoeExperts' result to float32 accuracy, and with them is numpy's
    quantize-and-back arithmetic."""
    from msinfer.sharding.layers import PerTokenInt8
    from msinfer.worker.cpu import CpuExperts
    rng = np.random.default_rng(7)
    N, H, I, K, E = 19, 40, 32, 2, 6
    x = rng.standard_normal((N, H)).astype(np.float32)
    x[-2:] = 0
    ids, weights = _routed(N, K, E, rng)
    if held == "float":
        w13 = (rng.standard_normal((E, 2 * I, H)) * 0.2).astype(np.float32)
        w2 = (rng.standard_normal((E, H, I)) * 0.2).astype(np.float32)
        (p13, unpack13), (p2, unpack2) = kernels.pack_experts(w13, True), kernels.pack_experts(w2)
    else:
        q13, q2 = (rng.integers(-128, 128, shape).astype(np.int8) for shape in ((E, 2 * I, H), (E, H, I)))
        s13, s2 = (rng.uniform(1e-3, 3e-3, shape).astype(np.float32) for shape in ((E, 2 * I), (E, H)))
        w13, w2 = q13 * s13[..., None], q2 * s2[..., None]
        (p13, unpack13), (p2, unpack2) = kernels.pack_experts(q13, True, s13), kernels.pack_experts(q2, False, s2)
        assert p13.dtype == np.int8 and p13.shape == (E, 2 * I, H + 4)          # a quarter of float32's bytes
    np.testing.assert_array_equal(unpack13(p13), w13)
    np.testing.assert_array_equal(unpack2(p2), w2)
    args = (Tensor(x), Tensor(ids), Tensor(weights), Tensor(p13), Tensor(p2), Tensor(np.array([0, 1], np.int32)))
    one = kernels.moe_op()(*args).asnumpy()
    cell = CpuExperts()
    if quantized:
        cell.x_quant, cell.h_quant = PerTokenInt8(0, 127.5), PerTokenInt8(0, 127.5)
    two = cell(*args).asnumpy()

    def back(r):
        levels, s = _per_token(r[None], 127.5, False)
        return (levels * s)[0] if quantized else r
    ref = np.zeros((N, H))
    for n in range(N - 2):
        for j in range(K):
            e = ids[n, j]
            g = w13[e] @ back(x[n])
            ref[n] += weights[n, j] * (w2[e] @ back(_silu_times(g[:I], g[I:], np.float32)))
    np.testing.assert_allclose(two, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
    assert not two[-2:].any()
    if not quantized:
        np.testing.assert_allclose(two, one, atol=1e-6 * np.abs(one).max(), rtol=0)
    else:
        assert np.abs(two - one).max() > 1e-3 * np.abs(one).max()       # the quantizers did something


def test_embedding_and_row_lookups_give_zeros_outside_the_table(kernels):
    rng = np.random.default_rng(1)
    table = rng.standard_normal((70, 24)).astype(np.float32)       # panels of 32, 32 and 6 rows
    ids = np.array([0, 31, 32, 69, 70, -1, 5], np.int32)
    want = np.stack([table[i] if 0 <= i < 70 else np.zeros(24, np.float32) for i in ids])
    got = kernels.embed_op()(Tensor(kernels.pack(table)), Tensor(ids)).asnumpy()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(kernels.rows(Tensor(table), Tensor(ids)).asnumpy(), want)


def test_rotary_tables_in_one_kernel_are_the_rounded_cosine_and_sine_of_the_angles(kernels):
    """RopeTables (CausalLM.forward's MatMul, Cos and Sin): plain RoPE (one position component)
    and three components that each drive a third of the frequencies (Qwen2-VL's M-RoPE), with
    YaRN's attention factor or none. Each angle is the float32 sum of the products, and its
    cosine and sine the float64 ones rounded to float32, then times the factor; MindSpore's own
    operators give the same within one float32 step."""
    rng = np.random.default_rng(5)
    for P, N, factor in ((1, 16, 1.0), (1, 300, 1.0), (3, 37, 1.25)):
        positions = rng.integers(0, 40000, (N, P)).astype(np.float32)
        inv = (1.0 / 500000 ** (np.arange(32) / 32)).astype(np.float32)
        freq = np.zeros((P, 32), np.float32)
        for j in range(32):
            freq[j * P // 32, j] = inv[j]
        cos, sin = (t.asnumpy() for t in kernels.rope_cos_sin(Tensor(positions), Tensor(freq),
                                                              Tensor(np.array([factor], np.float32))))
        angles = (positions[:, :, None] * freq[None]).sum(1, dtype=np.float32)
        for got, f in ((cos, np.cos), (sin, np.sin)):
            assert got.dtype == np.float32 and got.shape == (N, 32)
            np.testing.assert_array_equal(got, f(angles.astype(np.float64)).astype(np.float32) * np.float32(factor))
        theirs = ops.matmul(Tensor(positions), Tensor(freq))
        for got, op in ((cos, ops.cos), (sin, ops.sin)):
            want = op(theirs).asnumpy() * np.float32(factor)
            np.testing.assert_allclose(got, want, rtol=0, atol=np.spacing(np.abs(want).max()))


def test_greedy_rows_pick_the_first_largest_real_column_as_the_stats_kernel_does(kernels):
    """GreedyRows (VocabSampler.greedy at tp 1): over rows of 5, 1023, 1025, 3000 and 49,152
    columns, of which the first `real` are the vocabulary's (the rest pad a shard: larger there
    changes nothing), each row's token is numpy's argmax over its real columns (the first of a
    tie, within a block of 1024 and across blocks), and the column SampleStats puts first, a NaN
    row included; a shard without real columns gives 0."""
    from msinfer.worker.cpu import SamplerKernels
    rng = np.random.default_rng(9)
    greedy, stats = SamplerKernels.greedy(), SamplerKernels.stats(1)
    for P, real in ((5, 5), (1023, 1000), (1025, 1025), (3000, 2999), (49152, 49152), (49152, 48000), (64, 0)):
        x = rng.standard_normal((7, P)).astype(np.float32)
        x[:, real:] = 50.0                                   # padding columns, never a token
        if real > 3:
            x[0, [1, real - 1]] = 9.0                        # a tie: the first wins
            x[1, [real // 2, real - 2]] = 9.0
            x[2, 0] = 9.0                                    # the first column
            x[3, real - 1] = 9.0                             # the last real column
            x[4, real // 3] = np.nan                         # a NaN is never the largest
        meta = Tensor(np.array([[real, 0]], np.int32))
        got = greedy(Tensor(x), meta).asnumpy()
        assert got.dtype == np.int32
        want = [int(np.nanargmax(r[:real])) if real else 0 for r in x]
        assert got.tolist() == want, (P, real)
        assert got.tolist() == stats(Tensor(x), meta).asnumpy()[:, 1].astype(np.int32).tolist(), (P, real)


def test_greedy_head_picks_what_greedy_rows_picks_from_the_float32_logits(kernels):
    """GreedyHead (a float32 job's greedy chains, CausalLM.pack_greedy_head): from the LM head in
    bfloat16 pairs checked against their error bound, each row's token is the one GreedyRows
    picks from Linear's float32 logits over the bfloat16 panels, and numpy's argmax where the
    largest logit stands clear: with an odd K, a last panel narrower than 32 columns and padding
    columns past the vocabulary; for rows whose largest columns are equal (the first wins), or
    differ in a weight's last bit (within the pairs' error: computed again), a zero row, a NaN
    row and a row past float32's range (the panels' whole product), and rows where more columns
    tie than it computes again; a call of a few rows (the panels' product). Where VDPBF16PS is off
    (a CPU without it) the same."""
    from msinfer.worker.cpu import SamplerKernels, set_bf16_dot
    rng = np.random.default_rng(3)
    head, greedy, linear = kernels.greedy_head_op(), SamplerKernels.greedy(), kernels.linear_op()
    dot = kernels.bf16_dot
    for K, N, real in ((67, 101, 97), (64, 300, 300)):
        w = _bfloat16_rounded(rng.standard_normal((N, K)) * 0.1)
        w[50 % N] = w[3]                                     # equal columns
        w[11] = w[10]
        w[11, 5] = np.nextafter(w[10, 5], np.float32(1), dtype=np.float32)
        w[11] = _bfloat16_rounded(w[11] + (w[11] - w[10]) * 300)   # one bfloat16 step apart in one weight
        if N == 300:
            w[40:300] = w[39]                                # 261 equal columns: more than it computes again
        panels, _ = kernels.pack_weight(w)
        assert panels.dtype == np.uint16
        pairs, norms = kernels.greedy_head_tables(panels)
        np.testing.assert_array_equal(pairs, kernels.pack_pairs(w)[0])
        exact = np.sqrt((w.astype(np.float64) ** 2).sum(1))
        assert (norms >= exact).all() and (np.nextafter(norms, np.float32(0)) < exact).all()
        x = rng.standard_normal((19, K)).astype(np.float32)
        x[0] = w[3] * 4                                      # columns 3 and 50 the largest, equal
        x[1] = w[10] * 4                                     # 10 and 11 nearly equal
        x[2] = 0                                             # padding
        x[3, 7] = np.nan
        x[4] *= np.float32(3e36)                             # logits past float32's range
        x[5] = w[39] * 4 if N == 300 else x[5]
        meta = Tensor(np.array([[real, 0]], np.int32))
        try:
            for way in ([True, False] if dot else [False]):
                set_bf16_dot(way)
                logits = linear(Tensor(x), Tensor(panels)).asnumpy()
                logits[:, real:] = 0.0
                want = greedy(Tensor(logits), meta).asnumpy()
                got = head(Tensor(x), Tensor(panels), Tensor(pairs), Tensor(norms), meta).asnumpy()
                assert got.dtype == np.int32
                assert got.tolist() == want.tolist(), (K, N, way)
                few = head(Tensor(x[:6]), Tensor(panels), Tensor(pairs), Tensor(norms), meta).asnumpy()
                assert few.tolist() == want[:6].tolist(), (K, N, way)     # (as few rows take the panels)
        finally:
            set_bf16_dot(dot)
        h = x.astype(np.float64) @ w.astype(np.float64).T
        top = np.sort(h[:, :real], 1)
        clear = np.isfinite(top).all(1) & (top[:, -1] - top[:, -2] > 1e-3 * np.abs(top[:, -1]))
        assert clear.sum() >= 10
        assert got[clear].tolist() == np.argmax(h[clear, :real], 1).tolist()
        assert got[0] == 3 and got[1] in (10, 11) and got[2] == 0
    w = np.zeros((40, 8), np.float32)
    w[5, 2] = np.float32(2.0 ** -130)                        # a bfloat16 denormal: no tables
    assert kernels.greedy_head_tables(kernels.pack_weight(w)[0]) is None


@pytest.fixture(scope="module")
def tiles(kernels):
    if not kernels.amx:
        pytest.skip("no AMX on this CPU (or the kernel refuses it): bfloat16 weights stay in float32 panels")
    return kernels


def _bfloat16(a: np.ndarray) -> np.ndarray:
    """a as float32 holding bfloat16 values (truncated), as a bfloat16 checkpoint loads."""
    return (a.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


@pytest.mark.parametrize("M,K,N", [(1, 64, 32), (19, 96, 64), (40, 32, 96), (64, 64, 32)])
def test_linear_over_bfloat16_tiles_is_as_accurate_as_float32(tiles, M, K, N):
    """A bfloat16 weight (its float32 values' low halves zero) in AMX tiles: x is split into three
    bfloat16 parts, so the result has float32 accuracy, not bfloat16's (x rounded to bfloat16 would
    be off by ~1e-3 of the largest output; two parts by ~1e-5)."""
    rng = np.random.default_rng(M + K + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = _bfloat16(rng.standard_normal((N, K)) * 0.1)
    packed, unpack = tiles.pack_weight(w)
    assert packed.dtype == np.int16 and packed.shape == w.shape
    np.testing.assert_array_equal(unpack(packed), w)
    y = tiles.linear_op()(Tensor(x), Tensor(packed)).asnumpy()
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, ref, atol=2e-6 * np.abs(ref).max(), rtol=0)


def test_bfloat16_tiles_skip_zero_rows_and_compute_the_gate_up_activation(tiles):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((37, 64)).astype(np.float32)
    zero = [3, 20, 35, 36]                      # among others, and trailing
    x[zero] = 0
    w = _bfloat16(rng.standard_normal((128, 64)) * 0.2)       # gate rows 0-63, up rows 64-127
    packed, unpack = tiles.pack_weight(w, glu=True)
    assert packed.dtype == np.int16
    np.testing.assert_array_equal(unpack(packed), w)
    y = tiles.glu_linear_op()(Tensor(x), Tensor(packed)).asnumpy()
    h = x.astype(np.float64) @ w.astype(np.float64).T
    ref = h[:, :64] / (1 + np.exp(-h[:, :64])) * h[:, 64:]
    np.testing.assert_allclose(y, ref, atol=2e-6 * np.abs(ref).max(), rtol=0)
    assert not y[zero].any()
    plain = tiles.linear_op()(Tensor(x), Tensor(tiles.pack_weight(w)[0])).asnumpy()
    np.testing.assert_allclose(plain, h, atol=2e-6 * np.abs(h).max(), rtol=0)
    assert not plain[zero].any()


def test_an_embedding_in_bfloat16_tiles_gives_its_float32_rows(tiles):
    rng = np.random.default_rng(2)
    table = _bfloat16(rng.standard_normal((64, 96)))
    ids = np.array([0, 15, 16, 63, 64, -1, 33], np.int32)
    want = np.stack([table[i] if 0 <= i < 64 else np.zeros(96, np.float32) for i in ids])
    got = tiles.embed_op()(Tensor(tiles.pack_weight(table)[0]), Tensor(ids)).asnumpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_only_bfloat16_weights_go_to_bfloat16_tiles_or_panels(kernels):
    """A bfloat16 weight goes to AMX tiles (int16) where the CPU has them and both dimensions are
    whole tiles, else to bfloat16 panels (uint16, half float32's bytes); a weight with any value
    that is not a bfloat16 (a float32 checkpoint, a merged adapter) stays in float32 panels.
    Each unpacks to the weight exactly."""
    rng = np.random.default_rng(4)
    exact = _bfloat16(rng.standard_normal((64, 64)))
    inexact = exact.copy()
    inexact[5, 7] = np.nextafter(inexact[5, 7], np.float32(9))
    odd = (_bfloat16(rng.standard_normal((48, 64))), _bfloat16(rng.standard_normal((64, 40))))
    for w, want in ((exact, np.int16 if kernels.amx else np.uint16), (inexact, np.float32),
                    *((w, np.uint16) for w in odd)):
        packed, unpack = kernels.pack_weight(w)
        assert packed.dtype == want
        np.testing.assert_array_equal(unpack(packed), w)


@pytest.mark.parametrize("M,K,N,glu", [(1, 40, 70, False), (17, 64, 96, False), (19, 40, 96, True)])
def test_bfloat16_panels_give_the_float32_panels_result_bit_for_bit(kernels, M, K, N, glu, monkeypatch):
    """Without AMX tiles, a bfloat16 weight in bfloat16 panels (widened in the registers) gives
    exactly what its float32 panels give, with a last narrower panel, padding rows and the gate/up
    activation; the embedding lookup over such a table gives its rows. MSINFER_BF16_PANELS=0
    (CpuOps.bf16_panels False) keeps float32 panels."""
    monkeypatch.setattr(kernels, "amx", False)
    rng = np.random.default_rng(M + K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[-1:] = 0 if M > 1 else x[-1:]
    w = _bfloat16(rng.standard_normal((N, K)) * 0.1)
    packed, _ = kernels.pack_weight(w, glu)
    monkeypatch.setattr(kernels, "bf16_panels", False)
    f32, _ = kernels.pack_weight(w, glu)
    assert packed.dtype == np.uint16 and packed.nbytes * 2 == f32.nbytes and f32.dtype == np.float32
    op = kernels.glu_linear_op() if glu else kernels.linear_op()
    y = op(Tensor(x), Tensor(packed)).asnumpy()
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, op(Tensor(x), Tensor(f32)).asnumpy())
    h = x.astype(np.float64) @ w.astype(np.float64).T
    ref = h[:, :N // 2] / (1 + np.exp(-h[:, :N // 2])) * h[:, N // 2:] if glu else h
    np.testing.assert_allclose(y, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
    if not glu:
        ids = np.array([0, N - 1, 33, N, -1], np.int32)
        want = np.stack([w[i] if 0 <= i < N else np.zeros(K, np.float32) for i in ids])
        np.testing.assert_array_equal(kernels.embed_op()(Tensor(packed), Tensor(ids)).asnumpy(), want)


def _bfloat16_rounded(a) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16, ties to even, in float64 arithmetic (not
    by bits, as msinfer.worker.cpu.bfloat16_rounded does): the value of 8 significant bits."""
    a = np.asarray(a, np.float64)
    m, e = np.frexp(a)                                   # a = m 2^e, 0.5 <= |m| < 1
    return (np.round(m * 256) / 256 * 2.0 ** e).astype(np.float32)     # np.round: ties to even


ROWS = (*range(1, 18), 27, 28, 29, 42, 64, 125, 126, 127, 128, 141, 252, 253, 300)


@pytest.mark.parametrize("way", ["float32 panels", "bfloat16 panels", "bfloat16 pairs"])
def test_linear_of_every_row_count_gives_x_w_transposed(kernels, way, monkeypatch):
    """Row counts from 1 to 300 (the micro-kernels' groups of up to 14 rows cut into equal sizes,
    one to three blocks of 126 rows shared between the threads), each with a K (odd or even) and
    an N (a last panel narrower than 32, or the gate/up activation) drawn at random, through each
    way a weight is held: the result is numpy's float64 one over the values the kernel holds
    (for pairs, x and w rounded to bfloat16; VDPBF16PS and FMAs alike where the CPU has both)."""
    from msinfer.worker.cpu import set_bf16_dot
    monkeypatch.setattr(kernels, "amx", False)
    rng = np.random.default_rng(["float32 panels", "bfloat16 panels", "bfloat16 pairs"].index(way))
    dot = kernels.bf16_dot
    try:
        for M in ROWS:
            K = int(rng.choice([24, 40, 63, 96]))
            glu = bool(rng.random() < 0.3)
            N = int(rng.choice([64, 96])) if glu else int(rng.choice([32, 45, 96, 130]))
            x = rng.standard_normal((M, K)).astype(np.float32)
            w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
            if way == "float32 panels":
                packed, xs, ws = (kernels.pack_glu(w) if glu else kernels.pack(w)), x, w
            elif way == "bfloat16 panels":
                ws = _bfloat16(w)
                packed, _ = kernels.pack_weight(ws, glu)
                xs = x
            else:
                packed, _ = kernels.pack_pairs(w, glu)
                xs, ws = _bfloat16_rounded(x), _bfloat16_rounded(w)
            h = xs.astype(np.float64) @ ws.astype(np.float64).T
            ref = h[:, :N // 2] / (1 + np.exp(-h[:, :N // 2])) * h[:, N // 2:] if glu else h
            op = kernels.glu_linear_op() if glu else kernels.linear_op()
            for bf16_dot in ([True, False] if way == "bfloat16 pairs" and dot else [dot]):
                set_bf16_dot(bf16_dot)
                y = op(Tensor(x), Tensor(packed)).asnumpy()
                np.testing.assert_allclose(y, ref, atol=1e-5 * np.abs(ref).max(), rtol=0,
                                           err_msg=f"{way}: M {M} K {K} N {N} glu {glu} VDPBF16PS {bf16_dot}")
    finally:
        set_bf16_dot(dot)


def _library():
    """The kernel library the ops run (ctypes), its StolenItems count typed."""
    import ctypes

    from msinfer.worker import cpu
    lib = ctypes.CDLL(cpu._LIBRARY)
    lib.StolenItems.restype = ctypes.c_int64
    return lib


@pytest.mark.parametrize("way", ["float32 panels", "bfloat16 pairs"])
def test_a_thread_that_ends_its_run_takes_the_others_last_panels_and_the_result_is_the_same(kernels, way,
                                                                                            monkeypatch):
    """A matmul of one block of rows (a decode step's) gives each thread one run of panels, and a
    thread that ends its run takes the others' last panels one at a time (worker/csrc/matmul.h
    panel_items). On three threads over this machine's cores, helpers start late and panels are
    taken (the library counts them): every call gives numpy's result, to the bit what the runs
    give when no panel is taken (MSINFER_STEAL=0), a last panel narrower than 32 columns included."""
    lib = _library()
    rng = np.random.default_rng(7)
    M, K, N = 16, 96, 32 * 21 + 13
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    if way == "float32 panels":
        packed, ref = kernels.pack(w), x.astype(np.float64) @ w.astype(np.float64).T
    else:
        packed, _ = kernels.pack_pairs(w, False)
        ref = _bfloat16_rounded(x).astype(np.float64) @ _bfloat16_rounded(w).astype(np.float64).T
    op = kernels.linear_op()
    try:
        monkeypatch.setenv("MSINFER_STEAL", "0")
        load_kernels(3)
        before = lib.StolenItems()
        whole_runs = op(Tensor(x), Tensor(packed)).asnumpy()
        for _ in range(20):
            np.testing.assert_array_equal(op(Tensor(x), Tensor(packed)).asnumpy(), whole_runs)
        assert lib.StolenItems() == before, "MSINFER_STEAL=0 and panels were taken"
        monkeypatch.delenv("MSINFER_STEAL")
        load_kernels(3)
        before, calls = lib.StolenItems(), 0
        while lib.StolenItems() == before and calls < 500:
            y = op(Tensor(x), Tensor(packed)).asnumpy()
            np.testing.assert_array_equal(y, whole_runs, err_msg=f"call {calls}")
            calls += 1
        assert lib.StolenItems() > before, f"no panel was taken in {calls} calls"
    finally:
        monkeypatch.delenv("MSINFER_STEAL", raising=False)
        load_kernels(2)
    np.testing.assert_allclose(whole_runs, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize("M,K,N,glu", [(1, 40, 70, False), (16, 63, 96, False), (33, 24, 45, False),
                                       (17, 57, 64, True), (3, 41, 70, False), (8, 41, 64, True)])
def test_bfloat16_pairs_round_x_and_sum_the_exact_products_in_float32(kernels, M, K, N, glu):
    """Linear and LinearGlu over bfloat16 pairs (`pack_pairs`, computing in bfloat16): x and w
    rounded to the nearest bfloat16 (ties to even), each product exact, the sums in float32: the
    float64 product of the rounded values within float32's rounding of the sums, with an odd K
    (the last pair's high half zero), a last panel narrower than 32 columns, padding rows and the
    gate/up activation; the table's rows looked up as an embedding (`embed_pairs_op`). Where the CPU has
    AVX512-BF16, VDPBF16PS and the FMA path (MSINFER_BF16_DOT=0, a CPU without it) give the
    very same bits."""
    from msinfer.worker.cpu import bfloat16_rounded, bfloat16_values, set_bf16_dot
    rng = np.random.default_rng(M + K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[-1:] = 0 if M > 1 else x[-1:]
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    xr, wr = _bfloat16_rounded(x), _bfloat16_rounded(w)
    np.testing.assert_array_equal(bfloat16_values(bfloat16_rounded(x)), xr)
    packed, unpack = kernels.pack_pairs(w, glu)
    assert packed.dtype == np.uint32 and packed.shape == (N, (K + 1) // 2)
    np.testing.assert_array_equal(unpack(packed), wr)
    op = kernels.glu_linear_op() if glu else kernels.linear_op()
    h = xr.astype(np.float64) @ wr.astype(np.float64).T
    ref = h[:, :N // 2] / (1 + np.exp(-h[:, :N // 2])) * h[:, N // 2:] if glu else h
    dot = kernels.bf16_dot
    try:
        results = {}
        for way in ([True, False] if dot else [False]):
            set_bf16_dot(way)
            results[way] = op(Tensor(x), Tensor(packed)).asnumpy()
    finally:
        set_bf16_dot(dot)
    y = results[False]
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
    if M > 1:
        assert not y[-1].any()
    if dot:
        np.testing.assert_array_equal(results[True], y)
    if not glu and K % 2 == 0:        # the same table as an embedding: its rows' bfloat16 values
        ids = np.array([0, N - 1, 33, N, -1], np.int32)
        want = np.stack([wr[i] if 0 <= i < N else np.zeros(K, np.float32) for i in ids])
        np.testing.assert_array_equal(kernels.embed_pairs_op()(Tensor(packed), Tensor(ids)).asnumpy(), want)


@pytest.mark.parametrize("H,inter,first,glu", [(40, 32, 0, True), (41, 23, 0, False), (40, 32, 3, True)],
                         ids=["fused-gate-up", "odd-sizes-unfused", "experts-3-to-6-held"])
def test_grouped_experts_over_bfloat16_pairs_compute_each_projection_as_the_linear_layers_do(kernels, H, inter,
                                                                                             first, glu):
    """MoeExperts over experts in bfloat16 pairs (`pack_experts(pairs=True)`, computing in
    bfloat16): each expert's rows go through gate|up and down as Linear (LinearGlu) over its pairs
    computes them (the test above holds those to float64), rows of silu(gate) * up rounded to
    bfloat16 again before down, each token's weighted sum in float32; held experts only, padding
    rows zero, odd H and I padded. Against the float64 result of the rounded values, within the
    flips of a rounding boundary between float32 and float64; both ways (VDPBF16PS, FMAs) the
    same bits."""
    from msinfer.worker.cpu import set_bf16_dot
    rng = np.random.default_rng(H + inter + first)
    N, K, E_all = 21, 3, 8
    E = E_all if first == 0 else 4
    x = rng.standard_normal((N, H)).astype(np.float32)
    x[-2:] = 0
    ids = np.stack([rng.choice(E_all, K, replace=False) for _ in range(N)]).astype(np.int32)
    weights = rng.random((N, K)).astype(np.float32)
    w13 = (rng.standard_normal((E, 2 * inter, H)) * 0.2).astype(np.float32)
    w2 = (rng.standard_normal((E, H, inter)) * 0.2).astype(np.float32)
    p13, unpack13 = kernels.pack_experts(w13, glu, pairs=True)
    p2, unpack2 = kernels.pack_experts(w2, pairs=True)
    assert p13.dtype == p2.dtype == np.uint32
    assert p13.shape == (E, 2 * inter, (H + 1) // 2) and p2.shape == (E, H, (inter + 1) // 2)
    np.testing.assert_array_equal(unpack13(p13), _bfloat16_rounded(w13))
    np.testing.assert_array_equal(unpack2(p2), _bfloat16_rounded(w2))
    args = (Tensor(x), Tensor(ids), Tensor(weights), Tensor(p13), Tensor(p2), Tensor(np.array([first, int(glu)], np.int32)))
    dot = kernels.bf16_dot
    try:
        results = {}
        for way in ([True, False] if dot else [False]):
            set_bf16_dot(way)
            results[way] = kernels.moe_op()(*args).asnumpy()
        # each (token, expert) pair through the linear layers' kernels over the same pairs
        up = kernels.glu_linear_op() if glu else kernels.linear_op()
        down = kernels.linear_op()
        composed = np.zeros((N, H), np.float32)
        for n, j in np.ndindex(N - 2, K):
            e = ids[n, j] - first
            if 0 <= e < E:
                h = up(Tensor(x[n:n + 1]), Tensor(p13[e])).asnumpy()
                h = h if glu else h[:, :inter] / (1 + np.exp(-h[:, :inter])) * h[:, inter:]
                composed[n] += weights[n, j] * down(Tensor(h.astype(np.float32)), Tensor(p2[e])).asnumpy()[0]
    finally:
        set_bf16_dot(dot)
    y = results[False]
    if dot:
        np.testing.assert_array_equal(results[True], y)
    assert not y[-2:].any()
    np.testing.assert_allclose(y, composed, atol=1e-5 * np.abs(composed).max(), rtol=0)
    ref = np.zeros((N, H))
    for n, j in np.ndindex(N, K):
        e = ids[n, j] - first
        if 0 <= e < E:
            g = _bfloat16_rounded(w13[e]).astype(np.float64) @ _bfloat16_rounded(x[n]).astype(np.float64)
            act = _bfloat16_rounded(g[:inter] / (1 + np.exp(-g[:inter])) * g[inter:]).astype(np.float64)
            ref[n] += float(weights[n, j]) * (_bfloat16_rounded(w2[e]).astype(np.float64) @ act)
    np.testing.assert_allclose(y, ref, atol=2e-3 * np.abs(ref).max(), rtol=0)
    unrounded = experts_reference(x, ids, weights, w13, w2, first)
    assert np.abs(y - ref).max() < np.abs(y - unrounded).max() / 4       # the rounding is the pairs'


def test_random_weights_fill_each_weight_as_the_kernels_hold_it():
    """`msinfer bench --skip-load` fills every weight with normal values of the scale asked, as the
    kernels hold it (worker.actor.random_values): bfloat16 pairs two values a word (an integer
    cast of the floats would be zeros, and the kernels skip zero rows), bfloat16 panels and tiles
    their bits, float32 the values."""
    import mindspore as ms
    from msinfer.worker.actor import random_values
    from msinfer.worker.cpu import bfloat16_values
    rng = np.random.default_rng(0)
    words = random_values((64, 100), ms.uint32, rng, 0.02)
    assert words.dtype == np.uint32 and words.shape == (64, 100)
    for bits, dtype in ((words.view(np.uint16), ms.uint32), (random_values((64, 200), ms.uint16, rng, 0.02), ms.uint16),
                        (random_values((64, 200), ms.int16, rng, 0.02).view(np.uint16), ms.int16)):
        values = bfloat16_values(bits)
        assert values.shape == (64, 200) and abs(values.std() - 0.02) < 0.002 and (values != 0).all(), dtype
    values = random_values((64, 200), ms.float32, rng, 0.02)
    assert values.dtype == np.float32 and abs(values.std() - 0.02) < 0.002


def test_bfloat16_pairs_round_ties_to_even(kernels):
    """x halfway between two bfloat16 values rounds to the one with an even last bit, as a card's
    float32 -> bfloat16 cast does (truncating would give 1 for both): 1 + 2^-8 -> 1, 1 + 3 2^-8
    -> 1 + 2^-6, and the same for their negatives; a denormal becomes zero, as VDPBF16PS reads
    one, on both paths."""
    from msinfer.worker.cpu import bfloat16_rounded, bfloat16_values, set_bf16_dot
    x = np.zeros((5, 2), np.float32)
    x[:, 0] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), -(1 + 3 * 2 ** -8), 3e-39]
    want = np.array([1, 1 + 2 ** -6, -1, -(1 + 2 ** -6), 0], np.float32)
    np.testing.assert_array_equal(bfloat16_values(bfloat16_rounded(x[:, 0])), want)
    w = np.zeros((32, 2), np.float32)
    w[0, 0] = 1
    dot = kernels.bf16_dot
    try:
        for way in {dot, False}:
            set_bf16_dot(way)
            y = kernels.linear_op()(Tensor(x), Tensor(kernels.pack_pairs(w)[0])).asnumpy()
            np.testing.assert_array_equal(y[:, 0], want)
    finally:
        set_bf16_dot(dot)


def test_peak_flops_counts_the_multiply_adds_of_its_loop_and_refuses_what_the_build_lacks(kernels):
    """scripts/roofline.py divides PeakFlops' count by its time: the count is 2 FLOPs a product,
    a float32 FMA's products the CPU's vector lanes (16 with AVX-512, 8 with AVX2: its loop is in
    the CPU's own registers) and 32 a VDPBF16PS, 12 of them an iteration, 8 items a thread (the
    fixture's 2); VDPBF16PS answers -1 where the library has none, and so does an unknown kind."""
    import ctypes
    from msinfer.worker import cpu
    fn = cpu.peak_flops()
    lib = ctypes.CDLL(cpu._LIBRARY)
    lanes = 16 if lib.Int4Ready() else 8                 # (int4 groups: the library was built with AVX-512)
    assert fn(0, 1000, 0.5) == 2 * lanes * 12 * 1000 * 8 * 2
    dot = lib.Bf16DotReady()
    assert fn(1, 1000, 0.5) == (2 * 32 * 12 * 1000 * 8 * 2 if dot else -1)
    assert fn(2, 1000, 0.5) == -1


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _rotated(qkv, qn, kn, qk_norm, eps, cos, sin, H, KV, D):
    """A step's q, k and v [N, heads, D] in float64, q and k normed (Qwen3's qk_norm) and rotated."""
    f, N = np.float64, len(qkv)
    q = qkv[:, : H * D].reshape(N, H, D).astype(f)
    k = qkv[:, H * D: (H + KV) * D].reshape(N, KV, D).astype(f)
    v = qkv[:, (H + KV) * D:].reshape(N, KV, D).astype(f)
    if qk_norm:
        q, k = _rms(q, qn.astype(f), eps), _rms(k, kn.astype(f), eps)
    c, s = cos.astype(f)[:, None], sin.astype(f)[:, None]
    return _rotate(q, c, s), _rotate(k, c, s), v


def _attended(q, K, V, tables, rows, lens, bs):
    """Each token's attention over its sequence's cached positions 0..lens-1 (K, V: the caches'
    rows [slots, KV, D], read through the block tables), zero for padding (lens 0)."""
    N, H, D = q.shape
    G = H // K.shape[1]
    want = np.zeros((N, H, D))
    for n in np.flatnonzero(lens > 0):
        ctx = tables[rows[n], np.arange(lens[n]) // bs] * bs + np.arange(lens[n]) % bs
        for h in range(H):
            score = K[ctx, h // G] @ q[n, h] / np.sqrt(D)
            p = np.exp(score - score.max())
            want[n, h] = p / p.sum() @ V[ctx, h // G]
    return want


@pytest.mark.parametrize("dtype,tol,cache", [(np.float32, 1e-5, None), (np.float16, 4e-3, None),
                                             (np.float32, 1e-5, "bfloat16")])
@pytest.mark.parametrize("H,KV,D,qk_norm", [(6, 2, 64, False), (8, 2, 24, True), (5, 1, 128, False)])
@pytest.mark.parametrize("bs", [4, 16])
def test_paged_attention_of_a_prefill_chunk_and_decode_tokens_equals_numpy(kernels, H, KV, D, qk_norm, dtype, tol,
                                                                           cache, bs):
    """One step as the runner packs it: a prompt's chunk of 21 tokens (positions 5-25, a 16-token
    tile and a 5-token one) after 5 cached positions, three decode tokens with 40, 1 and 70
    positions, and a padding token, then the 70-position token alone (a step of one sequence,
    whose blocks are split into parts for the threads and put together); caches paged in blocks
    of `bs` in shuffled order (a decode token reads a block's positions 8 at a time: blocks of 4
    give runs of 4, blocks of 16 runs of 8 and the tails of 40 and 70 positions, 2 blocks ahead
    past the last). The kernel norms (Qwen3) and rotates q and k, writes k and v into the
    caches, then attends. A bfloat16 cache (uint16 bits: a job computing in bfloat16) takes k
    and v rounded to the nearest bfloat16 and is read widened: the result is the float64 one over the values it holds, and
    the rows written are the float64 k and v rounded (all but a few on a rounding boundary,
    which float32's rotary may put on the other side: those within one bfloat16 step)."""
    from msinfer.worker.cpu import bfloat16_rounded, bfloat16_values
    rng = np.random.default_rng(H * D)
    eps, per_seq = 1e-6, -(-70 // bs)
    blocks = 4 * per_seq + 4
    tables = rng.permutation(blocks - 1).astype(np.int32)[:4 * per_seq].reshape(4, per_seq)   # the last: scratch
    kc = rng.standard_normal((blocks * bs * KV, D)).astype(dtype)
    vc = rng.standard_normal((blocks * bs * KV, D)).astype(dtype)
    if cache == "bfloat16":
        kc, vc = bfloat16_rounded(kc), bfloat16_rounded(vc)
    rows = np.array([0] * 21 + [1, 2, 3, 0], np.int32)
    pos = np.array(list(range(5, 26)) + [39, 0, 69, 0])
    lens = (pos + 1).astype(np.int32)
    lens[-1] = 0                                                    # padding
    slots = (tables[rows, pos // bs] * bs + pos % bs).astype(np.int32)
    slots[-1] = (blocks - 1) * bs
    N = len(rows)
    qkv = rng.standard_normal((N, (H + 2 * KV) * D)).astype(dtype)
    qn, kn = (1 + 0.1 * rng.standard_normal(D)).astype(dtype), (1 + 0.1 * rng.standard_normal(D)).astype(dtype)
    angle = pos[:, None] / 10000 ** (np.arange(D // 2) / (D // 2))
    cos, sin = np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)
    norm = np.array([eps, float(qk_norm)], np.float32)
    meta = np.array([bs, KV], np.int32)
    caches = Tensor(kc.copy()), Tensor(vc.copy())
    out = kernels.attention_op(H * D)(*(Tensor(a) for a in (qkv, qn, kn, norm, cos, sin)), *caches,
                                      *(Tensor(a) for a in (slots, tables, rows, lens, meta))).asnumpy()

    q, k, v = _rotated(qkv, qn, kn, qk_norm, eps, cos, sin, H, KV, D)
    if cache == "bfloat16":
        held = [t.asnumpy().reshape(-1, KV, D) for t in caches]
        others = np.ones(len(held[0]), bool)
        others[slots] = False
        for written, before, want_rows in zip(held, (kc, vc), (k, v)):
            assert written.dtype == np.uint16
            np.testing.assert_array_equal(written[others], before.reshape(-1, KV, D)[others])
            want_bits = bfloat16_rounded(want_rows.astype(np.float32))
            steps = np.abs(written[slots].astype(np.int32) - want_bits.astype(np.int32))
            assert steps.max() <= 1 and (steps == 0).mean() > 0.99, (steps.max(), (steps == 0).mean())
        K, V = (bfloat16_values(h).astype(np.float64) for h in held)
    else:
        K, V = kc.astype(np.float64).reshape(-1, KV, D), vc.astype(np.float64).reshape(-1, KV, D)
        K[slots], V[slots] = k, v
    want = _attended(q, K, V, tables, rows, lens, bs)
    np.testing.assert_allclose(out.reshape(N, H, D), want, atol=tol * np.abs(want).max(), rtol=0)
    one = N - 2            # the 70-position decode token alone (4 parts), over the cache the step above wrote
    alone = kernels.attention_op(H * D)(*(Tensor(a) for a in (qkv[one:one + 1], qn, kn, norm, cos[one:one + 1],
                                                              sin[one:one + 1])), *caches,
                                        *(Tensor(a) for a in (slots[one:one + 1], tables, rows[one:one + 1],
                                                              lens[one:one + 1], meta))).asnumpy()
    np.testing.assert_allclose(alone.reshape(H, D), want[one], atol=tol * np.abs(want).max(), rtol=0)
    chunk = slice(0, 21)   # the prompt's chunk alone: a step of prefill tiles and no single token
    tiles = kernels.attention_op(H * D)(*(Tensor(a) for a in (qkv[chunk], qn, kn, norm, cos[chunk], sin[chunk])),
                                        *caches, *(Tensor(a) for a in (slots[chunk], tables, rows[chunk], lens[chunk],
                                                                       meta))).asnumpy()
    np.testing.assert_allclose(tiles.reshape(-1, H, D), want[chunk], atol=tol * np.abs(want).max(), rtol=0)


# Steps as the runner may pack them (worker.runner.prepare): each sequence's tokens consecutive,
# a prefill chunk at consecutive positions after what its sequence has cached, a decode token
# alone, padding (lens 0) last. Each kind reaches its own way through PagedAttention::run.
STEPS = {
    "chunks alone": lambda rng: [("chunk", int(rng.integers(0, 20)), int(c))
                                 for c in rng.choice([4, 9, 16, 21, 36], 3)],
    "one long decode": lambda rng: [("decode", int(rng.integers(40, 90)))],
    "few decodes": lambda rng: [("decode", int(n)) for n in rng.integers(1, 90, 3)],
    "many decodes": lambda rng: [("decode", int(n)) for n in rng.integers(1, 90, 9)],
    "decodes and padding": lambda rng: [("decode", int(n)) for n in rng.integers(1, 90, 5)] + [("pad",)] * 2,
    # single tokens alone, some of one sequence (chunks of 2 and 3): each must see the ones before it
    "short chunks and decodes": lambda rng: [("chunk", int(rng.integers(0, 30)), 3), ("decode", int(rng.integers(1, 90))),
                                             ("chunk", int(rng.integers(0, 30)), 2)],
    "mixed": lambda rng: [("chunk", int(rng.integers(0, 30)), int(rng.integers(1, 40))), ("decode", 16),
                          ("decode", int(rng.integers(1, 90))), ("chunk", 0, 2), ("pad",), ("pad",)],
}


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("step", list(STEPS))
def test_paged_attention_of_steps_of_every_kind_equals_numpy(kernels, step, threads):
    """Ten random steps of each kind in each of four layouts: float32 in blocks of 16 (4 query
    heads a KV head, head size 64, qk norm), a bfloat16 cache in blocks of 4 (one KV head of 5
    query heads, head size 32), a head size of 24 (not a multiple of 16: position by position)
    and float16 in blocks of 8 (head size 128). The output equals numpy's attention over the
    caches the kernel wrote (the bfloat16 one as it holds them; the test above checks the
    rounding). A run of 4 to 16 tokens of a chunk is a tile, a shorter one single tokens; a
    step of fewer single tokens than twice the threads splits a long one into parts, and one of
    single tokens alone, as many or more, gives each thread a run of them (each asking for the
    next one's first blocks; a padding token's are none), each token written as its attention
    begins where no two are of one sequence; a thread that ends its run takes the others' last
    tokens (on three threads over this machine's cores, helpers start late: taken tokens are
    counted, and many decode tokens alone see some taken)."""
    lib = _library()
    lib.SetThreads(threads)
    try:
        taken = lib.StolenItems()
        _attention_steps(kernels, step)
        if threads == 3 and step == "many decodes":
            assert lib.StolenItems() > taken, "no token was taken from another thread's run"
    finally:
        lib.SetThreads(2)


def _attention_steps(kernels, step):
    from msinfer.worker.cpu import bfloat16_rounded, bfloat16_values
    rng = np.random.default_rng(sorted(STEPS).index(step))
    layouts = ((8, 2, 64, 16, None, True, np.float32, 1e-5), (5, 1, 32, 4, "bfloat16", False, np.float32, 1e-5),
               (6, 3, 24, 16, None, True, np.float32, 1e-5), (4, 2, 128, 8, None, False, np.float16, 4e-3))
    for H, KV, D, bs, cache, qk_norm, dtype, tol in layouts * 10:
        seqs = STEPS[step](rng)
        rows, pos, lens = [], [], []                    # a token's sequence, position, positions seen
        for i, seq in enumerate(seqs):
            if seq[0] == "decode":
                rows.append(i), pos.append(seq[1] - 1), lens.append(seq[1])
            elif seq[0] == "chunk":
                rows += [i] * seq[2]
                pos += range(seq[1], seq[1] + seq[2])
                lens += range(seq[1] + 1, seq[1] + seq[2] + 1)
            else:
                rows.append(0), pos.append(0), lens.append(0)
        rows, pos, lens = np.array(rows, np.int32), np.array(pos), np.array(lens, np.int32)
        per_seq = -(-int(pos.max() + 1) // bs)
        blocks = len(seqs) * per_seq + 1
        tables = rng.permutation(blocks - 1).astype(np.int32).reshape(len(seqs), per_seq)   # the last: scratch
        slots = np.where(lens > 0, tables[rows, pos // bs] * bs + pos % bs, (blocks - 1) * bs).astype(np.int32)
        N = len(rows)
        qkv = rng.standard_normal((N, (H + 2 * KV) * D)).astype(dtype)
        qn, kn = (1 + 0.1 * rng.standard_normal((2, D))).astype(dtype)
        angle = pos[:, None] / 10000 ** (np.arange(D // 2) / (D // 2))
        cos, sin = np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)
        kc, vc = rng.standard_normal((2, blocks * bs * KV, D)).astype(dtype)
        if cache == "bfloat16":
            kc, vc = bfloat16_rounded(kc), bfloat16_rounded(vc)
        caches = Tensor(kc), Tensor(vc)
        norm, meta = np.array([1e-6, float(qk_norm)], np.float32), np.array([bs, KV], np.int32)
        out = kernels.attention_op(H * D)(*(Tensor(a) for a in (qkv, qn, kn, norm, cos, sin)), *caches,
                                          *(Tensor(a) for a in (slots, tables, rows, lens, meta))).asnumpy()
        q, k, v = _rotated(qkv, qn, kn, qk_norm, 1e-6, cos, sin, H, KV, D)
        if cache == "bfloat16":
            K, V = (bfloat16_values(t.asnumpy()).astype(np.float64).reshape(-1, KV, D) for t in caches)
        else:
            K, V = kc.astype(np.float64).reshape(-1, KV, D), vc.astype(np.float64).reshape(-1, KV, D)
            K[slots[lens > 0]], V[slots[lens > 0]] = k[lens > 0], v[lens > 0]
        want = _attended(q, K, V, tables, rows, lens, bs)
        np.testing.assert_allclose(out.reshape(N, H, D), want, atol=tol * np.abs(want).max(), rtol=0,
                                   err_msg=f"{step}: {seqs}, H {H} KV {KV} D {D} blocks of {bs}, cache {cache}")


def _layer_step(rng, bs: int):
    """The decoder layer tests' step: a 6-token prompt chunk after 3 cached positions, two decode
    tokens and a padding row, in blocks of bs scattered over a cache of 13 (the last: scratch).
    Each token's sequence, position, positions seen, the block tables, each token's slot."""
    rows = np.array([0] * 6 + [1, 2, 0], np.int32)
    pos = np.array(list(range(3, 9)) + [10, 4, 0])
    lens = (pos + 1).astype(np.int32)
    lens[-1] = 0
    tables = rng.permutation(12).astype(np.int32)[:9].reshape(3, 3)
    slots = np.where(lens > 0, tables[rows, pos // bs] * bs + pos % bs, 12 * bs).astype(np.int32)
    return rows, pos, lens, tables, slots


@pytest.mark.parametrize("way", ["float32 panels", "bfloat16 pairs"])
@pytest.mark.parametrize("qk_norm,bias", [(False, False), (True, False), (False, True)],
                         ids=["llama", "qwen3-qk-norm", "qwen2-qkv-bias"])
def test_a_decoder_layer_in_one_call_gives_its_seven_kernels_results_bit_for_bit(kernels, way, qk_norm, bias):
    """DecoderLayer (a dense layer in one launch, LayerBase.fuse) on a step of a 6-token prompt
    chunk after 3 cached positions, two decode tokens and a padding row: its two outputs and the
    K/V rows it writes are those of AddRmsNorm, Linear (qkv) and the bias's Add (Qwen2),
    PagedAttention, Linear (o), AddRmsNorm, LinearGlu and Linear (down) called one by one, and of
    its two halves (DecoderAttention, DecoderMlp: tp > 1), to the bit, over float32 panels and
    bfloat16 pairs (x rounded in every matmul). Over float32 panels they equal the layer in
    float64 numpy; the padding row stays zero."""
    rng = np.random.default_rng(7 + qk_norm + 2 * bias)
    E, H, KV, D, I, bs, eps = 64, 4, 2, 16, 96, 4, 1e-6
    rows, pos, lens, tables, slots = _layer_step(rng, bs)
    N = len(rows)
    h = rng.standard_normal((N, E)).astype(np.float32)
    delta = rng.standard_normal((N, E)).astype(np.float32)
    h[-1] = delta[-1] = 0                                                        # padding
    f = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)     # noqa: E731
    w = {"qkv": f((H + 2 * KV) * D, E), "o": f(E, H * D), "gate_up": f(2 * I, E), "down": f(E, I)}
    norms = [(1 + f(E)).astype(np.float32) for _ in range(2)]
    qn, kn = 1 + f(D), 1 + f(D)
    angle = pos[:, None] / 10000 ** (np.arange(D // 2) / (D // 2))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    kc0, vc0 = f(13 * bs * KV, D), f(13 * bs * KV, D)
    if way == "bfloat16 pairs":
        held = {k: kernels.pack_pairs(v, k == "gate_up")[0] for k, v in w.items()}
    else:
        held = {k: kernels.pack_glu(v) if k == "gate_up" else kernels.pack(v) for k, v in w.items()}
    held = {k: Tensor(v) for k, v in held.items()}
    epsT = Tensor(np.array([eps], np.float32))
    attn_in = [Tensor(a) for a in (qn, kn, np.array([eps, float(qk_norm)], np.float32), cos, sin)]
    step_in = [Tensor(a) for a in (slots, tables, rows, lens, np.array([bs, KV], np.int32))]

    b = f((H + 2 * KV) * D) if bias else np.zeros((H + 2 * KV) * D, np.float32)
    fused_caches = Tensor(kc0.copy()), Tensor(vc0.copy())
    out_h, out_d = kernels.decoder_layer_op()(
        Tensor(h), Tensor(delta), Tensor(norms[0]), epsT, held["qkv"], *attn_in, *fused_caches, *step_in, held["o"],
        Tensor(norms[1]), epsT, held["gate_up"], held["down"], *((Tensor(b),) if bias else ()))
    out_h, out_d = out_h.asnumpy(), out_d.asnumpy()
    # its two halves (tp > 1: an all-reduce of o and of the MLP's output after each)
    first, then = kernels.decoder_layer_op(halves=True)
    half_caches = Tensor(kc0.copy()), Tensor(vc0.copy())
    h1, o = first(Tensor(h), Tensor(delta), Tensor(norms[0]), epsT, held["qkv"], *attn_in, *half_caches, *step_in,
                  held["o"], *((Tensor(b),) if bias else ()))
    h2, d2 = then(h1, o, Tensor(norms[1]), epsT, held["gate_up"], held["down"])
    np.testing.assert_array_equal(h2.asnumpy(), out_h)
    np.testing.assert_array_equal(d2.asnumpy(), out_d)
    for half, fused in zip(half_caches, fused_caches):
        np.testing.assert_array_equal(half.asnumpy(), fused.asnumpy())

    norm = kernels.add_rms_norm_op(eps)
    caches = Tensor(kc0.copy()), Tensor(vc0.copy())
    s, x = norm(Tensor(h), Tensor(delta), Tensor(norms[0]))
    qkv = kernels.linear_op()(x, held["qkv"])
    if bias:                                      # as LinearBase adds it
        qkv = qkv + ops.broadcast_to(Tensor(b), qkv.shape)
    a = kernels.attention_op(H * D)(qkv, *attn_in, *caches, *step_in)
    s, x = norm(s, kernels.linear_op()(a, held["o"]), Tensor(norms[1]))
    d = kernels.linear_op()(kernels.glu_linear_op()(x, held["gate_up"]), held["down"])
    np.testing.assert_array_equal(out_h, s.asnumpy())
    np.testing.assert_array_equal(out_d, d.asnumpy())
    for fused, alone in zip(fused_caches, caches):
        np.testing.assert_array_equal(fused.asnumpy(), alone.asnumpy())
    assert not out_h[-1].any() and not out_d[-1].any()   # (a bias's qkv row attends to nothing)
    if way == "bfloat16 pairs":              # x rounded to bfloat16 in each matmul: the seven kernels' only
        return

    f64 = np.float64
    s1 = h.astype(f64) + delta
    x1 = _rms(s1, norms[0], eps)
    q, k, v = _rotated(x1 @ w["qkv"].T + b, qn, kn, qk_norm, eps, cos, sin, H, KV, D)
    K, V = kc0.astype(f64).reshape(-1, KV, D), vc0.astype(f64).reshape(-1, KV, D)
    K[slots[:-1]], V[slots[:-1]] = k[:-1], v[:-1]
    att = _attended(q, K, V, tables, rows, lens, bs).reshape(N, H * D)
    s2 = s1 + att @ w["o"].T
    g = _rms(s2, norms[1], eps) @ w["gate_up"].T
    want_d = (g[:, :I] / (1 + np.exp(-g[:, :I])) * g[:, I:]) @ w["down"].T
    np.testing.assert_allclose(out_h, s2, atol=1e-5 * np.abs(s2).max(), rtol=0)
    np.testing.assert_allclose(out_d, want_d, atol=1e-5 * np.abs(want_d).max(), rtol=0)


def _shared_step(rng, bs: int):
    """A step DecoderStack splits between 2 threads (each runs every layer for its share): 17
    decode tokens, a 6-token prompt chunk after 3 cached positions across the middle (the split
    moves to its end), 16 decode tokens and a padding row; blocks of bs scattered over a cache of
    106 (the last: scratch). As _layer_step returns them."""
    rows = np.array(list(range(17)) + [17] * 6 + list(range(18, 34)) + [0], np.int32)
    pos = np.concatenate([rng.integers(0, 12, 17), np.arange(3, 9), rng.integers(0, 12, 16), [0]])
    lens = (pos + 1).astype(np.int32)
    lens[-1] = 0
    tables = rng.permutation(105).astype(np.int32)[:102].reshape(34, 3)
    slots = np.where(lens > 0, tables[rows, pos // bs] * bs + pos % bs, 105 * bs).astype(np.int32)
    return rows, pos, lens, tables, slots


@pytest.mark.parametrize("stacked", [False, True], ids=["caches-apart", "caches-stacked"])
@pytest.mark.parametrize("qk_norm,bias", [(False, False), (True, True)], ids=["llama", "qk-norm-and-bias"])
@pytest.mark.parametrize("step", ["mixed", "shared"])
def test_the_layers_in_one_call_give_their_calls_results_bit_for_bit(kernels, qk_norm, bias, stacked, step):
    """DecoderStack (every layer of a model in one launch, CausalLM.fuse) over three layers of
    their own weights and caches: its two outputs and every layer's K/V cache are those of the
    three DecoderLayer calls one after another, to the bit, with the inputs every layer has alike
    (eps, metadata; the qk norms without qk_norm) passed once, and the caches each layer's own or
    all in one [layers, ...] input each. On the step of the layer test above, and on one of 39
    tokens that the stack splits between the two threads, each running every layer for its
    sequences alone (the other DecoderLayer calls share each kernel). Metadata that names an
    input outside the call's shared ones, or slices one that is not [layers, ...], is refused."""
    rng = np.random.default_rng(11 + qk_norm)
    E, H, KV, D, I, bs, eps, L = 64, 4, 2, 16, 96, 4, 1e-6, 3
    rows, pos, lens, tables, slots = (_layer_step if step == "mixed" else _shared_step)(rng, bs)
    N, blocks = len(rows), 13 if step == "mixed" else 106
    f = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)     # noqa: E731
    h, delta = f(N, E) * 5, f(N, E) * 5
    h[-1] = delta[-1] = 0                                                        # padding
    angle = pos[:, None] / 10000 ** (np.arange(D // 2) / (D // 2))
    shared = [Tensor(a) for a in (np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32),
                                  slots, tables, rows, lens)]
    eps_t, meta = Tensor(np.array([eps], np.float32)), Tensor(np.array([bs, KV], np.int32))
    norm_meta, ones = Tensor(np.array([eps, float(qk_norm)], np.float32)), Tensor(np.ones(D, np.float32))
    layers, caches = [], []
    for _ in range(L):      # each layer's DecoderLayer inputs past the shared ones, in DecoderStack's order
        qn, kn = (Tensor(1 + f(D)), Tensor(1 + f(D))) if qk_norm else (ones, ones)
        caches.append((f(blocks * bs * KV, D), f(blocks * bs * KV, D)))
        layers.append([Tensor(1 + f(E)), eps_t, Tensor(kernels.pack(f((H + 2 * KV) * D, E))), qn, kn, norm_meta,
                       None, None, meta, Tensor(kernels.pack(f(E, H * D))), Tensor(1 + f(E)), eps_t,
                       Tensor(kernels.pack_glu(f(2 * I, E))), Tensor(kernels.pack(f(E, I)))]
                      + ([Tensor(f((H + 2 * KV) * D))] if bias else []))

    # one DecoderLayer call after another
    layer_caches = [(Tensor(k.copy()), Tensor(v.copy())) for k, v in caches]
    x, d = Tensor(h), Tensor(delta)
    for own, (kc, vc) in zip(layers, layer_caches):
        x, d = kernels.decoder_layer_op()(x, d, *own[:5], own[5], *shared[:2], kc, vc, *shared[2:], *own[8:14],
                                          *own[14:])
    # DecoderStack: an input is shared where every layer has the same one (the qk norms: `ones`)
    stack_caches = [(Tensor(k.copy()), Tensor(v.copy())) for k, v in caches]
    for own, (kc, vc) in zip(layers, stack_caches):
        own[6], own[7] = kc, vc
    columns = list(zip(*layers))
    alike = [all(v is c[0] for v in c) for c in columns]
    assert sum(alike) == (4 if qk_norm else 6)
    # the caches (inputs 6, 7) in one [L, ...] input each, shared and sliced
    whole = [Tensor(np.stack([c[kind] for c in caches])) for kind in (0, 1)] if stacked else []
    common, where, sliced, n_own = [], [], [], 0
    for j, (c, a) in enumerate(zip(columns, alike)):
        if stacked and j in (6, 7):
            where.append(-1 - (9 + len(common)))
            common.append(whole[j - 6])
            alike[j] = True
        elif a:
            where.append(-1 - (9 + len(common)))
            common.append(c[0])
        else:
            where.append(n_own)
            n_own += 1
        sliced.append(int(stacked and j in (6, 7)))
    stack_meta = Tensor(np.array([L, n_own, *where, *sliced], np.int32))
    own_inputs = [v for layer in layers for v, a in zip(layer, alike) if not a]
    shared_before = kernels.stack_shares()
    sx, sd = (t.asnumpy() for t in kernels.decoder_stack_op()(Tensor(h), Tensor(delta), *shared, stack_meta,
                                                               *common, *own_inputs))
    assert kernels.stack_shares() - shared_before == (step == "shared")      # (once it ran: asnumpy)
    np.testing.assert_array_equal(sx, x.asnumpy())
    np.testing.assert_array_equal(sd, d.asnumpy())
    for layer, ((a, b), (c, e)) in enumerate(zip(stack_caches, layer_caches)):
        if stacked:
            a, b = whole[0][layer], whole[1][layer]
        np.testing.assert_array_equal(a.asnumpy(), c.asnumpy())
        np.testing.assert_array_equal(b.asnumpy(), e.asnumpy())
    assert not np.array_equal(x.asnumpy(), h)            # (the layers did change the stream)
    # a shared input's index past the shared ones (into the layers' own inputs), a slice of an
    # input that is not [layers, ...] (eps)
    past = [w if w >= 0 else -1 - (len(common) + 9) for w in where]
    eps_sliced = [1 if w == where[1] else f for w, f in zip(where, sliced)]
    for meta in ([L, n_own, *past, *sliced], [L, n_own, *where, *eps_sliced]):
        with pytest.raises(RuntimeError):
            kernels.decoder_stack_op()(Tensor(h), Tensor(delta), *shared, Tensor(np.array(meta, np.int32)), *common,
                                       *own_inputs)[0].asnumpy()


def test_the_kernels_built_for_a_cpu_without_avx512_give_numpy_s_results_too():
    """This file's tests again in a process whose library is built for Haswell
    (MSINFER_KERNEL_ARCH=haswell: AVX2 and FMA, no AVX-512): the kernels a CPU without AVX-512
    gets (3-row micro-kernels of 8 lanes, bfloat16 pairs by FMAs, no VNNI, int4 or AMX), run on
    this one against the same numpy references. On a CPU without AVX-512 the suite's own build
    is that one."""
    import os
    import re
    import subprocess
    import sys
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    if "avx512f" not in flags:
        pytest.skip("no AVX-512 on this CPU: the suite's own library is the AVX2 one")
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", __file__,
                        "-k", "not without_avx512"], env={**os.environ, "MSINFER_KERNEL_ARCH": "haswell"},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert int(re.search(r"(\d+) passed", p.stdout)[1]) >= 60, p.stdout[-1000:]
    skipped = re.findall(r"SKIPPED \[\d+\] .*?: (.*)", p.stdout)
    assert all("AVX-512" in why or "AVX512" in why or "AMX" in why for why in skipped), skipped


def test_a_kernel_arch_that_is_no_cpu_name_is_refused_by_name(monkeypatch):
    from msinfer.worker import build
    monkeypatch.setenv("MSINFER_KERNEL_ARCH", "native -fplugin=x.so")
    with pytest.raises(RuntimeError, match=r"MSINFER_KERNEL_ARCH='native -fplugin=x.so' is not a CPU name"):
        build.cxxflags()
    monkeypatch.setenv("MSINFER_KERNEL_ARCH", "haswell")
    assert build.cxxflags()[:2] == ("-O3", "-march=haswell")
