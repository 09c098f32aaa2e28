"""Transport security: TLS on every gRPC server and data-plane socket, the cluster token on
every data-plane connection. One embedded two-island cluster over mutual TLS with a token
for the module; certificates are made with the ``cryptography`` package at test time."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import pathways_torch as pw
from pathways_torch import P
from pathways_torch.client import runtime
from pathways_torch.rpc import grpc_util
from pathways_torch.worker import dataplane as dp

TOKEN = "tls-test-token"
ENVS = (grpc_util.TOKEN_ENV, grpc_util.TLS_CERT_ENV, grpc_util.TLS_KEY_ENV,
        grpc_util.TLS_CA_ENV, grpc_util.TLS_NAME_ENV)
TOL = dict(rtol=1e-5, atol=1e-5)    # float32 on CPU XLA against plain torch


def make_certs(d) -> SimpleNamespace:
    """A CA, a node certificate it signed (IP:127.0.0.1, DNS:localhost; server and client
    use) and an unrelated CA, as PEM files in ``d``: what the openssl CLI made before
    (``req -x509`` CAs, a node certificate signed with an extension file), made with the
    ``cryptography`` package, which requirements.txt pins (no skip: the test needs it)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def key():
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem, cert, private):
        (d / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{stem}.key").write_bytes(private.private_bytes(      # openssl -nodes
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))

    def ca(stem, cn):
        private = key()
        cert = (x509.CertificateBuilder()
                .subject_name(name(cn)).issuer_name(name(cn))
                .public_key(private.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None),
                               critical=True)
                .add_extension(x509.KeyUsage(
                    digital_signature=False, content_commitment=False,
                    key_encipherment=False, data_encipherment=False, key_agreement=False,
                    key_cert_sign=True, crl_sign=True, encipher_only=False,
                    decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(
                    private.public_key()), critical=False)
                .sign(private, hashes.SHA256()))
        write(stem, cert, private)
        return cert, private

    ca_cert, ca_key = ca("ca", "pathways-test-ca")
    node_key = key()
    node = (x509.CertificateBuilder()
            .subject_name(name("localhost")).issuer_name(ca_cert.subject)
            .public_key(node_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                           critical=False)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=True,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(
                node_key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    write("node", node, node_key)
    ca("other", "some-other-ca")
    return SimpleNamespace(cert=str(d / "node.pem"), key=str(d / "node.key"),
                           ca=str(d / "ca.pem"), other_ca=str(d / "other.pem"))


def test_the_test_certificates_chain_and_name_the_node(certs):
    """The certificates are what the other tests assume: the node's verifies against the
    CA (for 127.0.0.1 and localhost, as server and client), not against the other CA."""
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=certs.ca)
    server.load_cert_chain(certs.cert, certs.key)
    server.verify_mode = ssl.CERT_REQUIRED
    for host, ca in (("127.0.0.1", certs.ca), ("localhost", certs.ca),
                     ("127.0.0.1", certs.other_ca)):
        client = ssl.create_default_context(cafile=ca)
        client.load_cert_chain(certs.cert, certs.key)
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        errors = []

        def serve():
            conn, _ = listener.accept()
            try:
                with server.wrap_socket(conn, server_side=True) as s:
                    s.recv(1)
            except (OSError, ssl.SSLError) as e:
                errors.append(e)

        t = threading.Thread(target=serve)
        t.start()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
                if ca == certs.other_ca:
                    with pytest.raises(ssl.SSLCertVerificationError):
                        client.wrap_socket(raw, server_hostname=host)
                else:
                    with client.wrap_socket(raw, server_hostname=host) as s:
                        assert s.getpeercert()["subject"] == ((("commonName", "localhost"),),)
                        s.sendall(b"x")
        finally:
            t.join(30)
            listener.close()
        if ca == certs.ca:
            assert errors == [], errors        # the server took the client's certificate


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_cluster(certs):
    """An embedded cluster (2 islands x 1 host x 4 devices) with mutual TLS and a token;
    the environment is restored afterwards, so later modules run in plain text."""
    saved = {k: os.environ.get(k) for k in ENVS}
    os.environ[grpc_util.TOKEN_ENV] = TOKEN          # the embedded cluster inherits it
    try:
        grpc_util.set_tls(certs.cert, certs.key, certs.ca)
        pw.init(islands=2, devices_per_host=4, timeout=120)
        try:
            yield runtime._state
        finally:
            pw.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def islands(tls_cluster):
    a, b = pw.slice((2,), island=0), pw.slice((2,), island=1)
    try:
        yield a, b
    finally:
        a.release()
        b.release()


def closed_by_peer(s: socket.socket, timeout: float = 30.0) -> bool:
    """Whether the peer closes ``s`` (it sends nothing more before it does)."""
    s.settimeout(timeout)
    try:
        while True:
            if not s.recv(4096):
                return True
    except TimeoutError:
        return False
    except OSError:             # reset, or a TLS connection cut without close_notify
        return True


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    dp._recv_exact(s, memoryview(buf))
    return bytes(buf)


def test_a_program_with_a_cross_island_transfer_runs_over_tls(islands):
    a, b = islands
    g = torch.Generator().manual_seed(0)
    x_t, w_t = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)

    @pw.program
    def layer(x, w):
        return torch.tanh(x @ w)

    @pw.program
    def head(h):
        return (h * 3 + 1).sum(dim=1)

    before = b.stats().bytes_received
    h = layer(pw.put(x_t, a, P("data")), pw.put(w_t, a))       # island 0
    out = head(h.to(b, P("data"))).torch()                     # island 0 -> 1, then island 1
    want = (torch.tanh(x_t @ w_t) * 3 + 1).sum(dim=1)
    torch.testing.assert_close(out, want, **TOL)
    assert b.stats().bytes_received - before == 8 * 4 * 4      # over the TLS socket


def test_plain_text_grpc_is_refused_by_the_coordinator_and_executors(tls_cluster, islands):
    import grpc

    from pathways_torch.rpc import pathways_pb2 as pb
    from pathways_torch.rpc import pathways_pb2_grpc as pbg
    md = [(grpc_util.TOKEN_KEY, TOKEN)]
    coord = pbg.CoordinatorStub(grpc.insecure_channel(tls_cluster.address))
    with pytest.raises(grpc.RpcError) as e:
        coord.ListDevices(pb.ListDevicesRequest(), timeout=30, metadata=md)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    executor = pbg.ExecutorStub(grpc.insecure_channel(islands[1]._conn.address))
    with pytest.raises(grpc.RpcError) as e:
        executor.Stats(pb.StatsRequest(), timeout=30, metadata=md)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


CLIENT = textwrap.dedent("""
    import sys, torch
    import pathways_torch as pw
    address, cert, key, ca, other_ca = sys.argv[1:6]
    tries = [("PLAIN", dict(tls_cert="", tls_key="", tls_ca="")),
             ("WRONG_CA", dict(tls_cert=cert, tls_key=key, tls_ca=other_ca)),
             ("NO_CLIENT_CERT", dict(tls_cert="", tls_key="", tls_ca=ca)),
             ("GOOD", dict(tls_cert=cert, tls_key=key, tls_ca=ca))]
    for name, kw in tries:
        try:
            pw.init(address=address, **kw)
        except pw.PathwaysError as e:
            print(name, "REFUSED", str(e).replace("\\n", " "), flush=True)
            continue
        s = pw.slice((2,), island=1)
        double = pw.program(lambda x: x * 2)
        print(name, "RESULT", double(pw.put(torch.arange(4.), s)).torch().tolist(), flush=True)
        pw.shutdown()
""")


def test_clients_with_the_wrong_tls_settings_get_a_clear_error(tls_cluster, certs, tmp_path):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    env = dict(os.environ)
    for k in ENVS + ("PATHWAYS_ADDRESS",):
        env.pop(k, None)
    env[grpc_util.TOKEN_ENV] = TOKEN
    r = subprocess.run([sys.executable, str(script), tls_cluster.address, certs.cert,
                        certs.key, certs.ca, certs.other_ca], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in r.stdout.splitlines()}
    assert got["PLAIN"].startswith("REFUSED"), got
    assert "TLS" in got["PLAIN"] and "--tls-ca" in got["PLAIN"], got["PLAIN"]
    assert got["WRONG_CA"].startswith("REFUSED") and "TLS handshake" in got["WRONG_CA"]
    assert "CERTIFICATE_VERIFY_FAILED" in got["WRONG_CA"], got["WRONG_CA"]
    assert got["NO_CLIENT_CERT"].startswith("REFUSED"), got
    assert "mutual TLS" in got["NO_CLIENT_CERT"], got["NO_CLIENT_CERT"]
    assert got["GOOD"] == "RESULT [0.0, 2.0, 4.0, 6.0]", got


def test_data_plane_refuses_connections_without_tls_or_the_token(tls_cluster, islands,
                                                                 certs):
    a, b = islands
    host, port = b.data_address.rsplit(":", 1)
    x_t = torch.arange(6.)
    x = pw.put(x_t, a)
    assert x.to(b).torch().tolist() == x_t.tolist()       # the path works (and is open)

    # Plain TCP: a forged transfer frame, refused by the TLS handshake.
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(dp.HEADER.pack(dp.MAGIC, 7, 0, 8, 0) + b"garbage!")
        assert closed_by_peer(s)

    # TLS with a certificate the cluster accepts, but the wrong token.
    _, client_ctx = dp.tls_contexts(grpc_util.TLSFiles(certs.cert, certs.key, certs.ca, ""))
    with client_ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=30),
                                server_hostname=host) as s:
        magic, nonce_s = dp.CHALLENGE.unpack(recv_exact(s, dp.CHALLENGE.size))
        assert magic == dp.AUTH_MAGIC
        nonce_c = os.urandom(32)
        s.sendall(dp.RESPONSE.pack(dp.AUTH_MAGIC, nonce_c,
                                   dp._mac(b"not-the-token", b"client", nonce_s, nonce_c)))
        try:
            s.sendall(dp.HEADER.pack(dp.MAGIC, 8, 0, 8, 0) + b"garbage!")
        except (OSError, ssl.SSLError):
            pass                    # already closed
        assert closed_by_peer(s)

    # The refusals are logged by the receiving executor (its stderr is its worker's log).
    log = os.path.join(tls_cluster.cluster.logdir, "worker-i1-h0.log")
    deadline = time.monotonic() + 30
    while True:
        with open(log, errors="replace") as f:
            text = f.read()
        if text.count("refused a connection") >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "missing or wrong cluster token" in text, text[-2000:]
    assert text.count("refused a connection") >= 2, text[-2000:]

    # Later legitimate transfers still work, on the existing and on a new connection.
    y_t = torch.randn(5, 3)
    y = pw.put(y_t, a)
    torch.testing.assert_close(y.to(b).torch(), y_t, rtol=0, atol=0)
    with pw.slice((2,), island=0) as c:
        torch.testing.assert_close(pw.put(y_t, c).to(b).torch(), y_t, rtol=0, atol=0)


def test_data_plane_token_without_tls(monkeypatch):
    """In-process data planes on loopback, plain TCP: the token exchange alone."""
    for k in ENVS:
        monkeypatch.setenv(k, "")          # "" is unset; restored afterwards
    recv = dp.DataPlane("127.0.0.1", token=TOKEN)
    planes = [recv]
    try:
        host, port = recv.address.rsplit(":", 1)
        # A connection that connects and closes (a liveness probe) is no refusal.
        socket.create_connection((host, int(port)), timeout=30).close()

        # The wrong token: the sender learns it was refused, nothing arrives.
        bad = dp.DataPlane("127.0.0.1", token="wrong")
        planes.append(bad)
        with pytest.raises(PermissionError, match="refused"):
            bad.send(recv.address, 1, memoryview(b"x" * 16))
        assert recv.refused == 1
        assert recv.take(1, 0.5) is None

        # No token at all: its header is read as a wrong answer; the frame never lands.
        with socket.create_connection((host, int(port)), timeout=30) as s:
            assert recv_exact(s, dp.CHALLENGE.size)[:8] == dp.AUTH_MAGIC
            s.sendall(dp.HEADER.pack(dp.MAGIC, 2, 0, 64, 0) + b"y" * 64)
            assert closed_by_peer(s)
        assert recv.take(2, 0.5) is None
        assert recv.refused == 2

        # The right token: the transfer lands intact, on one reused connection.
        good = dp.DataPlane("127.0.0.1", token=TOKEN)
        planes.append(good)
        payload = os.urandom(1 << 20)
        good.send(recv.address, 3, memoryview(payload))
        good.send(recv.address, 4, memoryview(payload[:10]))
        assert bytes(recv.take(3, 30).payload) == payload
        assert bytes(recv.take(4, 30).payload) == payload[:10]
        assert recv.refused == 2

        # Without a token (loopback clusters) there is no exchange: a frame is a frame.
        open_plane = dp.DataPlane("127.0.0.1", token="")
        planes.append(open_plane)
        oh, op = open_plane.address.rsplit(":", 1)
        with socket.create_connection((oh, int(op)), timeout=30) as s:
            s.sendall(dp.HEADER.pack(dp.MAGIC, 5, 0, 3, 0) + b"abc")
            assert bytes(open_plane.take(5, 30).payload) == b"abc"
    finally:
        for p in planes:
            p.close()


def test_tls_flags_reach_the_environment(certs, monkeypatch, tmp_path):
    """The launcher, coordinator and worker parsers take --tls-*; set_tls exports them."""
    import argparse

    from pathways_torch import launch
    from pathways_torch.coordinator import service
    from pathways_torch.worker import agent
    for k in ENVS:
        monkeypatch.setenv(k, "")          # "" is unset; restored afterwards
    flags = ["--tls-cert", certs.cert, "--tls-key", certs.key, "--tls-ca", certs.ca]
    for add in (service.add_arguments, agent.add_arguments):
        ap = argparse.ArgumentParser()
        add(ap)
        args = ap.parse_args(flags)
        assert (args.tls_cert, args.tls_key, args.tls_ca) == (certs.cert, certs.key, certs.ca)
    args = launch.parse(flags + ["--coordinator"])
    grpc_util.apply_tls_arguments(args)
    assert grpc_util.tls() == grpc_util.TLSFiles(certs.cert, certs.key, certs.ca, "")
    assert os.environ[grpc_util.TLS_CA_ENV] == certs.ca
    grpc_util.set_tls("", "", "")
    assert grpc_util.tls() is None
    with pytest.raises(pw.PathwaysError, match="both --tls-cert and --tls-key"):
        grpc_util.set_tls(cert=certs.cert)
    assert grpc_util.tls() is None                          # refused settings change nothing
    assert launch.main(["--tls-cert", str(tmp_path / "missing.pem"), "x.py"]) == 2
