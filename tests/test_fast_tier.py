"""The fast tier's guard (tests/conftest.py): a fast test that starts a process gets an error
naming the fix, whichever way it starts it."""

import multiprocessing
import os
import subprocess
import sys

import pytest

import launch


def test_a_fast_test_cannot_start_a_process(request, fast_guard):
    assert request.node.get_closest_marker("fast") is not None and fast_guard is not None
    with pytest.raises(launch.ProcessRefused,
                       match="a fast-tier test launched a process: mark it dist"):
        subprocess.run([sys.executable, "-c", "pass"], timeout=60)
    with pytest.raises(launch.ProcessRefused, match="mark it dist"):
        launch.run_python("pass", timeout=60)
    with pytest.raises(launch.ProcessRefused, match="mark it dist"):
        launch.launch([sys.executable, "-c", "pass"], timeout=60)
    with pytest.raises(launch.ProcessRefused, match="mark it dist"):
        os.fork()
    with pytest.raises(launch.ProcessRefused, match="mark it dist"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    assert len(fast_guard.refused) == 5
    fast_guard.refused.clear()  # refused on purpose; one left here would fail the test
