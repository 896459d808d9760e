"""The model's input: the fixed-shape, flattened batch of one step (built by the engine's
execution room, jaxinfer.engine.execution).

T: tokens in the step (padded to a bucket), R: requests (padded), MB: blocks per request,
P: sample rows (one per request, plus one per proposed token under speculative decoding).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchInputs:
    """Model inputs of one step; numpy on the host, jax.Array once placed on the device.

    Padding tokens have position 0 and write their K/V into the null block 0; padding requests
    have seq_len 0 and an empty query range, so they attend to nothing.
    """

    token_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T], each token's position in its sequence
    slot_mapping: np.ndarray  # i32[T], block * block_size + offset where each new K/V goes
    block_tables: np.ndarray  # i32[R, MB], each request's blocks in order
    seq_lens: np.ndarray  # i32[R], context length after this step's tokens
    query_start_loc: np.ndarray  # i32[R + 1], start of each request's tokens (cu_seqlens)
    logits_indices: np.ndarray  # i32[P], the token whose logits each sample row reads
    num_seqs: np.ndarray  # i32[1], requests that are real
    # i32[T], each token's LoRA adapter slot (-1: the base model); None: no adapters served
    lora_slots: np.ndarray | None = None
    # i32[R], each request's device row: a hybrid model's state slots (jaxinfer.layers
    # .state_cache); None: a model without recurrent state
    state_rows: np.ndarray | None = None
    # i32[1], the rows of logits_indices that are real (the rest padding); None: all
    num_samples: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]
