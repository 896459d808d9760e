"""The reference of the C++ paged attention kernel (kernel.cc): the pure-JAX ragged paged
attention that the Pallas kernel is also checked against."""

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

__all__ = ["ragged_paged_attention_reference"]
