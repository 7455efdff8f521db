"""Ray's TLS between the head and the hosts (`[head] tls = true`): a CA and per-node certificates.

Ray's own traffic (the GCS, the raylets, the workers, object transfers over gRPC) is plaintext by
default, and ProxyJump covers SSH only. With `tls = true` in the inventory's `[head]`, `cluster
up` makes a CA once (`<head workdir>/tls/ca.crt`, its key `ca.key` mode 0600, never copied), a
certificate for the head (its Ray IP, its address, `localhost`, 127.0.0.1), and one per host (its
Ray IP and SSH address), each with its own key; a host gets `ca.crt`, `node.crt` and `node.key`
(mode 0600) in `<workdir>/tls/` over SFTP, made afresh at each start. Every Ray process runs with
`RAY_USE_TLS=1` and those paths (head, nodes, their workers, and the drivers on the head:
`orchestrate run`, `cluster status`), so every gRPC connection is mutual TLS: encrypted, and a
peer without a certificate from this CA is refused before it can learn the token. `cluster down`
removes the hosts' copies.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
from pathlib import Path
from typing import Any

from orchestrator.errors import InfrastructureError
from orchestrator.specs.sweep import InventorySpec
from workers.files import write_atomic

CA_DAYS = 3650
CERT_DAYS = 365
NODE_FILES = ("ca.crt", "node.crt", "node.key")


def tls_dir(inventory: InventorySpec) -> Path:
    """Where the head keeps the CA and its own certificate."""
    return Path(inventory.head.workdir).expanduser() / "tls"


def _write_private(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomic(path, lambda fh: fh.write(data), mode=mode)


def _ca_usage(x509: Any) -> Any:
    """A CA's key usage: it signs certificates (and revocation lists), nothing else."""
    unused = ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement")
    flags = dict.fromkeys((*unused, "encipher_only", "decipher_only"), False)
    return x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, **flags)


def _ca(inventory: InventorySpec) -> tuple[object, object]:
    """The cluster's CA (certificate, private key), made on first use."""
    # cryptography: only when certificates are made
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    root = tls_dir(inventory)
    cert_path, key_path = root / "ca.crt", root / "ca.key"
    if cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "orchestrate cluster CA")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_ca_usage(x509), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    pem_key = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write_private(key_path, pem_key, 0o600)
    _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key


def issue(inventory: InventorySpec, name: str, addresses: list[str]) -> tuple[bytes, bytes, bytes]:
    """A certificate for one Ray node, signed by the cluster's CA.

    Args:
        inventory: The inventory (its head's workdir holds the CA).
        name: The node's name (its certificate's common name).
        addresses: The IPs and host names the node is reached at (its subject alternative names).

    Returns:
        The CA certificate, the node's certificate and its private key, all PEM.
    """
    # cryptography: only when certificates are made
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert, ca_key = _ca(inventory)
    assert isinstance(ca_cert, x509.Certificate) and isinstance(ca_key, ec.EllipticCurvePrivateKey)
    names: list[x509.GeneralName] = []
    for address in dict.fromkeys([*addresses, "localhost", "127.0.0.1"]):
        try:  # an IP is matched as an IP SAN by some TLS stacks and as a DNS name by others
            names += [x509.IPAddress(ipaddress.ip_address(address)), x509.DNSName(address)]
        except ValueError:
            names.append(x509.DNSName(address))
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    pem_key = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca_cert.public_bytes(pem), cert.public_bytes(pem), pem_key


def tls_env(ca: str, cert: str, key: str) -> dict[str, str]:
    """The variables that make a Ray process speak TLS with these files."""
    return {"RAY_USE_TLS": "1", "RAY_TLS_CA_CERT": ca, "RAY_TLS_SERVER_CERT": cert, "RAY_TLS_SERVER_KEY": key}


def head_tls_env(inventory: InventorySpec, *, ip: str | None = None) -> dict[str, str]:
    """The TLS variables of Ray processes on the head ({} without `tls`).

    Args:
        inventory: The inventory.
        ip: The head's Ray IP when the head is being started: its certificate is made afresh.
            None (a driver joining a running head): the head's certificate must exist.

    Raises:
        InfrastructureError: a driver asks for TLS before `cluster up` made the head's certificate.
    """
    if not inventory.head.tls:
        return {}
    root = tls_dir(inventory)
    cert, key = root / "head.crt", root / "head.key"
    if ip is not None:
        from ray._private.services import resolve_ip_for_localhost  # Ray's own IP for a loopback one

        address = inventory.head.address or ip
        names = [ip, resolve_ip_for_localhost(ip), address, socket.gethostname()]
        _, node_cert, node_key = issue(inventory, "head", names)
        _write_private(key, node_key, 0o600)
        _write_private(cert, node_cert, 0o644)
    elif not (cert.exists() and key.exists()):
        raise InfrastructureError(
            f"[head] tls is on but {cert} is missing: start the cluster with `orchestrate cluster up`"
        )
    return tls_env(str(root / "ca.crt"), str(cert), str(key))
