"""A local cluster's certificates (openssl) and kubeconfigs. Part of hack/local-cluster."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import localnode
from clusterstate import SERVICE_IP


def openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def make_pki(pki: Path, node_ip: str = "") -> None:
    """A CA, the API server's serving cert, client certs for the admin and the two
    controllers (names the default RBAC bindings know), and the service-account key; with
    a node, the kubelet's (the Node authorizer's name for it) and kube-proxy's."""
    pki.mkdir(mode=0o700, parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"),
            "-subj", "/CN=local-cluster-ca", "-days", "3650",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature")
    leaves = {
        "apiserver": ("/CN=kube-apiserver", "serverAuth",
                      f"DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
                      f"DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,"
                      f"IP:127.0.0.1,IP:{SERVICE_IP}" + (f",IP:{node_ip}" if node_ip else "")),
        "admin": ("/O=system:masters/CN=local-cluster-admin", "clientAuth", ""),
        "controller-manager": ("/CN=system:kube-controller-manager", "clientAuth", ""),
        "scheduler": ("/CN=system:kube-scheduler", "clientAuth", ""),
        "apiserver-kubelet-client": ("/O=system:masters/CN=kube-apiserver-kubelet-client",
                                     "clientAuth", ""),
    }
    if node_ip:
        leaves["kubelet"] = (f"/O=system:nodes/CN=system:node:{localnode.NODE_NAME}",
                             "clientAuth", "")
        leaves["kube-proxy"] = ("/CN=system:kube-proxy", "clientAuth", "")
    for name, (subject, usage, san) in leaves.items():
        ext = pki / f"{name}.ext"
        lines = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature",
                 f"extendedKeyUsage={usage}"]
        if san:
            lines.append(f"subjectAltName={san}")
        ext.write_text("\n".join(lines) + "\n")
        openssl("req", "-new", *ec, "-keyout", str(pki / f"{name}.key"),
                "-out", str(pki / f"{name}.csr"), "-subj", subject)
        openssl("x509", "-req", "-in", str(pki / f"{name}.csr"), "-CA", str(pki / "ca.crt"),
                "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "3650",
                "-out", str(pki / f"{name}.crt"), "-extfile", str(ext))
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
            "-out", str(pki / "sa.key"))
    openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    """A kubeconfig as JSON (valid YAML), certificates by path."""
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {
            "server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": user, "user": {
            "client-certificate": str(pki / f"{user}.crt"),
            "client-key": str(pki / f"{user}.key")}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)
