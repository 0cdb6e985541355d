"""The paged model runner (DESIGN §8).

* :mod:`services.model.loader` — model names -> weights, tokenizer, KV geometry, fingerprint;
* :mod:`services.model.llama` — the Llama-family decoder over a page-major KV pool;
* :mod:`services.model.runner` — validated prefill / batched decode on a pool the caller owns;
* :mod:`services.model.tokenizer` — chat templates, incremental detokenization;
* :mod:`services.model.sampling` — sampling and stop rules.

Submodules import torch/transformers; this package itself imports nothing heavy.
"""
