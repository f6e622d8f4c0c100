"""``row_max``, the samplers' argmax: the same values and first-occurrence indices as numpy's argmax in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from corerun.sampler.argmax import ROW_MAX_CHUNK, row_max

C = ROW_MAX_CHUNK
VOCABS = [49152, 50257, 3 * C + 1, 2 * C, 2 * C - 1, 1000]  # whole chunks, a tail, one over, two, fewer than two


def _reference(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    a = x.double().numpy()
    idx = np.argmax(a, axis=-1)  # numpy: the first occurrence; a NaN is the largest (its first one)
    return a[np.arange(a.shape[0]), idx], idx


def _check(x: torch.Tensor) -> None:
    got = row_max(x)
    values, indices = got.values, got.indices  # (named: the race reads .indices)
    want_values, want_idx = _reference(x)
    assert indices.dtype == torch.int64 and values.dtype == x.dtype
    np.testing.assert_array_equal(indices.numpy(), want_idx)
    np.testing.assert_array_equal(values.double().numpy(), want_values)  # NaN equals NaN here


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [37, 1])  # one row: torch's max(dim), one operator inside a decode step
def test_random_logits(vocab: int, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    _check((torch.randn(rows, vocab, generator=gen) * 4).to(dtype))


@pytest.mark.parametrize("vocab", VOCABS)
def test_ties_take_the_first_occurrence_across_chunks_and_the_overlapping_tail(vocab: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 3, (64, vocab), generator=gen).float()  # values -3..2: many ties of the maximum
    x[0] = 0.0
    x[0, [vocab - 1, vocab - 2]] = 7.0  # only in the tail (and the overlapping last chunk)
    if vocab > C:
        x[1] = 0.0
        x[1, [vocab - C, vocab - 1]] = 7.0  # inside the overlap: the earlier chunk must win
        x[2] = -1.0
        x[2, [C - 1, C, vocab - 1]] = 9.0  # at a chunk boundary
    _check(x)


def test_non_finite_rows_match_torch_and_numpy() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 50257, generator=gen)
    x[0, [4000, 30000]] = float("nan")  # NaN is the largest: its first index
    x[1] = float("-inf")  # all -inf: index 0, value -inf
    x[2, 45000] = float("inf")
    x[3, 50256] = float("nan")  # a NaN in the tail only
    x[4, :] = float("-inf")
    x[4, 50200] = 1.0
    _check(x)
    values, indices = row_max(x)
    t_values, t_indices = x.max(dim=-1)
    assert torch.equal(indices, t_indices)
    assert torch.equal(values.isnan(), t_values.isnan())


def test_a_strided_view_is_read_as_it_is() -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(16, 2 * 49152, generator=gen)
    _check(base[:, ::2])  # stride 2 along the vocabulary
    _check(base[:, 1000 : 1000 + 49152])  # rows of a wider buffer


def test_the_race_over_a_wide_vocabulary_draws_the_only_possible_token() -> None:
    from corerun.sampler.common import exponential_race

    hot = [0, 4999, 1023, 1024, 2500]  # the first, the last (in the overlapping tail), either side of a chunk edge
    probs = torch.zeros(len(hot), 5000)
    probs[torch.arange(len(hot)), torch.tensor(hot)] = 1.0
    tokens = exponential_race(probs, [], torch.Generator().manual_seed(0))
    assert tokens.tolist() == hot
