"""A throwaway CA and server certificates (``cryptography``), and an HTTPS client for
them, for the admission webhook's tests and bench/bench_webhook.py."""

from __future__ import annotations

import datetime as dt
import http.client
import ipaddress
import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class CA:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cadata=self.pem.decode())
        return context


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(common_name: str = "katamgr-webhook-test-ca") -> CA:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return CA(key, cert)


def write_server_pair(ca: CA, cert_file: Path, key_file: Path,
                      dns: tuple[str, ...] = ("localhost",), common_name: str = "localhost") -> x509.Certificate:
    """A server certificate signed by ``ca`` for 127.0.0.1 and ``dns``, written as PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder()
            .subject_name(_name(common_name)).issuer_name(ca.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca.key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    # Write the key first: a reader seeing the new cert must also see its key.
    tmp_key, tmp_cert = key_file.with_suffix(".tmp-key"), cert_file.with_suffix(".tmp-cert")
    tmp_key.write_bytes(key_pem)
    tmp_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    tmp_key.replace(key_file)
    tmp_cert.replace(cert_file)
    return cert


class Client:
    """An HTTPS client trusting ``ca`` (one keep-alive connection, like the API server's)."""

    def __init__(self, port: int, ca: CA, host: str = "127.0.0.1") -> None:
        self.port, self.host, self.context = port, host, ca.client_context()
        self.conn: http.client.HTTPSConnection | None = None

    def connect(self) -> http.client.HTTPSConnection:
        if self.conn is None:
            self.conn = http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=10)
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = self.connect()
        try:
            conn.request(method, path, body=body,
                         headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            data = resp.read()
        except Exception:
            self.close()
            raise
        if resp.getheader("Connection", "").lower() == "close":
            self.close()
        return resp.status, data

    def review(self, path: str, review: dict[str, Any]) -> dict[str, Any]:
        status, data = self.request("POST", path, json.dumps(review).encode())
        assert status == 200, (status, data)
        return json.loads(data)

    def peer_cert(self) -> bytes:
        conn = self.connect()
        if conn.sock is None:
            conn.connect()
        return conn.sock.getpeercert(binary_form=True)
