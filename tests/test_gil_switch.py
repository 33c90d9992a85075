"""MC_GIL_SWITCH_US (connector/lifecycle._gil_switch_interval): a worker
process's GIL switch interval, an experiment for push layer notices
(benchmarks/JOURNAL.md "Run 52"); a bad value is named and ignored."""
import logging
import sys

import pytest

from mooncake_connector.connector import lifecycle


@pytest.fixture
def restore():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_set_in_microseconds(monkeypatch, restore):
    monkeypatch.setenv("MC_GIL_SWITCH_US", "500")
    lifecycle._gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.0005)


@pytest.mark.parametrize("value", ["abc", "0", "20", "1000000", "-5", "1e3"])
def test_a_bad_value_is_named_and_changes_nothing(monkeypatch, restore, caplog, value):
    sys.setswitchinterval(0.005)
    monkeypatch.setenv("MC_GIL_SWITCH_US", value)
    with caplog.at_level(logging.WARNING, logger="vllm.mooncake_connector"):
        lifecycle._gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert f"MC_GIL_SWITCH_US={value!r} is not a number of microseconds in 50..100000" \
        in caplog.text


def test_unset_changes_nothing(monkeypatch, restore):
    sys.setswitchinterval(0.005)
    monkeypatch.delenv("MC_GIL_SWITCH_US", raising=False)
    lifecycle._gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.005)
