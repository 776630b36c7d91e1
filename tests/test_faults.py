import os

import pytest

from zerofit.core import faults


def test_parse_and_armed(monkeypatch):
    assert faults.parse("enospc@save:2, oom@step:5") == [faults.Fault("enospc", "save", 2), faults.Fault("oom", "step", 5)]
    monkeypatch.setenv(faults.VARIABLE, "enospc@save:2,oom@step:5")
    assert faults.armed("enospc", "save", 2) and faults.armed("oom", "step", 5)
    assert not faults.armed("enospc", "save", 1) and not faults.armed("oom", "step", 4)
    monkeypatch.delenv(faults.VARIABLE)
    assert not faults.armed("oom", "step", 5)


def test_malformed_fault_is_named():
    with pytest.raises(ValueError, match="expected kind@where:N"):
        faults.parse("enospc-save-2")


def test_a_fault_for_one_rank(monkeypatch):
    """`kind@where:N/R` strikes rank R only; disarming a fault removes it whatever its rank."""
    monkeypatch.setenv(faults.VARIABLE, "oom@step:5/1,stall@step:5/0,residue@step:2")
    monkeypatch.setenv("RANK", "1")
    assert faults.armed("oom", "step", 5) and not faults.armed("stall", "step", 5) and faults.armed("residue", "step", 2)
    monkeypatch.setenv("RANK", "0")
    assert not faults.armed("oom", "step", 5) and faults.armed("stall", "step", 5)
    faults.disarm("oom", "step", 5)
    assert os.environ[faults.VARIABLE] == "stall@step:5/0,residue@step:2"
    with pytest.raises(ValueError, match="kind@where:N/RANK"):
        faults.parse("oom@step:5/one")
