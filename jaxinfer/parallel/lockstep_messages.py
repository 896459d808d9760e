"""What process 0 sends the other processes of a job (jaxinfer.engine.lockstep), and how
each message travels on the control channel: a JSON header, with the prompts' token ids as
raw int32 bytes after it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from jaxinfer.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


@dataclasses.dataclass(frozen=True)
class AddRequest:
    prompt_token_ids: tuple[int, ...]  # as process 0 tokenized it
    params: SamplingParams
    request_id: str
    priority: int
    cache_salt: str | None


@dataclasses.dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclasses.dataclass(frozen=True)
class ResetPrefixCache:
    pass


Call = AddRequest | AbortRequest | ResetPrefixCache


@dataclasses.dataclass(frozen=True)
class Step:
    """Apply `calls` in order, then run one engine step."""

    calls: tuple[Call, ...]


@dataclasses.dataclass(frozen=True)
class Stop:
    pass


@dataclasses.dataclass(frozen=True)
class FollowerFailed:
    """What a follower sends back before it exits on an error."""

    process_id: int
    error: str


Message = Step | Stop | FollowerFailed


def encode(message: Message) -> tuple[dict, bytes]:
    """(JSON header, payload) of a message."""
    if isinstance(message, Stop):
        return {"kind": "stop"}, b""
    if isinstance(message, FollowerFailed):
        return {"kind": "failed", "process_id": message.process_id, "error": message.error}, b""
    calls, tokens = [], []
    for call in message.calls:
        if isinstance(call, AddRequest):
            calls.append(
                {
                    "kind": "add",
                    "request_id": call.request_id,
                    "tokens": len(call.prompt_token_ids),
                    "params": params_to_json(call.params),
                    "priority": call.priority,
                    "cache_salt": call.cache_salt,
                }
            )
            tokens.append(np.asarray(call.prompt_token_ids, "<i4"))
        elif isinstance(call, AbortRequest):
            calls.append({"kind": "abort", "request_id": call.request_id})
        elif isinstance(call, ResetPrefixCache):
            calls.append({"kind": "reset_prefix_cache"})
        else:
            raise TypeError(f"unknown call {call!r}")
    payload = np.concatenate(tokens).tobytes() if tokens else b""
    return {"kind": "step", "calls": calls}, payload


def decode(header: dict, payload: bytes) -> Message:
    """The message a frame holds; ValueError for one that is not a message."""
    try:
        kind = header["kind"]
        if kind == "stop":
            return Stop()
        if kind == "failed":
            return FollowerFailed(int(header["process_id"]), str(header["error"]))
        if kind != "step":
            raise ValueError(f"unknown message kind {kind!r}")
        tokens = np.frombuffer(payload, "<i4")
        calls, start = [], 0
        for call in header["calls"]:
            if call["kind"] == "add":
                count = int(call["tokens"])
                ids = tuple(int(t) for t in tokens[start : start + count])
                if len(ids) != count:
                    raise ValueError("the payload holds fewer tokens than the calls")
                start += count
                calls.append(
                    AddRequest(
                        ids,
                        params_from_json(call["params"]),
                        str(call["request_id"]),
                        int(call["priority"]),
                        call["cache_salt"],
                    )
                )
            elif call["kind"] == "abort":
                calls.append(AbortRequest(str(call["request_id"])))
            elif call["kind"] == "reset_prefix_cache":
                calls.append(ResetPrefixCache())
            else:
                raise ValueError(f"unknown call kind {call['kind']!r}")
        if start != tokens.size:
            raise ValueError("the payload holds more tokens than the calls")
        return Step(tuple(calls))
    except (KeyError, TypeError) as error:
        raise ValueError(f"a malformed message ({error!r})") from None


def params_to_json(params: SamplingParams) -> dict:
    """Every field of `params` as JSON values (params_from_json gives an equal object)."""
    out = {}
    for field in dataclasses.fields(params):
        value = getattr(params, field.name)
        if isinstance(value, RequestOutputKind):
            value = value.value
        elif isinstance(value, StructuredOutputsParams):
            value = {
                f.name: list(v) if isinstance(v := getattr(value, f.name), tuple) else v
                for f in dataclasses.fields(value)
            }
        elif isinstance(value, Mapping):  # logit_bias: integer keys, kept as pairs
            value = [[k, v] for k, v in value.items()]
        elif isinstance(value, tuple):
            value = list(value)
        out[field.name] = value
    return out


def params_from_json(values: dict) -> SamplingParams:
    values = dict(values)
    values["output_kind"] = RequestOutputKind(values["output_kind"])
    if values.get("logit_bias") is not None:
        values["logit_bias"] = {int(k): v for k, v in values["logit_bias"]}
    return SamplingParams(**values)  # (validated again; structured_outputs from its dict)
