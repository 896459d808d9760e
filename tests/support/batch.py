"""Helpers for batch-run tests: input lines, result records, comparing bodies."""

from __future__ import annotations

import json

import pytest


def line(custom_id, url, body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def read_records(path):
    return [json.loads(text) for text in path.read_text().splitlines()]


def assert_same(a, b, path="body"):
    """Equal, except floats (logprobs) within 1e-4: batch composition moves the last digits."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-4), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path
