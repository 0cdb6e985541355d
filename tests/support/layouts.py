"""KV geometries used by the tests."""

from __future__ import annotations

from deltakv.layout import KVLayout

#: The toy geometry T of shared/scenarios.md: 2 layers, 2 KV heads, head_dim 64, float32,
#: 16-token pages -> page_bytes = 2 * 2 * 16 * 2 * 64 * 4 = 32,768; 64 pages.
TOY_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32",
                      page_size=16, num_pages=64, model_fingerprint="toy")
