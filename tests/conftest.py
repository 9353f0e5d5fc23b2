"""Shared fixtures: the shared data folder (skip when absent) and tiny models of every family."""

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "wikitext-2").is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (these tests need ../shared/data)")
    return SHARED_DATA
