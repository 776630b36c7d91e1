import pytest

from zerofit import faults


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
