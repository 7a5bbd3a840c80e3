"""`import megatron_bridge` leaves the process's warning filters alone; the entry points set theirs."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import warnings
before = list(warnings.filters)
import megatron_bridge
import megatron_bridge.training.config
after = list(warnings.filters)
# megatron-core itself may add filters on import; ours must not be among them.
ours = [f for f in after if f not in before and f[1] is not None and any(
    k in f[1].pattern for k in ("Transformer Engine", "Apex is not", "full scope", "pynvml"))]
print("OURS", len(ours))
from megatron_bridge.warning_filters import quiet_known_warnings
quiet_known_warnings()
print("AFTER", len(list(warnings.filters)) - len(after))
"""


@pytest.mark.timeout(120)
def test_import_does_not_change_warning_filters():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
    assert "OURS 0" in out
    assert "AFTER 4" in out  # the entry points do install theirs


@pytest.mark.timeout(60)
def test_plain_import_keeps_filters_identical():
    probe = "import warnings; b = list(warnings.filters); import megatron_bridge; print(b == list(warnings.filters))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
