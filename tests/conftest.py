"""Shared pytest configuration (keep minimal; launch helpers live in tests/launch.py)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "dist: launches torchrun worker processes (multi-process, seconds each)")
