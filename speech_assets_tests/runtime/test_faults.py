import os
import subprocess
import sys

import pytest

from speech_assets.runtime.faults import FAULTS_ENV, fault, inject, parse
from speech_assets.runtime.waiting import WaitTimeout, wait_until


def test_nothing_happens_unless_a_test_turns_it_on(monkeypatch):
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    assert inject("train.step", rank=0, step=1) is False


def test_preempt_is_said_only_where_it_was_aimed(monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, fault("train.step", "preempt", step=3))
    assert inject("train.step", rank=0, step=3) is True
    assert inject("train.step", rank=1, step=3) is True  # no rank chosen: every rank stops
    assert inject("train.step", rank=0, step=2) is False
    assert inject("other.point", step=3) is False


def test_a_fault_fires_only_where_it_was_aimed_and_once(monkeypatch, tmp_path):
    once = tmp_path / "fired"
    monkeypatch.setenv(FAULTS_ENV, fault("train.step", "raise", rank=1, step=3, once=once))
    inject("train.step", rank=0, step=3)
    inject("train.step", rank=1, step=2)
    inject("other.point", rank=1, step=3)
    with pytest.raises(KeyError, match="raise at train.step"):
        inject("train.step", error=KeyError, rank=1, step=3)
    assert "rank=1 step=3" in once.read_text()
    inject("train.step", rank=1, step=3)  # once: the marker is there


def test_exit_ends_the_real_process_with_its_code(tmp_path):
    env = {**os.environ, FAULTS_ENV: fault("p", "exit", who="a", code=7)}
    code = (
        "from speech_assets.runtime.faults import inject; inject('p', who='b'); print('alive'); inject('p', "
        "who='a'); print('not reached')"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (7, "alive\n")


@pytest.mark.parametrize(
    "spec",
    ["p", "p exit raise", "p explode", "p hold", "p where=1 exit code=x"],
    ids=["no-action", "two", "unknown", "hold-no-marker", "bad-code"],
)
def test_a_malformed_fault_is_an_error(spec):
    with pytest.raises(ValueError):
        parse(spec)


def test_wait_until_returns_the_first_truthy_value_or_names_what_it_waited_for():
    values = iter([0, None, "ready"])
    assert wait_until(lambda: next(values), 5, "x", interval=0) == "ready"
    with pytest.raises(WaitTimeout, match="waiting for the moon"):
        wait_until(lambda: False, 0.05, "the moon", interval=0.01)
