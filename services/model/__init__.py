"""The paged model runner (DESIGN §8).

* :mod:`deltakv.services.model.loader` — model names -> weights, tokenizer, KV geometry, fingerprint;
* :mod:`deltakv.services.model.llama` — the Llama-family decoder over a page-major KV pool;
* :mod:`deltakv.services.model.runner` — validated prefill / batched decode on a pool the caller owns;
* :mod:`deltakv.services.model.tokenizer` — chat templates, incremental detokenization;
* :mod:`deltakv.services.model.sampling` — sampling and stop rules.

Submodules import torch/transformers; this package itself imports nothing heavy.
"""
