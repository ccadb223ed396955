import random
from dataclasses import replace

import pytest

from neurontrain.data.buckets import StepCostModel, bucket_for, choose_buckets, padding_fraction, round_up


def cost(compile_seconds: float, batch_size: int = 8) -> StepCostModel:
    return StepCostModel(
        compile_seconds=compile_seconds,
        flops_per_second=1e10,
        step_overhead_seconds=0.01,
        flops_per_token=2e6,
        attention_flops_per_token_per_position=1e4,
        batch_size=batch_size,
    )


def lognormal_lengths(n: int = 2000, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [max(4, min(256, int(rng.lognormvariate(3.5, 0.6)))) for _ in range(n)]


def test_bucket_for_picks_smallest_that_fits():
    assert bucket_for(1, [32, 64]) == 32
    assert bucket_for(32, [32, 64]) == 32
    assert bucket_for(33, [32, 64]) == 64
    with pytest.raises(ValueError):
        bucket_for(65, [32, 64])


def test_round_up():
    assert [round_up(n, 8) for n in (1, 8, 9, 16)] == [8, 8, 16, 16]


def test_padding_fraction():
    assert padding_fraction([32, 32], [32]) == 0.0
    assert padding_fraction([16, 16], [32]) == pytest.approx(0.5)


def test_short_runs_get_fewer_buckets_than_long_runs():
    lengths = lognormal_lengths()
    short = choose_buckets(
        lengths, planned_batches=40, graphs_per_bucket=1, cost=cost(5.0), max_buckets=8, multiple=8, max_length=256
    )
    long = choose_buckets(
        lengths, planned_batches=20000, graphs_per_bucket=1, cost=cost(5.0), max_buckets=8, multiple=8, max_length=256
    )
    assert len(short.buckets) < len(long.buckets)
    assert short.buckets[-1] >= max(lengths) and long.buckets[-1] >= max(lengths)
    assert long.padding_fraction < short.padding_fraction


def test_free_compiles_use_every_allowed_bucket_and_expensive_compiles_use_one():
    lengths = lognormal_lengths()
    free = choose_buckets(
        lengths, planned_batches=1000, graphs_per_bucket=2, cost=cost(0.0), max_buckets=5, multiple=8, max_length=256
    )
    costly = choose_buckets(
        lengths, planned_batches=1000, graphs_per_bucket=2, cost=cost(1e6), max_buckets=5, multiple=8, max_length=256
    )
    assert len(free.buckets) == 5
    assert costly.buckets == [round_up(max(lengths), 8)]


def test_choice_is_optimal_against_brute_force():
    import itertools

    lengths = lognormal_lengths(300, seed=3)
    c = cost(2.0)
    best = choose_buckets(
        lengths, planned_batches=500, graphs_per_bucket=1, cost=c, max_buckets=3, multiple=32, max_length=256
    )
    top = round_up(max(lengths), 32)
    candidates = sorted({round_up(n, 32) for n in lengths})

    def total(buckets):
        n = len(lengths)
        return len(buckets) * 2.0 + sum(500 / n * c.step_seconds(bucket_for(x, buckets)) for x in lengths)

    brute = min(
        total(list(combo) + [top])
        for k in range(0, 3)
        for combo in itertools.combinations([x for x in candidates if x < top], k)
    )
    assert total(best.buckets) == pytest.approx(brute, rel=1e-9)
    assert best.estimated_seconds == pytest.approx(brute, rel=1e-9)


def test_empty_lengths_rejected():
    with pytest.raises(ValueError):
        choose_buckets(
            [], planned_batches=1, graphs_per_bucket=1, cost=cost(1), max_buckets=2, multiple=8, max_length=64
        )


def test_below_saturation_shorter_buckets_save_nothing():
    # 90 % of samples are <= 16 tokens; at 8 x 16 = 128 tokens a step this device is far from saturated
    lengths = [16] * 900 + [64] * 100
    kwargs = dict(planned_batches=2000, graphs_per_bucket=1, max_buckets=4, multiple=8, max_length=64)
    assert choose_buckets(lengths, cost=cost(60.0), **kwargs).buckets == [16, 64]
    saturating = replace(cost(60.0), saturation_tokens=8 * 64)
    assert choose_buckets(lengths, cost=saturating, **kwargs).buckets == [64]
    assert saturating.step_seconds(16) == pytest.approx(0.01 + 512 * (2e6 + 1e4 * 16) / 1e10)
    assert saturating.step_seconds(128) == cost(60.0).step_seconds(128)
