"""A Llama-family decoder whose attention reads and writes K/V through page tables (DESIGN §8).

Covers Llama, Mistral, Qwen2-style and SmolLM2 checkpoints: token embedding, RMSNorm, rotary
position embeddings (the checkpoint's ``rope_theta`` and scaling), grouped-query attention,
SwiGLU MLP, tied or untied output head. The module holds **weights only**; the K/V lives in a
page-major pool ``[num_pages, num_layers, 2 (K,V), page_size, num_kv_heads, head_dim]`` that the
caller owns (normally the sidecar's shared memory) and passes to every forward.

Attention reads the context where it lies in the pool (:mod:`deltakv.services.model.attention`:
consecutive page runs as views, a gather buffer for the rest); :class:`deltakv.services.model.runner.ModelRunner`
validates page tables and plans those reads; this module trusts them.

The module keeps no mutable state, so concurrent forwards on disjoint pages are safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deltakv.errors import InvalidArgument
from deltakv.services.model.attention import ContextReader, PagedKV
from deltakv.services.model.linear import Linear, make_linear

# Model types whose transformers implementation is exactly the architecture below.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE variants whose frequencies do not depend on the sequence length at run time.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu}


@dataclass(frozen=True)
class LlamaSpec:
    """Architecture constants of one checkpoint, read from its transformers config.

    Sizes are element counts; ``max_position`` is the longest sequence (tokens) the checkpoint
    supports; ``sliding_window`` is ``None`` when attention is global.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    hidden_act: str
    rope_type: str

    @classmethod
    def from_config(cls, config: Any) -> LlamaSpec:
        """Read a transformers config. Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for
        architectures or RoPE variants this runner does not implement."""
        model_type = getattr(config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidArgument(f"unsupported model type {model_type!r}; the paged runner "
                                  f"implements {', '.join(SUPPORTED_MODEL_TYPES)}")
        rope = rope_parameters(config)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise InvalidArgument(f"unsupported RoPE scaling {rope_type!r}; supported: "
                                  f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        act = getattr(config, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise InvalidArgument(f"unsupported MLP activation {act!r}")
        window = getattr(config, "sliding_window", None)
        use_window = getattr(config, "use_sliding_window", window is not None)
        max_position = int(config.max_position_embeddings)
        if window is not None and use_window and window < max_position:
            raise InvalidArgument(f"sliding-window attention (window {window} < "
                                  f"{max_position} positions) is not implemented")
        num_heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv_heads:
            raise InvalidArgument(f"num_attention_heads {num_heads} is not a multiple of "
                                  f"num_key_value_heads {num_kv_heads}")
        # Qwen2 has q/k/v biases without an `attention_bias` field.
        attention_bias = bool(getattr(config, "attention_bias", model_type == "qwen2"))
        return cls(
            model_type=model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(config.rms_norm_eps),
            max_position=max_position,
            attention_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            hidden_act=act,
            rope_type=rope_type,
        )


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of a config (``rope_theta``, ``rope_type`` and scaling fields), from
    transformers 5's ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    merged: dict[str, Any] = {"rope_theta": getattr(config, "rope_theta", 10000.0)}
    scaling = getattr(config, "rope_scaling", None)
    if scaling:
        merged.update(scaling)
    merged.setdefault("rope_type", merged.get("type", "default"))
    return merged


def rope_inv_freq(config: Any, spec: LlamaSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float32) and the cos/sin scale factor, computed by
    transformers' own RoPE initialisers so every scaling variant matches the reference."""
    if spec.rope_type == "default":
        base = float(rope_parameters(config)["rope_theta"])
        exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.float) / spec.head_dim
        return 1.0 / (base ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[spec.rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor        # [hidden]
    qkv: Linear                     # hidden -> (H + 2*Hkv) * D, q rows then k then v
    o: Linear                       # H * D -> hidden
    post_norm: torch.Tensor         # [hidden]
    gate_up: Linear                 # hidden -> 2 * intermediate, gate rows then up
    down: Linear                    # intermediate -> hidden


class PagedLlama:
    """Weights of a Llama-family decoder plus the paged forward passes.

    Built with :meth:`from_transformers`. Weights are fused where that saves matmuls (q/k/v in
    one projection, gate/up in one), packed for the linear kernel once
    (:mod:`deltakv.services.model.linear`) and stay read-only; the object can be shared by
    threads.
    ``dtype`` is the compute dtype (float32 by default); the KV pool may hold another dtype
    (e.g. bfloat16 KV with float32 compute), converted on write and read.
    """

    def __init__(self, spec: LlamaSpec, embed: torch.Tensor, layers: list[_Layer],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, inv_freq: torch.Tensor,
                 rope_scaling: float, linear_backend: str | None = None) -> None:
        self.spec = spec
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        # The vocabulary-sized head is kept once, as [hidden, vocab]: matrix-vector products
        # with it run ~2x faster on CPU BLAS than with oneDNN's packed head (4.9 ms vs 8.3 ms on
        # SmolLM2) and several rows within noise of it (8 rows: 35.7 ms vs 34.3 ms, one thread,
        # load ~6 on 2 cores). A tied head still costs this one copy beside the embedding.
        self.lm_head_t = lm_head.t().contiguous()
        self.inv_freq = inv_freq
        self.rope_scaling = rope_scaling
        self.dtype = embed.dtype
        self.device = embed.device
        self._act = _ACTIVATIONS[spec.hidden_act]

    @classmethod
    def from_transformers(cls, hf_model: Any, linear_backend: str | None = None) -> PagedLlama:
        """Take the weights of a transformers ``*ForCausalLM`` (Llama/Mistral/Qwen2 layout).

        Embedding and norms are shared with ``hf_model`` (no copy); q/k/v and gate/up are
        concatenated, every projection and the output head packed for the linear kernel
        (``linear_backend``: a :data:`deltakv.services.model.linear.BACKENDS` name, or the
        first that fits), and the output head gets a transposed copy. Raises
        :class:`InvalidArgument` (INVALID_ARGUMENT) for an unsupported architecture.
        """
        config = hf_model.config
        spec = LlamaSpec.from_config(config)
        base = hf_model.model

        def bias(linear: Any) -> torch.Tensor | None:
            return None if linear.bias is None else linear.bias.detach()

        def cat_bias(*linears: Any) -> torch.Tensor | None:
            parts = [bias(lin) for lin in linears]
            if all(p is None for p in parts):
                return None
            return torch.cat([p if p is not None else torch.zeros(
                lin.out_features, dtype=lin.weight.dtype, device=lin.weight.device)
                              for p, lin in zip(parts, linears, strict=True)])

        def linear(*linears: Any) -> Linear:
            weight = torch.cat([lin.weight for lin in linears]).detach().contiguous()
            return make_linear(weight, cat_bias(*linears), linear_backend)

        layers = []
        for block in base.layers:
            attn, mlp = block.self_attn, block.mlp
            layers.append(_Layer(
                input_norm=block.input_layernorm.weight.detach(),
                qkv=linear(attn.q_proj, attn.k_proj, attn.v_proj),
                o=linear(attn.o_proj),
                post_norm=block.post_attention_layernorm.weight.detach(),
                gate_up=linear(mlp.gate_proj, mlp.up_proj),
                down=linear(mlp.down_proj),
            ))
        inv_freq, scaling = rope_inv_freq(config, spec)
        return cls(spec, base.embed_tokens.weight.detach(), layers, base.norm.weight.detach(),
                   hf_model.lm_head.weight.detach(), inv_freq.to(base.embed_tokens.weight.device),
                   scaling, linear_backend)

    # ---- building blocks -------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm: normalise in float32, scale in dtype.
        if x.dtype == torch.float32:
            # One fused op (x * rsqrt(mean(x^2) + eps) * weight), equal to the chain below in
            # float32; measured 12 us vs 31 us for [8, 576] at two threads, 61 calls a forward.
            return F.rms_norm(x, weight.shape, weight, self.spec.rms_norm_eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[N, 1, head_dim]`` for positions ``[N]`` (broadcast over heads)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)
        return cos[:, None, :], sin[:, None, :]

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[N, H, D]``, k and v ``[N, Hkv, D]`` with RoPE applied, for hidden ``[N, hidden]``."""
        spec = self.spec
        n = h.shape[0]
        qkv = layer.qkv(h)
        k_end = (spec.num_heads + spec.num_kv_heads) * spec.head_dim
        # q and k heads are adjacent in the fused projection: one RoPE over both (half the
        # small ops per layer; the same arithmetic per element as two calls).
        qk = self._apply_rope(qkv[:, :k_end].view(n, spec.num_heads + spec.num_kv_heads,
                                                  spec.head_dim), cos, sin)
        v = qkv[:, k_end:].view(n, spec.num_kv_heads, spec.head_dim)
        return qk[:, :spec.num_heads], qk[:, spec.num_heads:], v

    def _mlp_block(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        h = self._rms_norm(x, layer.post_norm)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        return x + layer.down(self._act(gate) * up)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[vocab]`` for hidden ``[hidden]``, ``[N, vocab]`` for ``[N, hidden]``."""
        h = self._rms_norm(x, self.final_norm)
        if h.dim() == 1:
            return (h[None] @ self.lm_head_t)[0].float()
        return (h @ self.lm_head_t).float()

    # ---- paged forwards ----------------------------------------------------------------------

    def _store(self, kv: PagedKV, layer: int, write_rows: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """Write K/V ``[N, Hkv, D]`` of N positions at token ``write_rows`` (layer 0, K) of
        ``layer``, converted to the pool's dtype."""
        base = write_rows + layer * kv.layer_rows
        kv.rows.index_copy_(0, base, k.to(kv.pool.dtype))
        kv.rows.index_copy_(0, base + kv.page_size, v.to(kv.pool.dtype))

    def prefill(self, kv: PagedKV, reader: ContextReader, token_ids: torch.Tensor, start: int,
                write_rows: torch.Tensor | None, all_logits: bool) -> torch.Tensor:
        """Forward one sequence's positions ``[start, start + T)`` over the paged pool.

        ``token_ids`` ``[T]`` int64. ``reader``: the plan of the prefix ``[0, start)`` (one
        sequence, empty when ``start == 0``). ``write_rows`` ``[T]``: token rows (layer 0, K)
        where this call stores each new position's K/V, or ``None`` to store nothing (the
        positions' K/V is already in the pool). The new positions attend to each other from
        their freshly computed K/V (causal), to the prefix from the pool. Returns float32 logits
        ``[vocab]`` of the last position, or ``[T, vocab]`` with ``all_logits``. Writes only
        ``write_rows``; the pool stays owned by the caller.
        """
        spec = self.spec
        t = token_ids.shape[0]
        positions = torch.arange(start, start + t, device=self.device)
        cos, sin = self._rope(positions)
        x = F.embedding(token_ids, self.embed)
        for index, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.input_norm)
            q, k, v = self._qkv(layer, h, cos, sin)
            if write_rows is not None:
                self._store(kv, index, write_rows, k, v)
            attn = reader.attend(index, q.transpose(0, 1).contiguous()[None],
                                 k.transpose(0, 1)[None], v.transpose(0, 1)[None])
            attn = attn[0].transpose(0, 1).reshape(t, spec.num_heads * spec.head_dim)
            x = x + layer.o(attn)
            x = self._mlp_block(layer, x)
        return self._logits(x if all_logits else x[-1])

    def decode(self, kv: PagedKV, reader: ContextReader, token_ids: torch.Tensor,
               positions: torch.Tensor, write_rows: torch.Tensor) -> torch.Tensor:
        """One decode step for ``B`` sequences of different lengths.

        ``token_ids`` ``[B]`` int64: each sequence's newest token, at position ``positions[b]``
        (tokens already cached). ``write_rows`` ``[B]``: token rows (layer 0, K) where its K/V is
        stored. ``reader``: the plans of each sequence's keys ``[0, positions[b]]``, the new
        position included (it is stored before attention reads the pool). Returns float32
        logits ``[B, vocab]``.
        """
        spec = self.spec
        b = token_ids.shape[0]
        cos, sin = self._rope(positions)
        x = F.embedding(token_ids, self.embed)
        for index, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.input_norm)
            q, k, v = self._qkv(layer, h, cos, sin)
            self._store(kv, index, write_rows, k, v)
            attn = reader.attend(index, q.contiguous()[:, :, None])  # one query: no mask
            x = x + layer.o(attn.reshape(b, spec.num_heads * spec.head_dim))
            x = self._mlp_block(layer, x)
        return self._logits(x)
