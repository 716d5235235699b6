"""The chart, the image and the Python package describe one release.

No Helm engine here: these read the files as a release script would. The image's recipe is
hack/image/recipe.py (tests/image builds and runs it); the rendered chart's image is checked
against the reference hack/image/build names in test_chart_objects.py.
"""

from __future__ import annotations

import subprocess
import tomllib

import yaml
from support.paths import REPO

CHART = REPO / "deploy" / "helm" / "kata-sandbox-manager"


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_package_chart_and_image_versions_agree():
    package = pyproject()["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    image_version = yaml.safe_load((CHART / "values.yaml").read_text())["image"]["tag"]
    assert chart["appVersion"] == package, "Chart.yaml appVersion must be the package version"
    # Empty means "the chart's appVersion"; a pinned tag must still be this release.
    assert image_version in ("", package)


def test_there_is_one_image_recipe():
    """No Dockerfile beside hack/image/recipe.py: a second description of the image would
    drift from the one the tests run."""
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "*Dockerfile*",  # noqa: S603, S607
                              "*.dockerignore"], capture_output=True, text=True, check=True)
    assert tracked.stdout == ""
