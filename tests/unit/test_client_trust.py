"""TrustWindow and Backoff: pure timing logic, driven by an injected clock."""

import random
from datetime import UTC, datetime, timedelta

import pytest

from leasekeeper._backoff import Backoff
from leasekeeper._trust import TrustWindow, default_safety_margin


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_window_before_any_confirmation_is_expired():
    window = TrustWindow(0.5, FakeClock())
    assert window.deadline is None
    assert window.expired()
    assert window.remaining_s() == 0.0


def test_confirm_sets_deadline_from_send_time_not_receive_time():
    clock = FakeClock(100.0)
    window = TrustWindow(1.0, clock)
    clock.now = 102.0  # the answer arrives 2 s after the request left
    window.confirm(send_time=100.0, remaining_ttl_s=30.0)
    assert window.deadline == pytest.approx(129.0)
    assert window.remaining_s() == pytest.approx(27.0)


@pytest.mark.parametrize(
    ("now", "expired"),
    [(128.999, False), (129.0, True), (129.001, True)],
)
def test_expired_at_deadline_boundary(now, expired):
    clock = FakeClock(100.0)
    window = TrustWindow(1.0, clock)
    window.confirm(100.0, 30.0)
    clock.now = now
    assert window.expired() is expired


def test_confirm_later_renewal_moves_deadline_forward():
    clock = FakeClock(100.0)
    window = TrustWindow(1.0, clock)
    window.confirm(100.0, 30.0)
    window.confirm(110.0, 30.0)
    assert window.deadline == pytest.approx(139.0)


def test_confirm_latest_answer_may_shorten_deadline():
    # Near the runtime budget the server renews to less than before.
    window = TrustWindow(1.0, FakeClock(100.0))
    window.confirm(100.0, 30.0)
    window.confirm(110.0, 5.0)
    assert window.deadline == pytest.approx(114.0)


def test_confirm_stale_answer_is_ignored():
    window = TrustWindow(1.0, FakeClock(100.0))
    window.confirm(110.0, 30.0)
    window.confirm(100.0, 60.0)  # answer to an older beat
    assert window.deadline == pytest.approx(139.0)


def test_confirm_unrenewed_answer_never_extends():
    window = TrustWindow(1.0, FakeClock(100.0))
    window.confirm(100.0, 30.0)
    window.confirm(105.0, 30.0, renewed=False)
    assert window.deadline == pytest.approx(129.0)
    window.confirm(106.0, 10.0, renewed=False)
    assert window.deadline == pytest.approx(115.0)


BUDGET_END = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("runtime_deadline", "expire_times", "reason"),
    [
        (BUDGET_END, [BUDGET_END - timedelta(seconds=1)], "LEASE_EXPIRED"),
        (BUDGET_END, [BUDGET_END], "RUNTIME_EXCEEDED"),  # renewals capped at the budget
        (BUDGET_END, [BUDGET_END - timedelta(seconds=9), BUDGET_END], "RUNTIME_EXCEEDED"),
        (None, [BUDGET_END], "LEASE_EXPIRED"),  # budget unknown
        (BUDGET_END, [None], "LEASE_EXPIRED"),  # answer without an expire_time
    ],
)
def test_loss_reason_follows_the_answer_that_set_the_deadline(
    runtime_deadline, expire_times, reason
):
    window = TrustWindow(1.0, FakeClock(100.0), runtime_deadline)
    for send_time, expire_time in enumerate(expire_times, start=100):
        window.confirm(float(send_time), 5.0, expire_time=expire_time)
    assert window.loss_reason == reason


def test_loss_reason_ignores_a_stale_answer():
    window = TrustWindow(1.0, FakeClock(100.0), BUDGET_END)
    window.confirm(110.0, 5.0, expire_time=BUDGET_END)
    window.confirm(100.0, 5.0, expire_time=BUDGET_END - timedelta(seconds=10))
    assert window.loss_reason == "RUNTIME_EXCEEDED"


def test_window_negative_margin_raises_value_error():
    with pytest.raises(ValueError, match="safety_margin_s"):
        TrustWindow(-0.1)


@pytest.mark.parametrize(
    ("ttl_s", "margin_s"),
    [(30.0, 1.0), (10.0, 1.0), (5.0, 0.5), (0.3, 0.03), (0.0, 0.0)],
)
def test_default_safety_margin_is_min_of_1s_and_tenth_of_ttl(ttl_s, margin_s):
    assert default_safety_margin(ttl_s) == pytest.approx(margin_s)


def test_backoff_delays_stay_within_doubling_cap():
    backoff = Backoff(initial_s=0.1, max_s=1.0, rng=random.Random(7))
    caps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    for cap in caps:
        assert 0.0 <= backoff.next_delay_s() <= cap


def test_backoff_hint_caps_delay_just_past_holder_expiry():
    backoff = Backoff(initial_s=10.0, max_s=10.0, rng=random.Random(1))
    delays = [backoff.next_delay_s(hint_s=0.02) for _ in range(20)]
    assert max(delays) <= 0.025


def test_backoff_reset_restarts_from_initial_cap():
    backoff = Backoff(initial_s=0.1, max_s=100.0, rng=random.Random(3))
    for _ in range(10):
        backoff.next_delay_s()
    backoff.reset()
    assert backoff.next_delay_s() <= 0.1
