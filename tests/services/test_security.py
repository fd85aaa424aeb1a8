"""TLS, mutual TLS and the bearer token, with real processes and certificates made at test time.

The topology is the one `deploy/k8s/components/tls` sets up: clients reach the scheduler over
TLS and present a bearer token; the scheduler reaches its workers over mutual TLS, and a worker
accepts only peers with a certificate from its client CA. Each refusal below is paired with the
same call succeeding when the missing piece is supplied, so a refusal cannot pass for a service
that is simply down.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.servers import start_scheduler, start_worker
from zerobubble.api import generate_pb2, generate_pb2_grpc
from zerobubble.client import ChannelSettings, build_request, complete, open_channel
from zerobubble.tools.launch import ROOT, start_front

pytestmark = pytest.mark.timeout(300)

TOKEN = "s3cret-token"


# -- certificates ----------------------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert: x509.Certificate, key) -> tuple[str, str]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


def make_ca(path: Path, cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write(path, cert, key)
    return cert, key


def make_leaf(path: Path, ca, cn: str, server: bool, ip_san: bool = True) -> tuple[str, str]:
    """A certificate signed by `ca`: a server one (SAN localhost, and 127.0.0.1 with `ip_san`)
    or a client one."""
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if server:
        names = [x509.DNSName("localhost")]
        if ip_san:
            names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return _write(path, builder.sign(ca_key, hashes.SHA256()), key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d / "ca", "zerobubble test CA")
    other_ca = make_ca(d / "other-ca", "some other CA")
    server_cert, server_key = make_leaf(d / "server", ca, "zerobubble", server=True)
    # Like the Kubernetes TLS component's internal certificate, the worker's names the Service's
    # DNS name only: pod IPs come and go and are in no certificate.
    worker_cert, worker_key = make_leaf(d / "worker", ca, "zerobubble-worker", server=True, ip_san=False)
    client_cert, client_key = make_leaf(d / "client", ca, "zerobubble-scheduler", server=False)
    stranger_cert, stranger_key = make_leaf(d / "stranger", other_ca, "stranger", server=False)
    return dict(
        ca=str(d / "ca.crt"),
        other_ca=str(d / "other-ca.crt"),
        server_cert=server_cert,
        server_key=server_key,
        worker_cert=worker_cert,
        worker_key=worker_key,
        client_cert=client_cert,
        client_key=client_key,
        stranger_cert=stranger_cert,
        stranger_key=stranger_key,
    )


# -- services --------------------------------------------------------------------------------------


def wait_serving_tls(target: str, ca: str, timeout: float = 60.0) -> None:
    """Health is open without a token (probes have none), but it is behind TLS like the rest."""
    creds = grpc.ssl_channel_credentials(Path(ca).read_bytes())
    deadline = time.monotonic() + timeout
    with grpc.secure_channel(target, creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{target} not SERVING over TLS after {timeout}s")


def mtls_worker_options(pki) -> dict:
    """TLS with a client certificate required from the scheduler."""
    return dict(tls_cert=pki["worker_cert"], tls_key=pki["worker_key"], tls_client_ca=pki["ca"])


@pytest.fixture(scope="module")
def mtls_worker(pki, smollm2_dir):
    worker = start_worker(kv_cache_memory_gb=0.1, max_num_seqs=4, **mtls_worker_options(pki))
    yield worker
    worker.stop()


def dns_target(worker) -> str:
    """The worker by name, the way the deployment lists workers (`dns:///<service>:<port>`).

    The scheduler resolves the name to addresses and connects to each, but must still verify
    each worker's certificate against the name, not against the address it connected to.
    """
    return f"dns:///localhost:{worker.port}"


def secure_scheduler_options(pki) -> dict:
    """TLS towards clients with the token, mutual TLS towards the workers."""
    return dict(
        tls_cert=pki["server_cert"],
        tls_key=pki["server_key"],
        worker_tls_ca=pki["ca"],
        worker_tls_cert=pki["client_cert"],
        worker_tls_key=pki["client_key"],
        auth_token=TOKEN,
    )


@pytest.fixture(scope="module")
def secure_scheduler(pki, mtls_worker):
    scheduler = start_scheduler([dns_target(mtls_worker)], **secure_scheduler_options(pki))
    wait_serving_tls(scheduler.target, pki["ca"])
    yield scheduler
    scheduler.stop()


def generate(settings: ChannelSettings, timeout: float = 60, **request):
    async def go():
        async with open_channel(settings) as channel:
            return await complete(channel, build_request(**request), timeout=timeout)

    return asyncio.run(go())


def call_unary(settings: ChannelSettings, method: str):
    async def go():
        async with open_channel(settings) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            if method == "ModelInfo":
                return await stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=20)
            return await stub.Tokenize(generate_pb2.TokenizeRequest(prompt="hi"), timeout=20)

    return asyncio.run(go())


def rpc_error(fn, *args, **kwargs) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        fn(*args, **kwargs)
    return info.value


# -- client side: TLS and token ------------------------------------------------------------------


def test_tls_client_with_the_token_generates(secure_scheduler, pki):
    # This also proves the scheduler reached the worker over mutual TLS.
    ok = ChannelSettings(secure_scheduler.target, tls_ca=pki["ca"], auth_token=TOKEN)
    reply = generate(ok, prompt="1, 2, 3, 4,", max_tokens=6)
    assert reply.finish_reason == "max_tokens" and len(reply.token_ids) == 6
    assert call_unary(ok, "ModelInfo").num_workers == 1
    assert call_unary(ok, "Tokenize").token_ids


def test_plaintext_client_is_refused(secure_scheduler):
    plain = ChannelSettings(secure_scheduler.target, auth_token=TOKEN)
    err = rpc_error(generate, plain, timeout=20, prompt="hi", max_tokens=2)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err


def test_client_that_does_not_trust_the_server_is_refused(secure_scheduler, pki):
    # Verification is on: a CA that did not sign the server's certificate fails the handshake.
    wrong_ca = ChannelSettings(secure_scheduler.target, tls_ca=pki["other_ca"], auth_token=TOKEN)
    err = rpc_error(generate, wrong_ca, timeout=20, prompt="hi", max_tokens=2)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err


@pytest.mark.parametrize("token", ["", "wrong-token", TOKEN + "x"])
def test_missing_or_wrong_token_is_unauthenticated(secure_scheduler, pki, token):
    settings = ChannelSettings(secure_scheduler.target, tls_ca=pki["ca"], auth_token=token)
    err = rpc_error(generate, settings, prompt="hi", max_tokens=2)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    for method in ("ModelInfo", "Tokenize"):
        err = rpc_error(call_unary, settings, method)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (method, err)


def test_generate_command_speaks_tls_with_token(secure_scheduler, pki):
    """`zerobubble generate` with --tls-ca/--auth-token, and its clear failure without a token."""
    base = [
        sys.executable,
        "-m",
        "zerobubble",
        "generate",
        "--target",
        secure_scheduler.target,
        "--tls-ca",
        pki["ca"],
        "--prompt",
        "1, 2, 3,",
        "--max-tokens",
        "4",
        "--json",
    ]
    ok = subprocess.run(base + ["--auth-token", TOKEN], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert '"finish_reason": "max_tokens"' in ok.stdout
    denied = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert denied.returncode == 1
    assert "UNAUTHENTICATED" in denied.stderr


# -- scheduler to worker: mutual TLS --------------------------------------------------------------


def _never_serves(scheduler, ca: str | None, seconds: float = 4.0) -> None:
    """The scheduler stays NOT_SERVING and Generate is UNAVAILABLE: no worker accepted it."""
    creds = grpc.ssl_channel_credentials(Path(ca).read_bytes()) if ca else None
    deadline = time.monotonic() + seconds
    channel = grpc.secure_channel(scheduler.target, creds) if creds else grpc.insecure_channel(scheduler.target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            time.sleep(0.5)
    settings = ChannelSettings(scheduler.target, tls_ca=ca or "")
    err = rpc_error(generate, settings, timeout=20, prompt="hi", max_tokens=2)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err


@pytest.mark.parametrize("client_cert", ["none", "stranger"])
def test_scheduler_without_a_trusted_client_cert_cannot_use_an_mtls_worker(
    pki, mtls_worker, secure_scheduler, client_cert
):
    """Same worker, same CA; only the scheduler's client certificate is missing or untrusted.

    `secure_scheduler` (with the right certificate) is a fixture here so that the positive
    control, the same worker serving a scheduler that has one, is up at the same time.
    """
    extra = (
        {} if client_cert == "none" else dict(worker_tls_cert=pki["stranger_cert"], worker_tls_key=pki["stranger_key"])
    )
    scheduler = start_scheduler([dns_target(mtls_worker)], worker_tls_ca=pki["ca"], **extra)
    try:
        _never_serves(scheduler, None)
        assert "connected to worker" not in "".join(scheduler.log)
    finally:
        scheduler.stop()
    ok = ChannelSettings(secure_scheduler.target, tls_ca=pki["ca"], auth_token=TOKEN)
    assert generate(ok, prompt="Hello", max_tokens=3).finish_reason in ("max_tokens", "eos")


def test_plaintext_scheduler_cannot_use_a_tls_worker(mtls_worker):
    scheduler = start_scheduler([dns_target(mtls_worker)])
    try:
        _never_serves(scheduler, None)
    finally:
        scheduler.stop()


# -- a front in front of a TLS scheduler ----------------------------------------------------------


def test_a_front_relays_to_a_tls_scheduler_and_serves_its_own_clients_over_tls(secure_scheduler, pki):
    """A hand-started front: TLS with the scheduler's CA and the scheduler's token on its hop,
    its own certificate and token towards its clients. The same greedy text as a direct call;
    a front that does not trust the scheduler's certificate never attaches, and its clients get
    UNAVAILABLE instead of a hang."""
    front_token = "front-" + TOKEN
    front = start_front(
        secure_scheduler,
        scheduler_tls_ca=pki["ca"],
        scheduler_auth_token=TOKEN,
        tls_cert=pki["server_cert"],
        tls_key=pki["server_key"],
        auth_token=front_token,
    )
    untrusting = start_front(secure_scheduler, scheduler_tls_ca=pki["other_ca"], scheduler_auth_token=TOKEN)
    try:
        wait_serving_tls(front.target, pki["ca"])
        via_front = ChannelSettings(front.target, tls_ca=pki["ca"], auth_token=front_token)
        direct = ChannelSettings(secure_scheduler.target, tls_ca=pki["ca"], auth_token=TOKEN)
        relayed = generate(via_front, prompt="1, 2, 3, 4,", max_tokens=6)
        assert relayed.finish_reason == "max_tokens"
        assert relayed.token_ids == generate(direct, prompt="1, 2, 3, 4,", max_tokens=6).token_ids
        assert call_unary(via_front, "ModelInfo").num_workers == 1
        # The front checks its own clients' token, not the scheduler's.
        err = rpc_error(generate, ChannelSettings(front.target, tls_ca=pki["ca"], auth_token=TOKEN), prompt="hi")
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
        err = rpc_error(generate, ChannelSettings(untrusting.target), timeout=20, prompt="hi", max_tokens=2)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "attached to the scheduler" not in "".join(untrusting.log)
    finally:
        untrusting.stop()
        front.stop()


def test_fronts_of_a_tls_scheduler_serve_its_clients_with_its_certificate_and_token(pki):
    """`--fronts` on a scheduler with TLS and a token (the gpu overlays' shape): its fronts
    take the client port with its certificate and check its token; the scheduler itself moves
    to loopback."""
    worker = start_worker(simulate_device_ms=2.0, max_num_seqs=4, **mtls_worker_options(pki))
    scheduler = start_scheduler([dns_target(worker)], **secure_scheduler_options(pki), fronts=1, http_port=-1)
    try:
        wait_serving_tls(scheduler.target, pki["ca"])
        reply = generate(
            ChannelSettings(scheduler.target, tls_ca=pki["ca"], auth_token=TOKEN), prompt="1, 2,", max_tokens=5
        )
        assert reply.finish_reason == "max_tokens" and len(reply.token_ids) == 5
        assert "front attached" in "".join(scheduler.log), "the scheduler answered, not a front"
        wrong = ChannelSettings(scheduler.target, tls_ca=pki["ca"], auth_token="wrong-token")
        assert rpc_error(generate, wrong, prompt="hi", max_tokens=2).code() == grpc.StatusCode.UNAUTHENTICATED
        plain = ChannelSettings(scheduler.target, auth_token=TOKEN)
        assert rpc_error(generate, plain, timeout=20, prompt="hi", max_tokens=2).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        scheduler.stop()
        worker.stop()
