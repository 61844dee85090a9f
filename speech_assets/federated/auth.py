"""The local federation's credentials: a throw-away CA and TLS certificate for the SuperLink, one EC
key pair per SuperNode, registered before it starts (Flower 1.42 authenticates SuperNodes only over
TLS), so a process without a registered key cannot join. Private keys are 0600 and deleted when the
federation stops. The same keys sign secure-aggregation advertisements (:func:`identity_key`).

``python -m speech_assets.federated.auth register HOME CONNECTION PUBLIC_KEY...`` registers keys in
one interpreter (each ``flwr`` CLI start costs seconds) and prints ``{public key file: node id}``.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from speech_assets.layout import NODE_PUBLIC_KEY, FlowerTls, NodeKeys

HOST = "127.0.0.1"
VALID_FOR = datetime.timedelta(days=30)


def _write_private(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    return path


def _certificate(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    builder = x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
    builder = builder.serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
    return builder.not_valid_after(now + VALID_FOR)


def make_tls(folder: Path) -> FlowerTls:
    """A CA and a certificate for ``127.0.0.1``/``localhost`` signed by it, under ``folder``."""
    ca_key, key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "speech_assets local federation CA")])
    ca = (
        _certificate(ca_name, ca_name, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    names = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST)), x509.DNSName("localhost")])
    cert = (
        _certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)]), ca_name, key)
        .add_extension(names, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    files = FlowerTls(folder)
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(
        files.key,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return files


def make_node_key(folder: Path, name: str) -> NodeKeys:
    """A SuperNode's key pair as Flower reads them (OpenSSH, NIST P-384): ``<folder>/<name>.key`` (0600)
    and ``<name>.pub``."""
    key = ec.generate_private_key(ec.SECP384R1())
    keys = NodeKeys(folder)
    _write_private(
        keys.private(name),
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    keys.public(name).write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    return keys


def identity_key(folder: str | os.PathLike[str], client_id: str) -> ec.EllipticCurvePrivateKey:
    """This node's identity key: its SuperNode's authentication key (OpenSSH, EC)."""
    path = NodeKeys(Path(folder)).private(client_id)
    try:
        key = serialization.load_ssh_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError) as error:
        raise ValueError(f"{client_id}: cannot read its node identity key {path}: {error}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{client_id}: its node identity key {path} is not an EC key")
    return key


def authorised_keys(folder: str | os.PathLike[str]) -> dict[str, ec.EllipticCurvePublicKey]:
    """``{client id: public key}`` of every ``<client>.pub`` in ``folder``; a bad key is an error, not a skip."""
    keys = {}
    for path in sorted(Path(folder).glob(NODE_PUBLIC_KEY.format("*"))):
        try:
            key = serialization.load_ssh_public_key(path.read_bytes())
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read the authorised node key {path}: {error}") from None
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise ValueError(f"the authorised node key {path} is not an EC key")
        keys[path.name.removesuffix(NODE_PUBLIC_KEY.format(""))] = key
    return keys


def register(connection: str, public_keys: list[Path]) -> dict[str, int]:
    """As ``flwr supernode register`` does, for the SuperLink of ``connection``: ``{key file: node id}``."""
    from flwr.cli.flower_config import read_superlink_connection
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.cli.utils import init_http_client_from_connection
    from flwr.proto.control_pb2 import RegisterNodeRequest  # pylint: disable=E0611

    client = init_http_client_from_connection(read_superlink_connection(connection))
    try:
        found = {}
        for path in public_keys:
            response = client.RegisterNode(request=RegisterNodeRequest(public_key=try_load_public_key(path)))
            if not response.node_id:
                raise RuntimeError(f"the SuperLink did not register {path}")
            found[str(path)] = int(response.node_id)
        return found
    finally:
        client.close()


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] != "register":
        print("usage: python -m speech_assets.federated.auth register HOME CONNECTION PUBLIC_KEY...", file=sys.stderr)
        return 2
    os.environ["FLWR_HOME"] = argv[1]
    print(json.dumps(register(argv[2], [Path(p) for p in argv[3:]])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
