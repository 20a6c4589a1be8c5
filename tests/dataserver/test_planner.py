from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataserver import Generation, Planner
from dataserver._permutation import FeistelPermutation


@given(n=st.integers(1, 5000), key=st.integers(0, 2**64 - 1))
@settings(max_examples=200, deadline=None)
def test_permutation_is_a_bijection(n: int, key: int) -> None:
    out = FeistelPermutation(n, key)(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))


def test_billion_sample_dataset_plans_without_a_permutation() -> None:
    planner = Planner(10**9, seed=7, generations=[Generation(0, dp=8, batch_per_rank=512)])
    late = planner.plan(dp_rank=5, step=3_000_000)  # epoch 12: 12 permutations never built
    assert late.epoch == 12
    assert late.indices.min() >= 0 and late.indices.max() < 10**9
    assert len(set(late.indices.tolist())) == 512


def test_each_epoch_is_a_fresh_shuffle_and_deterministic() -> None:
    a = Planner(1000, seed=1, generations=[Generation(0, 2, 50)])
    b = Planner(1000, seed=1, generations=[Generation(0, 2, 50)])
    e0 = np.concatenate([a.plan(r, s).indices for s in range(10) for r in range(2)])
    e1 = np.concatenate([a.plan(r, s).indices for s in range(10, 20) for r in range(2)])
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(1000))
    assert not np.array_equal(e0, e1)
    assert np.array_equal(a.plan(1, 13).indices, b.plan(1, 13).indices)
    other_seed = Planner(1000, seed=2, generations=[Generation(0, 2, 50)])
    assert not np.array_equal(other_seed.plan(0, 0).indices, a.plan(0, 0).indices)


_changes = st.lists(st.tuples(st.integers(1, 9), st.integers(1, 6), st.integers(1, 9)), min_size=0, max_size=6)


@given(
    n=st.integers(1, 400),
    seed=st.integers(0, 2**32),
    first=st.tuples(st.integers(1, 6), st.integers(1, 9)),
    changes=_changes,
    epochs=st.integers(1, 3),
)
@settings(max_examples=300, deadline=None)
def test_every_sample_lands_in_exactly_one_step_across_dp_changes(
    n: int, seed: int, first: tuple[int, int], changes: list[tuple[int, int, int]], epochs: int
) -> None:
    gens = [Generation(0, *first)]
    for gap, dp, b in changes:
        gens.append(Generation(gens[-1].start_step + gap, dp, b))
    planner = Planner(n, seed, gens)
    seen: dict[int, Counter[int]] = {}
    step = 0
    while True:
        gen, _ = planner.generation_at(step)
        for rank in range(gen.dp):
            p = planner.plan(rank, step)
            assert len(p.indices) == gen.batch_per_rank
            for e, i in zip(p.epochs.tolist(), p.indices.tolist()):
                seen.setdefault(e, Counter())[i] += 1
        step += 1
        if min(seen) == 0 and max(seen) >= epochs and step > gens[-1].start_step:
            break
    for e in range(epochs):  # every epoch before the last one reached is complete
        assert seen[e] == Counter(range(n)), f"epoch {e} not served exactly once"
    assert all(c == 1 for counter in seen.values() for c in counter.values())


def test_a_new_generation_never_changes_earlier_steps() -> None:
    planner = Planner(997, seed=3, generations=[Generation(0, 4, 8)])
    before = [planner.plan(r, s).indices for s in range(12) for r in range(4)]
    planner.add_generation(Generation(12, 3, 8))
    after = [planner.plan(r, s).indices for s in range(12) for r in range(4)]
    assert all(np.array_equal(x, y) for x, y in zip(before, after))
    with pytest.raises(ValueError, match="dp_rank 3 out of range for dp=3"):
        planner.plan(3, 12)
    with pytest.raises(ValueError, match="must start after step 12"):
        planner.add_generation(Generation(5, 2, 8))
