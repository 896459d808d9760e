"""The control channel between process 0 and the other processes of a job: TCP, one
connection per follower, opened with a mutual HMAC handshake and carrying plain frames.

Process 0 listens on the interface that faces the others (the one its coordinator address
routes over, or DistributedConfig.control_host), on a port it broadcasts with a fresh key
over the job's collectives. Each connection must prove the key within HANDSHAKE_SECONDS, in
its own thread: a stranger that sends garbage, stays silent, uses another key, or claims a
process id that is not a follower's (or is taken) is logged and closed, and never delays the
followers. A follower checks process 0's proof in turn.

A frame is a JSON header and raw bytes (the prompts' token ids), each length-prefixed:
nothing read from the network is unpickled.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time

logger = logging.getLogger(__name__)

KEY_BYTES = 32
HANDSHAKE_SECONDS = 10.0
_MAGIC = b"jaxinfer-control/1\n"
_NONCE = 32
_MAC = hashlib.sha256().digest_size
_FRAME = struct.Struct("!IQ")  # header bytes, payload bytes
MAX_HEADER_BYTES = 64 << 20
MAX_PAYLOAD_BYTES = 4 << 30


class ChannelError(ConnectionError):
    pass


class Channel:
    """One authenticated connection: send() from one thread, recv() from another."""

    def __init__(self, sock: socket.socket):
        sock.settimeout(None)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._send_lock = threading.Lock()

    def send(self, header: dict, payload: bytes = b"") -> None:
        """OSError if the connection is gone."""
        encoded = json.dumps(header).encode()
        with self._send_lock:
            self._sock.sendall(_FRAME.pack(len(encoded), len(payload)) + encoded)
            if payload:
                self._sock.sendall(payload)

    def recv(self) -> tuple[dict, bytes]:
        """The next frame; EOFError once the peer has closed, ChannelError for a frame that
        is not one."""
        header_size, payload_size = _FRAME.unpack(_read(self._sock, _FRAME.size))
        if header_size > MAX_HEADER_BYTES or payload_size > MAX_PAYLOAD_BYTES:
            raise ChannelError(f"a frame of {header_size} + {payload_size} bytes")
        try:
            header = json.loads(_read(self._sock, header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ChannelError(f"a frame header that is not JSON ({error})") from None
        if not isinstance(header, dict):
            raise ChannelError("a frame header that is not a JSON object")
        return header, _read(self._sock, payload_size)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _read(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes; EOFError if the peer closes first."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = sock.recv_into(view[got:])
        if not count:
            raise EOFError("the connection closed")
        got += count
    return bytes(buffer)


def _mac(key: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, role + b"".join(parts), hashlib.sha256).digest()


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def facing_address(host: str, port: int) -> tuple[int, str]:
    """(address family, local address) of the interface this host reaches `host` over."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # (UDP: routes, sends nothing)
        return family, probe.getsockname()[0]


class ControlListener:
    """Process 0's end: listen(), broadcast `port` and the key, then accept_followers()."""

    def __init__(self, host: str, key: bytes, followers: int):
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._key = key
        self._expected = set(range(1, followers + 1))

    def accept_followers(self, timeout: float) -> list[Channel]:
        """A channel to each follower (process order), each proven; every other connection
        is refused. ChannelError if not all have arrived within `timeout` seconds."""
        joined: dict[int, Channel] = {}
        lock = threading.Lock()
        all_joined = threading.Event()
        if not self._expected:
            all_joined.set()

        def handshake(sock: socket.socket, peer) -> None:
            try:
                process_id = self._prove(sock)
                with lock:
                    if process_id in joined:
                        raise ChannelError(f"process {process_id} has already joined")
                    joined[process_id] = Channel(sock)
                    if len(joined) == len(self._expected):
                        all_joined.set()
            except (OSError, EOFError, ValueError, struct.error) as error:
                logger.warning("control channel: refused a connection from %s: %s", peer, error)
                sock.close()

        deadline = time.monotonic() + timeout
        self._sock.settimeout(0.2)
        try:
            while not all_joined.is_set():
                if time.monotonic() > deadline:
                    missing = sorted(self._expected - set(joined))
                    raise ChannelError(f"processes {missing} did not join within {timeout} s")
                try:
                    sock, peer = self._sock.accept()
                except TimeoutError:
                    continue
                threading.Thread(
                    target=handshake, args=(sock, peer), name="control-handshake", daemon=True
                ).start()
        except BaseException:
            for channel in joined.values():
                channel.close()
            raise
        finally:
            self._sock.close()
        return [joined[i] for i in sorted(joined)]

    def _prove(self, sock: socket.socket) -> int:
        """The follower's process id once it has proven the key (and been given process 0's
        proof); ChannelError otherwise."""
        sock.settimeout(HANDSHAKE_SECONDS)
        nonce = secrets.token_bytes(_NONCE)
        sock.sendall(_MAGIC + nonce)
        answer = _read(sock, 4 + _NONCE + _MAC)
        process_id = struct.unpack("!I", answer[:4])[0]
        theirs, mac = answer[4 : 4 + _NONCE], answer[4 + _NONCE :]
        if not hmac.compare_digest(mac, _mac(self._key, b"follower", nonce, theirs, answer[:4])):
            raise ChannelError("it did not prove the job's key")
        if process_id not in self._expected:
            raise ChannelError(f"it claims process id {process_id}, not a follower's")
        sock.sendall(_mac(self._key, b"leader", theirs, nonce, answer[:4]))
        return process_id


def connect_to_leader(host: str, port: int, key: bytes, process_id: int) -> Channel:
    """A follower's channel to process 0, each side having proven the key; ChannelError if
    process 0 does not."""
    sock = socket.create_connection((host, port), timeout=HANDSHAKE_SECONDS)
    try:
        greeting = _read(sock, len(_MAGIC) + _NONCE)
        if not greeting.startswith(_MAGIC):
            raise ChannelError(f"{host}:{port} is not a jaxinfer control channel")
        theirs, mine = greeting[len(_MAGIC) :], secrets.token_bytes(_NONCE)
        who = struct.pack("!I", process_id)
        sock.sendall(who + mine + _mac(key, b"follower", theirs, mine, who))
        proof = _read(sock, _MAC)
        if not hmac.compare_digest(proof, _mac(key, b"leader", mine, theirs, who)):
            raise ChannelError(f"{host}:{port} did not prove the job's key")
    except BaseException:
        sock.close()
        raise
    return Channel(sock)
