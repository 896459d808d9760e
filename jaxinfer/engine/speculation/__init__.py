"""Speculative decoding: n-gram proposals with each request's proposal length, and the draft
model that proposes with a smaller model."""
