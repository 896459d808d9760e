"""The shape of the shared decoder a model runs as: what each family sets
(jaxinfer.models.families reads it from a config.json or a GGUF file)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """How a token's experts and their weights are chosen (jaxinfer.layers.moe.routing): the
    union of what Mixtral, Qwen-MoE, OLMoE and DeepSeek-V3 and V4 do."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax", "sigmoid" or "sqrtsoftplus" of the router logits
    renormalize: bool = False  # the top-k weights divided by their sum (norm_topk_prob)
    scaling_factor: float = 1.0  # routed_scaling_factor, applied after renormalizing
    correction_bias: bool = False  # e_score_correction_bias: added for the choice only
    num_groups: int = 1  # grouped top-k: experts in n_group groups ...
    topk_groups: int = 1  # ... of which the topk_group best (by their top-2 sum) are eligible

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid", "sqrtsoftplus"):
            raise ValueError(
                f"router scoring must be softmax, sigmoid or sqrtsoftplus, got {self.scoring!r}"
            )
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, {self.num_experts}]")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"{self.num_experts} experts cannot form {self.num_groups} groups of which "
                f"{self.topk_groups} are chosen"
            )


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts FFN in every layer: routed experts, and optionally a shared
    expert beside them (the dense FFN of intermediate_size, gated by a sigmoid in Qwen2-MoE)."""

    router: RouterConfig
    intermediate_size: int  # each routed expert's
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False
    # The gated FFNs' (routed and shared) gate clamped to <= limit and up to [-limit, limit]
    # before the product (DeepSeek-V4's swiglu_limit); None: no clamp.
    swiglu_limit: float | None = None

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k


# quantization_config methods whose checkpoints load as they are (4-bit weights in groups).
CHECKPOINT_QUANTIZATIONS = ("awq", "gptq")


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint saved with 4-bit weights (config.json's quantization_config), loaded as
    jaxinfer.layers.weights.Int4 (jaxinfer.model_loader.quantized_checkpoint)."""

    method: str  # "awq" or "gptq"
    group_size: int
    # GPTQ's checkpoint_format "gptq" (v1) stores each zero point minus one; "gptq_v2" does not.
    zeros_minus_one: bool = False

    def __str__(self) -> str:
        return f"{self.method} int4 (groups of {self.group_size})"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (`rope_scaling.rope_type == "llama3"`), linear scaling,
    or YaRN (interpolated frequencies blended into extrapolated ones between beta_slow and
    beta_fast rotations; cos and sin times attention_factor)."""

    rope_type: str  # "llama3", "linear" or "yarn"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # (yarn)
    beta_slow: float = 1.0
    attention_factor: float = 1.0


LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class LinearAttentionShape:
    """A Gated DeltaNet layer's heads (jaxinfer.layers.gated_deltanet): key heads Hk of Dk,
    value heads Hv of Dv (each key head serves Hv / Hk of them), the causal convolution's
    width K."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    rms_norm_eps: float

    @property
    def conv_channels(self) -> int:
        """C: the convolution's channels (q, k and v)."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclasses.dataclass(frozen=True)
class HybridLayers:
    """Gated DeltaNet (linear-attention) layers beside gated full-attention layers (Qwen3.5,
    Qwen3-Next; jaxinfer.models.qwen3_5). layer_types repeats a period (three linear, one
    full); the full layers' q_proj gives each head's output gate too, and RoPE turns the first
    rotary_dim dims of each head."""

    layer_types: tuple[str, ...]
    linear: LinearAttentionShape
    rotary_dim: int
    # The checkpoint's input projections of the linear layers: Qwen3.5's in_proj_qkv/z/b/a,
    # or Qwen3-Next's "interleaved" in_proj_qkvz/ba (read into one layout either way)
    projections: str = "split"

    def __post_init__(self):
        if set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}:
            raise ValueError(f"layer_types {sorted(set(self.layer_types))} are not all of "
                             f"{LINEAR_ATTENTION, FULL_ATTENTION}")  # fmt: skip
        if self.projections not in ("split", "interleaved"):
            raise ValueError(f"projections must be split or interleaved: {self.projections!r}")
        if self.linear.num_v_heads % self.linear.num_k_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")

    @property
    def period(self) -> tuple[str, ...]:
        """The layer kinds of the shortest period layer_types repeats (the scan runs period
        by period; all of them when none is shorter)."""
        types = self.layer_types
        for size in range(1, len(types) + 1):
            if len(types) % size == 0 and types == types[:size] * (len(types) // size):
                return types[:size]
        raise AssertionError("unreachable: the whole list is a period of itself")

    def count(self, kind: str) -> int:
        return sum(t == kind for t in self.layer_types)


SLIDING_ATTENTION = "sliding_attention"
COMPRESSED_SPARSE_ATTENTION = "compressed_sparse_attention"
HEAVILY_COMPRESSED_ATTENTION = "heavily_compressed_attention"
COMPRESSED_KINDS = (COMPRESSED_SPARSE_ATTENTION, HEAVILY_COMPRESSED_ATTENTION)
HASH_MOE = "hash_moe"


@dataclasses.dataclass(frozen=True)
class CompressedLayers:
    """DeepSeek-V4's decoder (jaxinfer.models.deepseek_v4): shared-KV attention (one K=V head)
    over a sliding window in every layer, beside compressed entries in the compressed
    layers, one per `ratios[kind]` tokens (all of them: HCA; the Lightning Indexer's top-k:
    CSA); a low-rank query path and a grouped low-rank output projection; `hc_mult` residual
    streams (hyper-connections); hash-routed MoE layers first."""

    layer_types: tuple[str, ...]  # sliding / compressed sparse / heavily compressed attention
    mlp_layer_types: tuple[str, ...]  # "hash_moe" (experts by token id) or "moe"
    ratios: tuple[tuple[str, int], ...]  # (kind, tokens per compressed entry)
    rotary_dim: int  # RoPE on each head's trailing rotary_dim dims, interleaved pairs
    compress_rope_theta: float  # the compressed layers' RoPE base (sliding ones: rope_theta)
    q_lora_rank: int
    o_groups: int  # the output projection's head groups ...
    o_lora_rank: int  # ... each projected to this rank first
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int  # residual streams
    hc_sinkhorn_iters: int
    hc_eps: float
    compress_rope_scaling: RopeScaling | None = None  # the compressed layers' (YaRN)

    def __post_init__(self):
        kinds = (SLIDING_ATTENTION, *COMPRESSED_KINDS)
        if set(self.layer_types) - set(kinds):
            raise ValueError(f"layer_types {sorted(set(self.layer_types))} are not all of {kinds}")
        if set(self.mlp_layer_types) - {HASH_MOE, "moe"}:
            raise ValueError(f"mlp_layer_types {sorted(set(self.mlp_layer_types))} are not all "
                             "of hash_moe, moe")  # fmt: skip
        if len(self.mlp_layer_types) != len(self.layer_types):
            raise ValueError("mlp_layer_types and layer_types differ in length")

    def ratio(self, kind: str) -> int:
        return dict(self.ratios)[kind]

    def count(self, kind: str) -> int:
        return sum(t == kind for t in self.layer_types)

    def index(self, layer: int) -> int:
        """The layer's index among the layers of its kind."""
        return self.layer_types[:layer].count(self.layer_types[layer])


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture hyper-parameters; names follow Hugging Face's LlamaConfig."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # QKV bias (Qwen2 always has one)
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: over each "head", or "all"
    clip_qkv: float | None = None  # q, k and v clipped to [-c, c] (OLMoE)
    sliding_window: int | None = None  # each token sees itself and the W - 1 tokens before
    # Which layers slide (Gemma 3's local layers; the others see every token); None: all of
    # them when sliding_window is set.
    sliding_layers: tuple[bool, ...] | None = None
    rope_local_theta: float | None = None  # the sliding layers' own RoPE base (Gemma 3)
    moe: MoeConfig | None = None  # every layer's FFN is a mixture of experts
    quantization: CheckpointQuantization | None = None  # saved with 4-bit weights (AWQ, GPTQ)
    hidden_act: str = "silu"  # the FFN's gate: "silu" or "gelu_tanh" (Gemma)
    embedding_scale: float | None = None  # the embeddings times this (Gemma: sqrt(E))
    attention_scale: float | None = None  # q.k scale; None: head_dim ** -0.5
    # Gemma's four norms per layer: an RMSNorm of the attention's and of the FFN's output
    # before each is added to the residual stream (beside the two before them).
    sandwich_norms: bool = False
    # Every RMSNorm multiplies by (norm_offset + w), w as checkpoints store it (Gemma: 1);
    # the loader adds it, so the model's norms multiply by their weights alone.
    norm_offset: float = 0.0
    # Linear-attention layers beside the attention layers (a hybrid model); None: attention
    # in every layer.
    hybrid: HybridLayers | None = None
    # DeepSeek-V4's compressed attention, hyper-connections and MoE; None: another family.
    compressed: CompressedLayers | None = None

    @property
    def num_kv_layers(self) -> int:
        """Layers with K/V in the paged cache (a hybrid's full-attention layers)."""
        if self.hybrid is None:
            return self.num_hidden_layers
        return self.hybrid.count(FULL_ATTENTION)

    @property
    def dense_intermediate_size(self) -> int:
        """The dense FFN's width (a MoE model's shared expert, 0 without one)."""
        if self.moe is None:
            return self.intermediate_size
        return self.moe.shared_intermediate_size

    def __post_init__(self):
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act {self.hidden_act!r} must be silu or gelu_tanh")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_hidden_layers:
            raise ValueError(
                f"{len(self.sliding_layers)} layer types for {self.num_hidden_layers} layers"
            )
        if self.hybrid is not None and len(self.hybrid.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"{len(self.hybrid.layer_types)} layer types for {self.num_hidden_layers} layers"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE turns (a hybrid's partial rotary, else all)."""
        return self.head_dim if self.hybrid is None else self.hybrid.rotary_dim

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale
