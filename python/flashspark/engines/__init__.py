"""Thin adapters that let an engine call flashspark's ops with its own conventions, with no
dependency on the engine: `vllm` (a RejectionSampler-shaped module). The FlashInfer and
SGLang adapters are to come."""
