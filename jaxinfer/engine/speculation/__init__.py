"""Speculative decoding: n-gram proposals with each request's proposal length, the draft
model that proposes with a smaller model, and each step's proposals."""
