"""Decoding: plain autoregressive decoding, Philox sampling, and the speculative loop."""

from .loop import speculative_generate

__all__ = ["speculative_generate"]
