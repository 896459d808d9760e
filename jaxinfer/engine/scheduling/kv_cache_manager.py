"""Gives requests the KV-cache blocks their tokens need, on demand, and finds cached prefixes.

Full blocks are identified by a chained SHA-256: hash(parent block's hash, the block's token
ids, extra keys), the extra keys (a per-request cache_salt, the LoRA adapter) folded into the
first block, so tenants with different salts, or adapters, never share blocks.

With a sliding window (the model attends to the last W positions only), a running request's
blocks that lie wholly before every position it will still attend to go back to the pool: its
block list keeps the null block in their place, so positions still index it. A freed block
keeps its hash, so it stays a prefix-cache hit until evicted; a hit is a chain from the first
block, so a prefix whose early blocks were evicted is recomputed from there, never read wrong.

The model's layer groups declare what they keep (jaxinfer.config.cache_specs): attention
groups K/V in the shared blocks; a hybrid model's linear-attention layers, per running
request, a recurrent-state slot (the short convolution's and the delta rule's states)
instead: the manager holds one for each request it gives blocks to, up to `state_slots`, and
frees it with them (the device slot is the request's row, jaxinfer.layers.state_cache). With prefix caching, their
states at block boundaries are kept too, for prefix hits (state_checkpoints). DeepSeek-V4's
compressed kinds keep one entry per `ratio` tokens in blocks from a pool of their own, given
with the request's KV blocks (all or none) and freed with them. Usage is reported per kind.
"""

from __future__ import annotations

import hashlib

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.config.cache_specs import (
    AttentionSpec,
    CacheSpec,
    StateSpec,
    compressed_specs_of,
    released_window,
)
from jaxinfer.engine.scheduling.block_pool import NULL_BLOCK, BlockPool
from jaxinfer.engine.scheduling.request import Request
from jaxinfer.engine.scheduling.state_checkpoints import StateCheckpoints

_ROOT = b"\x00" * 32


def hash_block(parent: bytes | None, token_ids, extra: bytes = b"") -> bytes:
    digest = hashlib.sha256(parent or _ROOT)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    digest.update(len(extra).to_bytes(4, "little") + extra)
    return digest.digest()


def first_block_extra(request: Request) -> bytes:
    """What a request's first block hash holds besides its tokens: its cache_salt and LoRA
    adapter (K/V computed with one adapter are never another's, or the base model's)."""
    extra = request.cache_salt.encode() if request.cache_salt else b""
    if request.lora is not None:
        extra += b"\x00lora:%d" % request.lora.key
    return extra


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        specs: tuple[CacheSpec, ...] = (AttentionSpec(()),),
        state_slots: int = 0,
        state_checkpoints: int = 0,
        entry_blocks: tuple[tuple[str, int], ...] = (),
    ):
        """specs: what each group of the model's layers keeps per request
        (jaxinfer.config.cache_specs). The attention groups share the block pool: blocks
        behind a sliding window that every group has go back to it. A recurrent-state group
        holds one of `state_slots` per running request, and checkpoints of it at block
        boundaries in `state_checkpoints` more (with prefix caching). A compressed group's
        entries come from a pool of its own (`entry_blocks`: blocks per store)."""
        if any(isinstance(s, StateSpec) for s in specs) != bool(state_slots):
            raise ValueError("state_slots go with a recurrent-state layer group, and only then")
        self.specs = specs
        self.block_size = block_size
        self.state_slots = state_slots
        self._state_holders: set[str] = set()  # ids of requests holding a state slot
        self.pool = BlockPool(num_blocks)
        self.checkpoints = None
        if state_checkpoints and enable_prefix_caching:
            self.checkpoints = StateCheckpoints(state_checkpoints)
            self.pool.on_evict = self.checkpoints.drop
        self.enable_prefix_caching = enable_prefix_caching
        sizes = dict(entry_blocks)
        self.compressed = compressed_specs_of(specs)
        if {s.key for s in self.compressed} != set(sizes):
            raise ValueError("entry_blocks go with the compressed layer groups, one pool each")
        if self.compressed and enable_prefix_caching:
            raise ValueError("prefix caching is not supported with compressed entries")
        self.entry_pools = {s.key: BlockPool(sizes[s.key]) for s in self.compressed}
        self.sliding_window = released_window(specs)  # (None: blocks held to the end)
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found in the cache

    @classmethod
    def for_engine(cls, config: EngineConfig) -> KVCacheManager:
        """The manager of an engine's cache: a state slot per running request for a model
        with recurrent-state layers."""
        cache = config.cache
        has_states = any(isinstance(s, StateSpec) for s in cache.layer_specs)
        return cls(
            cache.block_size,
            cache.num_blocks,
            cache.enable_prefix_caching,
            cache.layer_specs,
            state_slots=config.scheduler.max_num_seqs if has_states else 0,
            state_checkpoints=cache.state_checkpoints,
            entry_blocks=cache.entry_blocks,
        )

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        """The most KV blocks a request of `num_tokens` holds at once: all of them, or with
        compressed entries (whose window's blocks go back as it slides; no prefix caching)
        its window's and a step's."""
        blocks = self.blocks_for(num_tokens)
        if not self.compressed or self.sliding_window is None:
            return blocks
        return min(blocks, self.blocks_for(self.sliding_window + step_tokens) + 1)

    def block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            extra = b"" if hashes else first_block_extra(request)
            hashes.append(
                hash_block(hashes[-1] if hashes else None, tokens[start : start + bs], extra)
            )
        return hashes

    def _may_hit(self, request: Request) -> bool:
        return not (
            not self.enable_prefix_caching
            or request.num_computed_tokens
            or request.sampling_params.prompt_logprobs is not None  # needs every position
            or (request.pooling is not None and request.pooling.pooling != "last")  # ditto
        )

    def _last_boundary(self, request: Request) -> int:
        """Full blocks a prefix hit may cover: the last token is always left to compute, since
        its logits are needed."""
        return (request.num_tokens - 1) // self.block_size

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of a request that has computed nothing yet. A hybrid
        model's hit ends where its states were checkpointed (request.state_restore is set to
        that checkpoint's slot)."""
        request.state_restore = -1
        if not self._may_hit(request):
            return []
        hashes = self.block_hashes(request)[: self._last_boundary(request)]
        hits = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.checkpoints is not None:
            while hits and (slot := self.checkpoints.find(hashes[len(hits) - 1])) is None:
                hits.pop()
            request.state_restore = slot if hits else -1
        return hits

    def align_chunk(self, request: Request, start: int, num_new: int) -> int:
        """A hybrid model's prompt step from token `start` cut to end at a block boundary
        where its states are checkpointed (state_checkpoints): where the blocks that other
        prompts hold too end (a shared system prompt: the prompts after this one hit up to
        there), at the last boundary a hit can use, or at the end of a chunk the budget cut
        short, rounded down. Decodes are unchanged."""
        if self.checkpoints is None or start >= request.num_prompt_tokens:
            return num_new
        bs, end = self.block_size, start + num_new
        last = self._last_boundary(request)
        hashes = self.block_hashes(request)
        shared = start // bs
        while shared < last and self.pool.lookup(hashes[shared]) is not None:
            shared += 1
        for cut in (shared * bs, last * bs):
            if start < cut < end:
                return cut - start
        if end < last * bs and end // bs * bs > start:
            return end // bs * bs - start
        return num_new

    def checkpoint_slot(self, request: Request, first: int, end: int) -> int:
        """The checkpoint slot a step over the request's prompt (from token `first` to `end`)
        writes its states to: -1 unless it ends at a block boundary of known tokens whose
        checkpoint is not there already."""
        if (
            self.checkpoints is None
            or end % self.block_size
            or first >= request.num_prompt_tokens
            or end > request.num_tokens
        ):
            return -1
        slot = self.checkpoints.reserve(self.block_hashes(request)[end // self.block_size - 1])
        return -1 if slot is None else slot

    def awaits_checkpoint(self, request: Request) -> bool:
        """Whether a waiting request's prompt ends (up to its last token) like that of a
        running request that will checkpoint its states there soon: the samples of an n > 1
        request, the same prompt sent twice. It then waits for the hit, not to recompute."""
        if self.checkpoints is None or not self._may_hit(request):
            return False
        last = self._last_boundary(request)
        if last == 0:
            return False
        producer = self.checkpoints.producer(self.block_hashes(request)[last - 1])
        return producer not in (None, request.request_id)

    def step_scheduled(self) -> None:
        """A new step is being scheduled: the checkpoints reserved by earlier steps are
        written before it runs."""
        if self.checkpoints is not None:
            self.checkpoints.written()

    def allocate_blocks(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()
    ) -> bool:
        """Grows the request's blocks to hold its computed tokens, `computed_blocks` (cache hits,
        which raise num_computed_tokens) and num_new_tokens. False if the pool cannot; nothing
        changes then (but blocks outside the sliding window are freed first)."""
        if self.sliding_window is not None and not computed_blocks:
            self.free_outside_window(request)
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = self.blocks_for(total + num_new_tokens)
        missing = needed - len(request.block_ids) - len(computed_blocks)
        # Hits nobody holds sit in the free queue: taking them shrinks what can be allocated.
        unheld_hits = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        if max(missing, 0) > self.pool.num_free_blocks - unheld_hits:
            return False
        entries_missing = {
            s.key: self.blocks_for((total + num_new_tokens) // s.ratio)
            - len(request.entry_block_ids.get(s.key, ()))
            for s in self.compressed
        }
        if any(n > self.entry_pools[k].num_free_blocks for k, n in entries_missing.items()):
            return False
        if self.state_slots and request.request_id not in self._state_holders:
            if len(self._state_holders) >= self.state_slots:
                return False
            self._state_holders.add(request.request_id)
            last = self._last_boundary(request)
            if self.checkpoints is not None and last > len(computed_blocks):
                block_hash = self.block_hashes(request)[last - 1]
                self.checkpoints.will_produce(block_hash, request.request_id)
        if computed_blocks:
            self.pool.touch(computed_blocks)
            request.block_ids.extend(computed_blocks)
            request.num_computed_tokens = total
        if missing > 0:
            request.block_ids.extend(self.pool.allocate(missing))
        for key, n in entries_missing.items():
            blocks = request.entry_block_ids.setdefault(key, [])
            if n > 0:
                blocks.extend(self.entry_pools[key].allocate(n))
        return True

    def free_outside_window(self, request: Request) -> int:
        """Frees the request's blocks that every position from its next token on cannot see
        (all of their positions < next - W + 1); returns how many. At scheduling, computed
        tokens never move back again (proposals are verified before the next step is
        scheduled). With prefix caching, only blocks already registered (findable)."""
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        dead = max(0, first_visible) // self.block_size
        if self.enable_prefix_caching:
            dead = min(dead, request.num_cached_blocks)
        blocks = [b for b in request.block_ids[:dead] if b != NULL_BLOCK]
        if blocks:
            self.pool.free(blocks)
            request.block_ids[:dead] = [NULL_BLOCK] * dead
        return len(blocks)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, request: Request, num_computed: int | None = None) -> None:
        """Makes the request's full blocks up to num_computed tokens (default: its computed
        tokens) findable by other requests. Only blocks whose tokens are all known count (not
        those holding an output placeholder). A block may be registered as soon as the step
        that writes it is scheduled: a request that hits it in the same step reads it after
        the write (each layer writes the step's K/V before attending), later ones after that
        step."""
        if not self.enable_prefix_caching:
            return
        computed = request.num_computed_tokens if num_computed is None else num_computed
        num_full = min(computed, request.num_tokens) // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        hashes = self.block_hashes(request)
        for index in range(request.num_cached_blocks, num_full):
            if request.block_ids[index] != NULL_BLOCK:  # (freed: registered before it was)
                self.pool.cache(request.block_ids[index], hashes[index])
        request.num_cached_blocks = num_full

    def usage(self) -> dict[str, float]:
        """The fraction of each kind of entry in use: "kv_blocks" (of the usable blocks), and
        "recurrent_states" (of the slots) for a hybrid model."""
        usage = {"kv_blocks": self.pool.usage}
        if self.state_slots:
            usage["recurrent_states"] = len(self._state_holders) / self.state_slots
        if self.checkpoints is not None:
            usage["state_checkpoints"] = self.checkpoints.usage
        for key, pool in self.entry_pools.items():
            usage[f"{key}_entry_blocks"] = pool.usage
        return usage

    def capacity(self) -> dict[str, int]:
        """Each kind's entries: usable KV blocks, and recurrent-state slots for a hybrid."""
        capacity = {"kv_blocks": self.pool.num_blocks - 1}  # (the null block is not usable)
        if self.state_slots:
            capacity["recurrent_states"] = self.state_slots
        if self.checkpoints is not None:
            capacity["state_checkpoints"] = self.checkpoints.num_slots
        for key, pool in self.entry_pools.items():
            capacity[f"{key}_entry_blocks"] = pool.num_blocks - 1
        return capacity

    def holds_state(self, request: Request) -> bool:
        return request.request_id in self._state_holders

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (and state checkpoint); only while no block is held."""
        if not self.pool.reset_cache():
            return False
        if self.checkpoints is not None:
            self.checkpoints.clear()
        return True

    def free(self, request: Request) -> None:
        self._state_holders.discard(request.request_id)
        if self.checkpoints is not None:
            self.checkpoints.forget_producer(request.request_id)
        self.pool.free([b for b in request.block_ids[::-1] if b != NULL_BLOCK])
        request.block_ids = []
        for key, blocks in request.entry_block_ids.items():
            self.entry_pools[key].free(blocks[::-1])
        request.entry_block_ids = {}
        request.num_cached_blocks = 0
