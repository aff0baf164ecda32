"""HELLO/AUTH handshake: mutual HMAC authentication, and nothing decoded before it."""

from __future__ import annotations

import builtins
import pickle

import pytest
from wire_helpers import connected_pair, exchange, flatten, frame, handshake_stream, target_body

from actorgrad import AuthenticationError, ProtocolError
from actorgrad.wire import (
    Auth,
    Call,
    Cancel,
    Connection,
    Established,
    Goodbye,
    Heartbeat,
    Hello,
    Kind,
    Payload,
    Result,
    State,
    Tell,
)
from actorgrad.wire._connection import _encode

FLAG = "ACTORGRAD_TEST_PWNED"


class Evil:
    """Unpickling this runs code: it must never happen before authentication."""

    def __reduce__(self):
        return (exec, (f"import builtins; builtins.{FLAG} = 1",))


EVIL_PICKLE = pickle.dumps(Evil())


@pytest.fixture(autouse=True)
def _no_flag():
    assert not hasattr(builtins, FLAG)
    yield
    assert not hasattr(builtins, FLAG), "a hostile pickle was unpickled"


def _assert_error_state(conn: Connection) -> None:
    """After an error the connection stays dead: no events, no sends, no revival."""
    assert conn.state is State.ERROR
    assert conn.next_event() is None
    assert conn.next_event() is None
    conn.receive_data(frame(Kind.HEARTBEAT))  # never raises
    assert conn.next_event() is None
    with pytest.raises(ProtocolError, match="error"):
        conn.send(Heartbeat())
    assert conn.send(Goodbye(reason="bye"))  # saying goodbye is always allowed


def _hello(name: str = "mallory", rank: int = 3, nonce: bytes = b"\x01" * 32) -> bytes:
    return flatten(_encode(Hello(name=name, rank=rank, nonce=nonce)))


def _auth(digest: bytes) -> bytes:
    return flatten(_encode(Auth(digest=digest)))


# -- keys ----------------------------------------------------------------------------
@pytest.mark.parametrize("key", [None, b"k", b"\x00" * 64, "ключ".encode()])
def test_same_key_establishes(key):
    a, b = connected_pair(key, key, name_a="a", rank_a=4, name_b="b", rank_b=9)
    assert (a.peer_name, a.peer_rank, b.peer_name, b.peer_rank) == ("b", 9, "a", 4)


def test_handshake_bytes_arrive_in_any_grouping():
    """Both HELLOs first, then both AUTHs: the order of delivery does not matter."""
    a = Connection(name="a", rank=0, auth_key=b"k", initiator=True)
    b = Connection(name="b", rank=1, auth_key=b"k")
    hello_a, hello_b = flatten(a.data_to_send()), flatten(b.data_to_send())
    a.receive_data(hello_b[:10])
    assert a.next_event() is None
    a.receive_data(hello_b[10:])
    b.receive_data(hello_a)
    assert a.next_event() is None and b.next_event() is None
    auth_a, auth_b = flatten(a.data_to_send()), flatten(b.data_to_send())
    assert auth_a and auth_b and auth_a != auth_b
    b.receive_data(auth_a)
    event = b.next_event()
    assert isinstance(event, Established) and (event.peer_name, event.peer_rank) == ("a", 0)
    assert b.state is State.ESTABLISHED and a.state is State.HANDSHAKE
    # b may talk right away; a receives b's AUTH and the data in one piece.
    call = Call(request_id=1, target="t", payload=Payload.dump("hi"))
    a.receive_data(auth_b + flatten(b.send(call)))
    assert isinstance(a.next_event(), Established)
    got = a.next_event()
    assert got == call and got.payload.load() == "hi"


def test_a_connection_holds_a_small_receive_area_until_it_is_authenticated():
    """Each accepted connection used to hold 256 KiB before anyone proved the key; a
    flood of unauthenticated connections cost that much each until their deadline."""
    from actorgrad.wire._frames import HANDSHAKE_STAGING_BYTES

    a = Connection(name="a", rank=0, auth_key=b"k", initiator=True)
    b = Connection(name="b", rank=1, auth_key=b"k")
    assert len(b._decoder._staging) == HANDSHAKE_STAGING_BYTES <= 16 << 10
    hello_a = flatten(a.data_to_send())
    b.receive_data(hello_a)
    assert b.next_event() is None and len(b._decoder._staging) == HANDSHAKE_STAGING_BYTES
    a.receive_data(flatten(b.data_to_send()))  # b's HELLO and AUTH
    assert isinstance(a.next_event(), Established)
    # a's AUTH arrives with a large call right behind it, in one piece
    big = Call(request_id=7, target="t", payload=Payload.dump(b"x" * (100 << 10)))
    b.receive_data(flatten(a.data_to_send()) + flatten(a.send(big)))
    assert isinstance(b.next_event(), Established)
    got = b.next_event()
    assert got == big and got.payload.load() == b"x" * (100 << 10)
    assert len(b._decoder._staging) > HANDSHAKE_STAGING_BYTES  # the full area for data


def test_different_keys_fail_on_both_sides():
    a = Connection(name="a", rank=0, auth_key=b"key-one")
    b = Connection(name="b", rank=1, auth_key=b"key-two")
    events = exchange(a, b)
    for side, conn in (("a", a), ("b", b)):
        assert len(events[side]) == 1, events
        assert isinstance(events[side][0], AuthenticationError)
        assert "different auth_key" in str(events[side][0])
        _assert_error_state(conn)


@pytest.mark.parametrize("keyed", ["a", "b"])
def test_one_side_without_key_fails(keyed):
    a = Connection(name="a", rank=0, auth_key=b"secret" if keyed == "a" else None)
    b = Connection(name="b", rank=1, auth_key=b"secret" if keyed == "b" else None)
    events = exchange(a, b)
    has_key, no_key = (a, b) if keyed == "a" else (b, a)
    err_key = events["a" if has_key is a else "b"]
    err_none = events["b" if has_key is a else "a"]
    assert len(err_key) == 1 and isinstance(err_key[0], AuthenticationError)
    assert "sent no proof" in str(err_key[0])
    assert len(err_none) == 1 and isinstance(err_none[0], AuthenticationError)
    assert "has none" in str(err_none[0])
    _assert_error_state(has_key)
    _assert_error_state(no_key)


@pytest.mark.parametrize("digest", [b"\x00" * 32, b"x", b"\xff" * 33, b"y" * 4096])
def test_forged_proof(digest):
    conn = Connection(name="me", rank=0, auth_key=b"k")
    conn.receive_data(_hello() + _auth(digest))
    with pytest.raises(AuthenticationError, match="different auth_key"):
        conn.next_event()
    _assert_error_state(conn)


def test_replayed_proof_fails():
    """A proof recorded on one connection is worthless on the next (fresh nonce)."""
    victim1 = Connection(name="me", rank=0, auth_key=b"k")
    recorded = handshake_stream(victim1, key=b"k", name="peer")
    victim1.receive_data(recorded)
    assert isinstance(victim1.next_event(), Established)  # the recording is genuine
    victim2 = Connection(name="me", rank=0, auth_key=b"k")
    victim2.receive_data(recorded)
    with pytest.raises(AuthenticationError):
        victim2.next_event()
    _assert_error_state(victim2)


def test_proof_is_bound_to_the_prover_name():
    victim = Connection(name="me", rank=0, auth_key=b"k")
    genuine = handshake_stream(victim, key=b"k", name="peer", rank=1)
    hello_len = len(_hello(name="peer"))
    nonce = genuine[hello_len - len("peer") - 36 : hello_len - len("peer") - 4]
    assert genuine[:hello_len] == _hello(name="peer", rank=1, nonce=nonce)
    # Same nonce, same proof, another name.
    victim.receive_data(_hello(name="root", rank=1, nonce=nonce) + genuine[hello_len:])
    with pytest.raises(AuthenticationError):
        victim.next_event()


def test_reflected_handshake_is_rejected():
    """Echoing the victim's own HELLO and AUTH back must not authenticate."""
    victim = Connection(name="worker0", rank=0, auth_key=b"secret")
    victim.receive_data(flatten(victim.data_to_send()))  # its own HELLO
    with pytest.raises(AuthenticationError, match="own name"):
        while True:
            assert victim.next_event() is None
            auth = flatten(victim.data_to_send())
            assert auth
            victim.receive_data(auth)  # its own proof
    _assert_error_state(victim)


def test_relayed_proof_is_rejected():
    key = b"group key"
    alice = Connection(name="alice", rank=0, auth_key=key)  # the victim
    bob = Connection(name="bob", rank=1, auth_key=key)  # an honest worker, used as an oracle
    alice_hello = flatten(alice.data_to_send())
    bob.data_to_send()
    bob.receive_data(alice_hello)  # the attacker forwards alice's challenge to bob
    assert bob.next_event() is None
    bob_proof = flatten(bob.data_to_send())  # bob answers: HMAC over alice's nonce
    alice.receive_data(_hello(name="bob", rank=1) + bob_proof)
    with pytest.raises(AuthenticationError):
        event = alice.next_event()
        assert not isinstance(event, Established)


def test_goodbye_during_handshake():
    conn = Connection(name="me", rank=0)
    conn.receive_data(_hello() + flatten(_encode(Goodbye(reason="wrong cluster"))))
    # (not an AuthenticationError: a worker leaving a group that failed to form says
    # goodbye, and the others must not read that as a wrong key)
    with pytest.raises(ProtocolError, match="peer closed the handshake: wrong cluster"):
        conn.next_event()
    _assert_error_state(conn)


# -- ordering ------------------------------------------------------------------------
DATA_FRAMES = {
    "call": frame(Kind.CALL, 1, target_body("t", pickle.dumps(1))),
    "tell": frame(Kind.TELL, 0, target_body("t", pickle.dumps(1))),
    "result": frame(Kind.RESULT, 1, pickle.dumps(1)),
    "failure": frame(Kind.FAILURE, 1, pickle.dumps(1)),
    "heartbeat": frame(Kind.HEARTBEAT),
    "cancel": frame(Kind.CANCEL, 4),
}


@pytest.mark.parametrize("when", ["first", "after_hello"])
@pytest.mark.parametrize("what", sorted(DATA_FRAMES))
def test_data_before_handshake(what, when):
    conn = Connection(name="me", rank=0, auth_key=b"k")
    prefix = _hello() if when == "after_hello" else b""
    conn.receive_data(prefix + DATA_FRAMES[what])
    with pytest.raises(ProtocolError, match="before the handshake completed"):
        conn.next_event()
    _assert_error_state(conn)


def test_auth_before_hello():
    conn = Connection(name="me", rank=0)
    conn.receive_data(_auth(b""))
    with pytest.raises(ProtocolError, match="AUTH before HELLO"):
        conn.next_event()
    _assert_error_state(conn)


def test_second_hello():
    conn = Connection(name="me", rank=0, auth_key=b"k")
    conn.receive_data(_hello() + _hello(name="other", nonce=b"\x02" * 32))
    with pytest.raises(ProtocolError, match="second HELLO"):
        conn.next_event()
    _assert_error_state(conn)


@pytest.mark.parametrize("late", ["hello", "auth"])
def test_handshake_frames_after_established(late):
    a, b = connected_pair(b"k", b"k")
    b.receive_data(_hello() if late == "hello" else _auth(b"\x00" * 32))
    with pytest.raises(ProtocolError, match="after handshake"):
        b.next_event()
    _assert_error_state(b)


@pytest.mark.parametrize("msg", [
    Call(request_id=1, target="t", payload=Payload.dump(1)),
    Tell(target="t", payload=Payload.dump(1)),
    Result(request_id=1, payload=Payload.dump(1)),
    Heartbeat(),
    Cancel(request_id=1),
])
def test_send_before_established(msg):
    conn = Connection(name="me", rank=0)
    with pytest.raises(ProtocolError, match="handshake"):
        conn.send(msg)
    conn.receive_data(_hello())
    assert conn.next_event() is None  # HELLO seen, AUTH not yet: still not established
    with pytest.raises(ProtocolError, match="handshake"):
        conn.send(msg)
    assert conn.state is State.HANDSHAKE


# -- hostile pickles -----------------------------------------------------------------
def _evil_frames() -> dict[str, bytes]:
    return {
        "call": frame(Kind.CALL, 1, target_body("handler", EVIL_PICKLE)),
        "tell": frame(Kind.TELL, 0, target_body("handler", EVIL_PICKLE)),
        "result": frame(Kind.RESULT, 1, EVIL_PICKLE),
        "failure": frame(Kind.FAILURE, 1, EVIL_PICKLE),
    }


def test_hostile_pickle_is_really_hostile():
    """Guard for the tests below: this payload does set the flag once unpickled."""
    try:
        Payload(EVIL_PICKLE).load()
        assert getattr(builtins, FLAG) == 1
    finally:
        if hasattr(builtins, FLAG):
            delattr(builtins, FLAG)


@pytest.mark.parametrize("kind", sorted(_evil_frames()))
@pytest.mark.parametrize("when", ["first", "after_hello", "after_bad_auth", "after_no_auth"])
def test_hostile_pickle_before_auth_is_never_unpickled(kind, when):
    conn = Connection(name="me", rank=0, auth_key=b"k")
    prefix = {
        "first": b"",
        "after_hello": _hello(),
        "after_bad_auth": _hello() + _auth(b"\x00" * 32),
        "after_no_auth": _hello() + _auth(b""),
    }[when]
    conn.receive_data(prefix + _evil_frames()[kind])
    expected = ProtocolError if when in ("first", "after_hello") else AuthenticationError
    with pytest.raises(expected):
        conn.next_event()
    assert not hasattr(builtins, FLAG)
    _assert_error_state(conn)
    assert not hasattr(builtins, FLAG)


def test_hostile_pickle_is_not_unpickled_by_the_connection():
    """Even once authenticated, only ``payload.load()`` (the layer above) unpickles."""
    conn = Connection(name="me", rank=0, auth_key=b"k")
    conn.receive_data(handshake_stream(conn, key=b"k") + _evil_frames()["call"])
    assert isinstance(conn.next_event(), Established)
    call = conn.next_event()
    assert isinstance(call, Call) and call.target == "handler"
    assert bytes(call.payload.body) == EVIL_PICKLE
    assert not hasattr(builtins, FLAG)


def _pass_through(a: Connection, b: Connection) -> list[BaseException]:
    """Carry bytes both ways unchanged until neither side has more; the errors seen."""
    errors: list[BaseException] = []
    for _ in range(8):
        moved = False
        for src, dst in ((a, b), (b, a)):
            if out := flatten(src.data_to_send()):
                moved = True
                dst.receive_data(out)
                try:
                    while dst.next_event() is not None:
                        pass
                except (AuthenticationError, ProtocolError) as exc:
                    errors.append(exc)
        if not moved:
            break
    return errors


def test_a_handshake_passed_through_from_another_address_fails_on_both_sides():
    """A go-between that got a worker to dial its own address (a rewritten rendezvous
    entry) and passes every byte on to the real worker: the proofs bind the address
    each side knows, so neither side authenticates the other."""
    key = b"group key"
    dialer = Connection(name="worker1", rank=1, auth_key=key, initiator=True, endpoint="tcp 127.0.0.1 4000")
    server = Connection(name="worker0", rank=0, auth_key=key, endpoint="tcp 127.0.0.1 5000")
    errors = _pass_through(dialer, server)
    assert len(errors) == 2 and all(isinstance(e, AuthenticationError) for e in errors)
    assert "passed on from another address" in str(errors[0])
    assert dialer.state is not State.ESTABLISHED and server.state is not State.ESTABLISHED
    # the same endpoint on both sides: the handshake completes
    dialer = Connection(name="worker1", rank=1, auth_key=key, initiator=True, endpoint="tcp 127.0.0.1 5000")
    server = Connection(name="worker0", rank=0, auth_key=key, endpoint="tcp 127.0.0.1 5000")
    assert _pass_through(dialer, server) == []
    assert dialer.state is State.ESTABLISHED and server.state is State.ESTABLISHED
