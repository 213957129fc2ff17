"""The token's challenge-response (common/auth.py, decision 0025): both sides, without sockets."""

from __future__ import annotations

import pytest

from kvpool.common.auth import HANDSHAKE_TAG, ServerHandshake, TokenChecker, client_handshake
from kvpool.common.errors import ErrorCode, KvPoolError

TOKEN = b"the-cluster-token"


class Recorder:
    """Moves HELLO payloads to a server handshake and keeps every payload and answer it saw."""

    def __init__(self, server: ServerHandshake) -> None:
        self.server = server
        self.sent: list[bytes] = []
        self.answers: list[tuple[ErrorCode, bytes]] = []

    def __call__(self, payload: bytes) -> tuple[int, bytes]:
        self.sent.append(payload)
        code, body, _why = self.server.answer(payload)
        self.answers.append((code, body))
        return int(code), body


def test_the_right_token_opens_the_connection_and_never_travels() -> None:
    checker = TokenChecker(TOKEN)
    wire = Recorder(checker.handshake("data"))
    assert not wire.server.done
    client_handshake(TOKEN, wire, "peer")
    assert wire.server.done
    assert len(wire.sent) == 2
    assert all(TOKEN not in payload for payload in wire.sent)
    assert all(TOKEN not in body for _code, body in wire.answers)
    assert checker.refused == 0


def test_a_replayed_session_is_refused() -> None:
    checker = TokenChecker(TOKEN)
    recorded = Recorder(checker.handshake("rpc"))
    client_handshake(TOKEN, recorded, "peer")
    replay = checker.handshake("rpc")
    code, challenge, _ = replay.answer(recorded.sent[0])
    assert code == ErrorCode.OK
    assert challenge != recorded.answers[0][1]  # a fresh challenge every time
    code, _body, why = replay.answer(recorded.sent[1])
    assert code == ErrorCode.AUTH_FAILED, why
    assert not replay.done
    # Even on the recorded connection itself, an answer counts once.
    code, _body, _why = recorded.server.answer(recorded.sent[1])
    assert code == ErrorCode.AUTH_FAILED
    assert checker.refused == 2


def test_a_wrong_token_is_refused_by_the_server() -> None:
    checker = TokenChecker(TOKEN)
    server = checker.handshake("data")
    code, reply, _ = server.answer(HANDSHAKE_TAG + b"\x01" + bytes(32))
    assert code == ErrorCode.OK
    assert len(reply) == 64
    code, _body, why = server.answer(HANDSHAKE_TAG + b"\x02" + bytes(32))
    assert (code, why) == (ErrorCode.AUTH_FAILED, "wrong cluster token")
    assert not server.done
    assert checker.refused_by_plane == {"data": 1}


def test_a_client_with_a_wrong_token_does_not_trust_the_server() -> None:
    wire = Recorder(TokenChecker(TOKEN).handshake("data"))
    with pytest.raises(KvPoolError) as info:
        client_handshake(b"another-token", wire, "store x")
    assert info.value.code == ErrorCode.AUTH_FAILED
    assert len(wire.sent) == 1  # it never answered the challenge


@pytest.mark.parametrize("impostor_token", [b"a-guess", b""], ids=["wrong-token", "no-token"])
def test_an_impostor_server_is_refused_by_the_client(impostor_token: bytes) -> None:
    wire = Recorder(TokenChecker(impostor_token).handshake("data"))
    with pytest.raises(KvPoolError) as info:
        client_handshake(TOKEN, wire, "store x")
    assert info.value.code == ErrorCode.AUTH_FAILED
    assert "prove" in info.value.message
    assert len(wire.sent) == 1  # the impostor got no proof of ours to replay elsewhere


def test_a_token_in_clear_is_a_version_mismatch() -> None:
    checker = TokenChecker(TOKEN)
    code, _body, why = checker.handshake("rpc").answer(TOKEN)
    assert code == ErrorCode.AUTH_VERSION_MISMATCH
    assert "older" in why
    assert checker.refused == 1


def test_a_server_from_before_the_handshake_is_named_as_such() -> None:
    def old_server(payload: bytes) -> tuple[int, bytes]:  # decision 0007: compares the payload with the token
        return (0 if payload == TOKEN else int(ErrorCode.AUTH_FAILED)), b""

    with pytest.raises(KvPoolError) as info:
        client_handshake(TOKEN, old_server, "master m")
    assert info.value.code == ErrorCode.AUTH_VERSION_MISMATCH
    assert "older" in info.value.message


@pytest.mark.parametrize(
    "payload", [HANDSHAKE_TAG, HANDSHAKE_TAG + b"\x01" + bytes(5), HANDSHAKE_TAG + b"\x03" + bytes(32)]
)
def test_malformed_hellos_are_bad_frames(payload: bytes) -> None:
    code, _body, _why = TokenChecker(TOKEN).handshake("data").answer(payload)
    assert code == ErrorCode.BAD_FRAME


def test_without_a_token_any_hello_is_answered_ok() -> None:
    server = TokenChecker(b"").handshake("data")
    assert server.done
    assert server.answer(b"anything")[0] == ErrorCode.OK
