"""The diagnostic random reward (trainer.reward.random_p): a seeded Bernoulli draw, independent of the
answer, the scheme's values and overlong shaping, and the config key's error."""

from __future__ import annotations

import math

import pytest

from bandpo.errors import ConfigError
from bandpo.reward.scheme import RewardScheme, check_random_p, random_positive, random_rewards


def test_the_draw_is_a_function_of_seed_step_round_and_row():
    a = random_positive(200, 0.5, seed=3, step=7, round_=1)
    assert a == random_positive(200, 0.5, seed=3, step=7, round_=1)  # a resumed run draws the same
    # row i's draw does not depend on how many rows follow it
    assert random_positive(50, 0.5, seed=3, step=7, round_=1) == a[:50]
    for other in (
        dict(seed=4, step=7, round_=1),
        dict(seed=3, step=8, round_=1),
        dict(seed=3, step=7, round_=0),
    ):
        assert random_positive(200, 0.5, **other) != a  # equal by chance with probability 2^-200
    assert random_positive(10, 0.5, seed=-1, step=0) == random_positive(10, 0.5, seed=(1 << 64) - 1, step=0)


def test_the_mean_is_p_within_five_sigma():
    # n = 20000 draws of Bernoulli(0.3): the mean's sd is sqrt(p (1 - p) / n) = sqrt(0.21 / 20000) = 0.00324,
    # so 5 sd = 0.0162 (a false failure once in ~1.7 million seeds)
    n, p = 20000, 0.3
    bound = 5 * math.sqrt(p * (1 - p) / n)
    for seed in range(3):
        hits = random_positive(n, p, seed=seed, step=1)
        assert abs(sum(hits) / n - p) < bound


def test_rewards_take_the_scheme_s_values_and_overlong_shaping():
    plain = RewardScheme(correct=1.0, incorrect=0.0)
    hits = random_positive(100, 0.4, seed=0, step=2)
    assert random_rewards(100, 0.4, 0, 2, plain) == [1.0 if h else 0.0 for h in hits]
    # cap 10, buffer 4: a length-8 response is 2 tokens into the buffer, -1.0 * 2 / 4 = -0.5
    shaped = RewardScheme(correct=1.0, incorrect=-1.0, overlong_buffer=4, max_response_len=10)
    rewards = random_rewards(100, 0.4, 0, 2, shaped, [8] * 100)
    assert rewards == [0.5 if h else -1.5 for h in hits]
    with pytest.raises(ValueError, match="response_lengths"):
        random_rewards(100, 0.4, 0, 2, shaped)


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.2, True, "0.3"])
def test_p_outside_the_open_interval_is_refused(bad):
    with pytest.raises(ValueError, match="random_p must be null or a number strictly between 0 and 1"):
        check_random_p(bad)
    assert check_random_p(None) is None and check_random_p(0.25) == 0.25


def test_the_config_key_s_error_names_it():
    from bandpo.config import compose

    with pytest.raises(ConfigError, match=r"trainer\.reward\.random_p must be null or a number strictly"):
        compose(["trainer.reward.random_p=1.0"])
    assert compose(["trainer.reward.random_p=0.3"]).trainer.reward.random_p == 0.3
