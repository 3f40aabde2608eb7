"""Thin adapters that let an engine call flashspark's ops with its own arguments and
conventions, with no dependency on the engine (its types are used when it is installed):

  * `vllm`: `RejectionSampler`, vLLM v1's rejection sampler in both its forms
    (`forward(metadata, draft_probs, logits, sampling_metadata)` and the older
    `forward(metadata, draft_probs, target_logits, bonus_token_ids, sampling_metadata)`);
  * `sglang`: `tree_speculative_sampling_target_only` and `verify_tree_greedy`, sgl-kernel's
    EAGLE tree verify (sampled and greedy), branching trees included;
  * `flashinfer`: `chain_speculative_sampling`, FlashInfer's chain speculative sampling with its
    counters added in place.

Each makes one `flashspark.verify` call (SGLang: one `flashspark.tree_verify` call), on logits
(vLLM) or on probabilities as the engine has them (SGLang, FlashInfer); its module doc lists what
differs from the engine's own."""
