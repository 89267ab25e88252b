"""The two pure policies as tables (SPEC §2 save triggers and "Retention")."""

from __future__ import annotations

import math

import pytest

from checkpointd import ConfigError
from checkpointd.policy import RetentionPolicy, SaveSchedule

STEPS_1_TO_6 = [1, 2, 3, 4, 5, 6]
LOSS = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.3, 5: 0.7, 6: 0.8}


def _metrics(values, key="loss"):
    return {s: {key: v} for s, v in values.items()}


@pytest.mark.parametrize(
    "policy, committed, metrics, expected",
    [
        (dict(keep_last=3), STEPS_1_TO_6, None, {4, 5, 6}),
        (dict(keep_last=1), STEPS_1_TO_6, None, {6}),
        (dict(keep_last=10), STEPS_1_TO_6, None, set(STEPS_1_TO_6)),
        (dict(keep_last=None), STEPS_1_TO_6, None, set(STEPS_1_TO_6)),
        (dict(keep_last=2), [6, 1, 4, 4, 2], None, {4, 6}),  # order and duplicates don't matter
        (dict(keep_last=2), [], None, set()),
        (dict(keep_last=1, keep_every_n_steps=2), STEPS_1_TO_6, None, {2, 4, 6}),
        (dict(keep_last=1, keep_every_n_steps=4), [1, 2, 3, 5], None, {5}),
        (dict(keep_last=2, keep_every_n_steps=3), list(range(1, 11)), None, {3, 6, 9, 10}),
        (dict(keep_last=1, keep_best=1, best_metric="loss"), STEPS_1_TO_6, _metrics(LOSS), {2, 6}),
        (dict(keep_last=1, keep_best=2, best_metric="loss"), STEPS_1_TO_6, _metrics(LOSS), {2, 4, 6}),
        (dict(keep_last=1, keep_best=1, best_metric="loss", best_mode="max"), STEPS_1_TO_6, _metrics(LOSS), {3, 6}),
        (dict(keep_last=1, keep_best=2, best_metric="loss", best_mode="max"), STEPS_1_TO_6, _metrics(LOSS), {3, 6}),
        # the newest is kept whatever its metric
        (dict(keep_last=1, keep_best=1, best_metric="loss"), [1, 2], _metrics({1: 0.1, 2: 9.0}), {1, 2}),
        # steps without a usable value (missing, NaN, non-number, other key) never count as best
        (dict(keep_last=1, keep_best=1, best_metric="loss"), [1, 2, 3, 4, 5],
         {1: {}, 2: {"loss": math.nan}, 3: {"loss": "low"}, 4: {"acc": 0.0}, 5: {"loss": 1.0}}, {5}),
        (dict(keep_last=1, keep_best=1, best_metric="loss"), [1, 2, 3],
         {1: {"loss": 0.2}, 2: {"loss": math.inf}, 3: {"loss": 0.5}}, {1, 3}),
        (dict(keep_last=1, keep_best=1, best_metric="loss"), [1, 2, 3],
         {1: {"loss": True}, 2: {"loss": 0.4}, 3: {"loss": 0.5}}, {2, 3}),
        (dict(keep_last=2, keep_every_n_steps=5, keep_best=1, best_metric="loss"), list(range(1, 12)),
         _metrics({s: abs(s - 7) for s in range(1, 12)}), {5, 7, 10, 11}),
    ],
)
def test_retention_table(policy, committed, metrics, expected):
    assert RetentionPolicy(**policy).steps_to_keep(committed, metrics) == expected


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_newest_is_always_kept(n):
    policy = RetentionPolicy(keep_last=n, keep_best=1, best_metric="m")
    metrics = _metrics({s: -s for s in range(1, 10)}, key="m")  # newest is the worst ("min")
    assert 9 in policy.steps_to_keep(range(1, 10), metrics)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(keep_last=0),
        dict(keep_last=-1),
        dict(keep_last=1.5),
        dict(keep_every_n_steps=0),
        dict(keep_every_n_steps=-3),
        dict(keep_best=-1),
        dict(keep_best=2),  # without best_metric
        dict(keep_best=1, best_metric="loss", best_mode="avg"),
    ],
)
def test_retention_rejects_bad_options(kwargs):
    with pytest.raises(ConfigError):
        RetentionPolicy(**kwargs)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    "kwargs, due",
    [
        (dict(every_n_steps=3), [0, 3, 6, 9]),
        (dict(every_n_steps=1), list(range(10))),
        (dict(at_steps=frozenset({2, 7})), [2, 7]),
        (dict(every_n_steps=4, at_steps=frozenset({1, 4, 5})), [0, 1, 4, 5, 8]),
        (dict(), []),
    ],
)
def test_schedule_by_steps(kwargs, due):
    schedule = SaveSchedule(**kwargs)
    assert [s for s in range(10) if schedule.is_due(s)] == due


def test_schedule_every_n_seconds_counts_from_construction_and_last_save():
    clock = _Clock()
    schedule = SaveSchedule(every_n_seconds=10.0, clock=clock)
    assert not schedule.is_due(1)  # the first call does not save at once
    clock.now += 9.9
    assert not schedule.is_due(2)
    clock.now += 0.1
    assert schedule.is_due(3)
    schedule.mark_saved()
    assert not schedule.is_due(4)
    clock.now += 10.5
    assert schedule.is_due(5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(every_n_steps=0),
        dict(every_n_steps=-2),
        dict(every_n_steps=2.0),
        dict(every_n_seconds=0),
        dict(every_n_seconds=-1.0),
        dict(every_n_seconds=math.inf),
        dict(every_n_seconds=math.nan),
        dict(at_steps=frozenset({-1})),
    ],
)
def test_schedule_rejects_bad_options(kwargs):
    with pytest.raises(ConfigError):
        SaveSchedule(**kwargs)
