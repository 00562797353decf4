"""The CPU kernels' matmul, embedding and row lookups against numpy, on the shapes the model tests
do not reach: a last panel narrower than 32 columns (a tensor-parallel shard of an odd size),
zero rows (padding) and out-of-range indices."""

from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor

from worker.ops import CpuOps, load_kernels


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


def test_zero_rows_give_zero_logits_and_the_others_are_unchanged(kernels):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    x[[1, 4, 5]] = 0
    w = rng.standard_normal((50, 32)).astype(np.float32)
    y = kernels.linear_op()(Tensor(x), Tensor(kernels.pack(w))).asnumpy()
    np.testing.assert_allclose(y, x @ w.T, atol=1e-4)
    assert not y[[1, 4, 5]].any()


def test_embedding_and_row_lookups_give_zeros_outside_the_table(kernels):
    rng = np.random.default_rng(1)
    table = rng.standard_normal((70, 24)).astype(np.float32)       # panels of 32, 32 and 6 rows
    ids = np.array([0, 31, 32, 69, 70, -1, 5], np.int32)
    want = np.stack([table[i] if 0 <= i < 70 else np.zeros(24, np.float32) for i in ids])
    got = kernels.embed_op()(Tensor(kernels.pack(table)), Tensor(ids)).asnumpy()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(kernels.rows(Tensor(table), Tensor(ids)).asnumpy(), want)
