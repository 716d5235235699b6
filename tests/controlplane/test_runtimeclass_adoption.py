"""Upgrading from a release whose agents made the RuntimeClasses (docs/operating.md, "Upgrading
from a release whose agents made the RuntimeClasses"), on the real API server: classes applied
by katamgr's own code as an old agent did, the two `kubectl` lines of that section run as
written, and then the chart's RuntimeClasses applied server-side over them as Helm applies
them, with no field conflict.

Helm refuses to take over an existing object unless it is labeled
app.kubernetes.io/managed-by=Helm and annotated meta.helm.sh/release-name and
meta.helm.sh/release-namespace with the release's (helm.sh/helm/v4 pkg/action/validate.go,
checkOwnership, called by existingResourceConflict before any pre-upgrade hook runs:
pkg/action/upgrade.go, performUpgrade), and then sets those itself on every object it applies
(setMetadataVisitor). A server-side apply without force conflicts only where another field
manager owns a field with a different value; `kubectl label --overwrite` moves the label it
changes to its own manager (Kubernetes docs, "Server-Side Apply", Conflicts and Field
management: an update changing a field's value takes its ownership).
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
from support.chartkit import render_release
from support.paths import REPO

from katamgr.cluster.runtimeclasses import reconcile_runtime_classes
from katamgr.config import parse_config

pytestmark = pytest.mark.integration

# The release and namespace the documented commands name (the README's install).
RELEASE = NAMESPACE = "kata-sandbox-manager"
VALUES = {"sandboxWorkloads": {"enabled": True}, "kataManager": {"enabled": True}}
SECTION = "Upgrading from a release whose agents made the RuntimeClasses"


def documented_kubectl_lines() -> list[list[str]]:
    """The kubectl commands of the operating guide's adoption section, as written."""
    text = (REPO / "docs" / "operating.md").read_text()
    section = text[text.index(SECTION):]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    lines = [line.strip() for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("kubectl ")]


def as_helm_applies(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as Helm sends it: its ownership annotations added (setMetadataVisitor)."""
    annotations = {**(obj["metadata"].get("annotations") or {}),
                   "meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": NAMESPACE}
    return {**obj, "metadata": {**obj["metadata"], "annotations": annotations}}


def test_an_old_agents_runtime_classes_are_handed_to_the_release_as_documented(kube):
    objects = render_release(VALUES, RELEASE)
    classes = [o for o in objects if o["kind"] == "RuntimeClass"]
    names = [o["metadata"]["name"] for o in classes]
    kube.kubectl("delete", "runtimeclass", *names, "--ignore-not-found")
    try:
        # What the old agent applied: katamgr's own reconcile, from the release's config.
        configmap = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-config"))
        changes = reconcile_runtime_classes(kube.client(), parse_config(configmap["data"]["config.yaml"]))
        assert sorted(changes.created) == sorted(names)
        old = kube.get("runtimeclass", names[0])
        assert old["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "kata-sandbox-manager"}

        commands = documented_kubectl_lines()
        assert [c[:3] for c in commands] == [["kubectl", "label", "runtimeclass"],
                                             ["kubectl", "annotate", "runtimeclass"]]
        for command in commands:
            assert set(names) <= set(command), f"the documented command names {names}: {command}"
            kube.kubectl(*command[1:])

        # What Helm's ownership check reads.
        for name in names:
            meta = kube.get("runtimeclass", name)["metadata"]
            assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
            assert meta["annotations"]["meta.helm.sh/release-name"] == RELEASE
            assert meta["annotations"]["meta.helm.sh/release-namespace"] == NAMESPACE

        # Helm's server-side apply of the chart's classes: no conflict with the old agent's
        # fields (the same values), and the classes are the chart's.
        result = kube.apply([as_helm_applies(o) for o in classes], manager="helm")
        assert result.stdout.count("serverside-applied") == len(classes), result.stdout + result.stderr
        for obj in classes:
            stored = kube.get("runtimeclass", obj["metadata"]["name"])
            assert stored["handler"] == obj["handler"]
            assert stored["scheduling"] == obj["scheduling"]
            assert obj["metadata"]["labels"].items() <= stored["metadata"]["labels"].items()
    finally:
        kube.kubectl("delete", "runtimeclass", *names, "--ignore-not-found", check=False)
