"""One version, written in pyproject.toml and fgfw.__version__, with its entry in CHANGELOG.md."""
import re
import sys
from pathlib import Path

import pytest

import fgfw
from fgfw import reference

REPO = Path(__file__).resolve().parents[1]


def test_pyproject_and_the_package_give_the_same_version():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["version"] == fgfw.__version__


def test_the_changelog_has_the_version_and_its_tangent_stream():
    changelog = (REPO / "CHANGELOG.md").read_text()
    entry = re.search(rf"^## {re.escape(fgfw.__version__)}\b.*?(?=^## |\Z)", changelog, flags=re.M | re.S)
    assert entry is not None, f"CHANGELOG.md has no '## {fgfw.__version__}' section"
    assert f"Tangent stream version {reference.TANGENT_STREAM_VERSION}." in entry.group(0)
