"""The control channel of a job of several processes (jaxinfer.parallel.channel): strangers on
process 0's port (garbage, silence, another key, a process id that is not a follower's or is
taken) are refused without delaying the followers; no pickle crosses; every message and the
sampling parameters come back as they went."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from jaxinfer.engine.lockstep import control_bind_host
from jaxinfer.parallel import channel as channel_module
from jaxinfer.parallel.channel import (
    ChannelError,
    ControlListener,
    connect_to_leader,
    facing_address,
    new_key,
)
from jaxinfer.parallel.distributed import DistributedConfig
from jaxinfer.parallel.lockstep_messages import (
    AbortRequest,
    AddRequest,
    FollowerFailed,
    ResetPrefixCache,
    Step,
    Stop,
    decode,
    encode,
    params_from_json,
    params_to_json,
)
from jaxinfer.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

EVERY_FIELD = SamplingParams(
    n=3,
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    logit_bias={5: -100.0, 17: 2.5},
    allowed_token_ids=[3, 4, 5, 17],
    bad_words=["fox", "dog"],
    min_tokens=2,
    max_tokens=40,
    stop=["\n\n", "END"],
    stop_token_ids=[9, 8],
    include_stop_str_in_output=True,
    ignore_eos=True,
    seed=2**64 - 1,
    logprobs=4,
    prompt_logprobs=2,
    skip_special_tokens=False,
    structured_outputs=StructuredOutputsParams(json={"type": "object", "required": ["a"]}),
    output_kind=RequestOutputKind.DELTA,
    num_speculative_tokens=3,
)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0, max_tokens=None),
        EVERY_FIELD,
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        SamplingParams(structured_outputs={"json_object": True}),
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+")),
    ],
)
def test_sampling_params_cross_as_json_unchanged(params):
    import json

    assert params_from_json(json.loads(json.dumps(params_to_json(params)))) == params


def test_messages_cross_unchanged_with_their_tokens_as_raw_bytes():
    step = Step(
        (
            AddRequest((1, 2, 3, 150_000), EVERY_FIELD, "a" * 32 + "-0", 2, "salt"),
            AbortRequest("gone-0"),
            AddRequest((), SamplingParams(), "empty-0", 0, None),
            ResetPrefixCache(),
            AddRequest((7,), SamplingParams(seed=1), "b-0", -1, None),
        )
    )
    header, payload = encode(step)
    assert len(payload) == 5 * 4 and b"150000" not in payload
    assert decode(header, payload) == step
    for message in (Stop(), FollowerFailed(2, "it broke")):
        assert decode(*encode(message)) == message


@pytest.mark.parametrize(
    ("header", "payload"),
    [
        ({"kind": "pickle"}, b""),
        ({}, b""),
        ({"kind": "step", "calls": [{"kind": "add", "tokens": 2}]}, b"\0" * 8),
        ({"kind": "step", "calls": [{"kind": "nope"}]}, b""),
        ({"kind": "step", "calls": []}, b"\0" * 4),  # tokens nobody claims
        (
            {
                "kind": "step",
                "calls": [
                    {
                        "kind": "add",
                        "request_id": "x",
                        "tokens": 3,
                        "params": params_to_json(SamplingParams()),
                        "priority": 0,
                        "cache_salt": None,
                    }
                ],
            },
            b"\0" * 8,  # fewer tokens than claimed
        ),
        ({"kind": "step", "calls": [{"kind": "abort"}]}, b""),
    ],
)
def test_malformed_messages_are_errors(header, payload):
    with pytest.raises(ValueError):
        decode(header, payload)


# -- the handshake ---------------------------------------------------------------------------


def stranger(port: int, send: bytes | None, hold: float = 0.0) -> None:
    """Connects to process 0's port, sends `send` (None: nothing), stays `hold` seconds."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        if send is not None:
            sock.sendall(send)
        time.sleep(hold)


def wrong_key_follower(port: int, process_id: int) -> None:
    with pytest.raises((ChannelError, EOFError, OSError)):
        connect_to_leader("127.0.0.1", port, new_key(), process_id)


def test_process_0_takes_its_followers_and_refuses_every_stranger(caplog):
    key = new_key()
    listener = ControlListener("127.0.0.1", key, followers=2)
    port = listener.port
    followers: dict[int, object] = {}

    def follower(process_id, delay):
        time.sleep(delay)
        followers[process_id] = connect_to_leader("127.0.0.1", port, key, process_id)

    threads = [
        threading.Thread(target=stranger, args=(port, None, 30.0), daemon=True),  # silent
        threading.Thread(target=stranger, args=(port, b"\x80\x04garbage" * 50)),
        threading.Thread(target=stranger, args=(port, b"")),  # connects and leaves
        threading.Thread(target=wrong_key_follower, args=(port, 1)),
        threading.Thread(target=follower, args=(2, 0.3)),
        threading.Thread(target=follower, args=(1, 0.5)),
    ]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    channels = listener.accept_followers(timeout=30)
    took = time.monotonic() - started
    for thread in threads[1:]:
        thread.join(10)
    assert took < 5, f"the strangers held the followers up for {took:.1f} s"
    assert len(channels) == 2 and set(followers) == {1, 2}
    # In process order, and each one the follower's own: a message crosses each way.
    for process_id, leader_end in enumerate(channels, start=1):
        leader_end.send(*encode(Step((AbortRequest(f"to-{process_id}"),))))
        assert decode(*followers[process_id].recv()) == Step((AbortRequest(f"to-{process_id}"),))
        followers[process_id].send(*encode(FollowerFailed(process_id, "bye")))
        assert decode(*leader_end.recv()) == FollowerFailed(process_id, "bye")
    assert "did not prove the job's key" in caplog.text


def test_a_process_id_that_is_not_a_free_followers_is_refused(caplog):
    key = new_key()
    listener = ControlListener("127.0.0.1", key, followers=1)
    results = {}

    def join(name, process_id, delay):
        time.sleep(delay)
        try:
            results[name] = connect_to_leader("127.0.0.1", listener.port, key, process_id)
        except (ChannelError, EOFError, OSError) as error:
            results[name] = error

    threads = [
        threading.Thread(target=join, args=("zero", 0, 0.0)),
        threading.Thread(target=join, args=("seven", 7, 0.0)),
        threading.Thread(target=join, args=("one", 1, 0.3)),
    ]
    for thread in threads:
        thread.start()
    (channel,) = listener.accept_followers(timeout=30)
    for thread in threads:
        thread.join(10)
    assert not isinstance(results["one"], Exception)
    assert isinstance(results["zero"], Exception) and isinstance(results["seven"], Exception)
    assert "claims process id 0" in caplog.text and "claims process id 7" in caplog.text
    channel.close()


def test_followers_that_never_come_are_an_error_not_a_hang():
    listener = ControlListener("127.0.0.1", new_key(), followers=1)
    threading.Thread(target=stranger, args=(listener.port, None, 5.0), daemon=True).start()
    with pytest.raises(ChannelError, match=r"processes \[1\] did not join"):
        listener.accept_followers(timeout=1.0)


def test_a_follower_refuses_a_leader_that_does_not_prove_the_key(monkeypatch):
    monkeypatch.setattr(channel_module, "HANDSHAKE_SECONDS", 2.0)
    for greeting in (b"not a jaxinfer channel" * 3, None):
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]

        def answer(server=server, greeting=greeting):
            sock, _ = server.accept()
            with sock:
                if greeting is not None:
                    sock.sendall(greeting)
                time.sleep(3)

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises((ChannelError, OSError)):
            connect_to_leader("127.0.0.1", port, new_key(), 1)
        server.close()
    # A real listener with another key: its proof does not check out.
    listener = ControlListener("127.0.0.1", new_key(), followers=1)
    threading.Thread(target=listener.accept_followers, args=(3.0,), daemon=True).start()
    with pytest.raises((ChannelError, EOFError, OSError)):
        connect_to_leader("127.0.0.1", listener.port, new_key(), 1)


def test_a_frame_larger_than_allowed_is_an_error():
    a, b = socket.socketpair()
    sender, receiver = channel_module.Channel(a), channel_module.Channel(b)
    a.sendall(struct.pack("!IQ", channel_module.MAX_HEADER_BYTES + 1, 0))
    with pytest.raises(ChannelError):
        receiver.recv()
    sender.close()
    with pytest.raises(EOFError):
        receiver.recv()


def test_process_0_listens_on_the_interface_facing_the_others():
    assert facing_address("127.0.0.1", 1234)[1] == "127.0.0.1"
    loopback = DistributedConfig("127.0.0.1:1234", 2, 0)
    assert control_bind_host(loopback) == "127.0.0.1"
    chosen = DistributedConfig("127.0.0.1:1234", 2, 0, control_host="127.0.0.2")
    assert control_bind_host(chosen) == "127.0.0.2" and chosen.control_connect_host == "127.0.0.2"
    v6 = DistributedConfig("[::1]:1234", 2, 1)
    assert v6.coordinator_host == "::1" and v6.coordinator_port == 1234
    with pytest.raises(ValueError, match="control_host"):
        DistributedConfig(control_host="10.0.0.1")
