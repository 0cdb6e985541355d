"""A Llama-family decoder whose attention reads and writes K/V through page tables (DESIGN §8).

Covers Llama, Mistral, Qwen2-style and SmolLM2 checkpoints: token embedding, RMSNorm, rotary
position embeddings (the checkpoint's ``rope_theta`` and scaling), grouped-query attention,
SwiGLU MLP, tied or untied output head. The module holds **weights only**; the K/V lives in a
page-major pool ``[num_pages, num_layers, 2 (K,V), page_size, num_kv_heads, head_dim]`` that the
caller owns (normally the sidecar's shared memory) and passes to every forward.

Addressing: the pool is viewed flat as token rows ``[num_pages * num_layers * 2 * page_size,
num_kv_heads, head_dim]``; token position ``pos`` of a sequence with page table ``table`` has
K of layer ``l`` at row ``((table[pos // page_size] * L + l) * 2 + 0) * page_size + pos %
page_size`` and V ``page_size`` rows further. :class:`deltakv.services.model.runner.ModelRunner` turns
page tables into those row indices (validating them first); this module trusts them.

The module keeps no mutable state, so concurrent forwards on disjoint pages are safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deltakv.errors import InvalidArgument

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
    w_qkv: torch.Tensor             # [(H + 2*Hkv) * D, hidden], q rows then k then v
    b_qkv: torch.Tensor | None      # [(H + 2*Hkv) * D]
    w_o: torch.Tensor               # [hidden, H * D]
    b_o: torch.Tensor | None
    post_norm: torch.Tensor         # [hidden]
    w_gate_up: torch.Tensor         # [2 * intermediate, hidden], gate rows then up
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor            # [hidden, intermediate]
    b_down: torch.Tensor | None


class PagedLlama:
    """Weights of a Llama-family decoder plus the paged forward passes.

    Built with :meth:`from_transformers`. Weights are fused where that saves matmuls (q/k/v in
    one projection, gate/up in one) and stay read-only; the object can be shared by threads.
    ``dtype`` is the compute dtype (float32 by default); the KV pool may hold another dtype
    (e.g. bfloat16 KV with float32 compute), converted on write and read.
    """

    def __init__(self, spec: LlamaSpec, embed: torch.Tensor, layers: list[_Layer],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, inv_freq: torch.Tensor,
                 rope_scaling: float) -> None:
        self.spec = spec
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        # Matrix-vector products with the vocabulary-sized head run ~2x faster on CPU BLAS with
        # the [hidden, vocab] layout; products with several rows prefer [vocab, hidden]. The
        # head is the largest matrix of small models, so both layouts are kept (one extra copy).
        self.lm_head_t = lm_head.t().contiguous()
        self.inv_freq = inv_freq
        self.rope_scaling = rope_scaling
        self.dtype = embed.dtype
        self.device = embed.device
        self._act = _ACTIVATIONS[spec.hidden_act]
        self._scale = spec.head_dim ** -0.5

    @classmethod
    def from_transformers(cls, hf_model: Any) -> PagedLlama:
        """Take the weights of a transformers ``*ForCausalLM`` (Llama/Mistral/Qwen2 layout).

        Embedding, norms and output head are shared with ``hf_model`` (no copy); q/k/v and
        gate/up are concatenated into new tensors and the output head gets a transposed copy. Raises :class:`InvalidArgument`
        (INVALID_ARGUMENT) for an unsupported architecture.
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
            return torch.cat([p if p is not None else torch.zeros(lin.out_features,
                                                                  dtype=lin.weight.dtype)
                              for p, lin in zip(parts, linears, strict=True)])

        layers = []
        for block in base.layers:
            attn, mlp = block.self_attn, block.mlp
            layers.append(_Layer(
                input_norm=block.input_layernorm.weight.detach(),
                w_qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                 attn.v_proj.weight]).detach().contiguous(),
                b_qkv=cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                w_o=attn.o_proj.weight.detach(),
                b_o=bias(attn.o_proj),
                post_norm=block.post_attention_layernorm.weight.detach(),
                w_gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
                .contiguous(),
                b_gate_up=cat_bias(mlp.gate_proj, mlp.up_proj),
                w_down=mlp.down_proj.weight.detach(),
                b_down=bias(mlp.down_proj),
            ))
        inv_freq, scaling = rope_inv_freq(config, spec)
        return cls(spec, base.embed_tokens.weight.detach(), layers, base.norm.weight.detach(),
                   hf_model.lm_head.weight.detach(), inv_freq.to(base.embed_tokens.weight.device),
                   scaling)

    # ---- building blocks -------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm: normalise in float32, scale in dtype.
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
        qkv = F.linear(h, layer.w_qkv, layer.b_qkv)
        q_end = spec.num_heads * spec.head_dim
        k_end = q_end + spec.num_kv_heads * spec.head_dim
        q = qkv[:, :q_end].view(n, spec.num_heads, spec.head_dim)
        k = qkv[:, q_end:k_end].view(n, spec.num_kv_heads, spec.head_dim)
        v = qkv[:, k_end:].view(n, spec.num_kv_heads, spec.head_dim)
        return self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin), v

    def _mlp_block(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        h = self._rms_norm(x, layer.post_norm)
        gate, up = F.linear(h, layer.w_gate_up, layer.b_gate_up).chunk(2, dim=-1)
        return x + F.linear(self._act(gate) * up, layer.w_down, layer.b_down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[vocab]`` for hidden ``[hidden]``, ``[N, vocab]`` for ``[N, hidden]``."""
        h = self._rms_norm(x, self.final_norm)
        if h.dim() == 1:
            return (h[None] @ self.lm_head_t)[0].float()
        if h.shape[0] == 1:
            return (h @ self.lm_head_t).float()
        return (self.lm_head @ h.t()).t().float().contiguous()

    # ---- paged forwards ----------------------------------------------------------------------

    def prefill(self, pool: torch.Tensor, token_ids: torch.Tensor, start: int,
                write_rows: torch.Tensor | None, prefix_rows: torch.Tensor | None,
                all_logits: bool) -> torch.Tensor:
        """Forward one sequence's positions ``[start, start + T)`` over the paged pool.

        ``token_ids`` ``[T]`` int64. ``write_rows`` ``[T]``: token rows (see module doc, layer 0,
        K) where this call stores each new position's K/V, or ``None`` to store nothing (the
        positions' K/V is already in the pool). ``prefix_rows`` ``[start]``: token rows (layer 0,
        K) of positions ``[0, start)``, or ``None`` when ``start == 0``. Returns float32 logits
        ``[vocab]`` of the last position, or ``[T, vocab]`` with ``all_logits``. Writes only
        ``write_rows``; the pool stays owned by the caller.
        """
        spec = self.spec
        t = token_ids.shape[0]
        ps = pool.shape[3]
        layer_rows = 2 * ps  # rows from one layer's K to the next layer's K
        tok_view = pool.view(-1, spec.num_kv_heads, spec.head_dim)
        positions = torch.arange(start, start + t, device=self.device)
        cos, sin = self._rope(positions)
        mask = None
        kv_prefix_rows = None
        if prefix_rows is not None:
            mask = (torch.arange(start + t, device=self.device)[None, :]
                    <= positions[:, None])  # [T, start+T]: position i sees keys 0..start+i
            kv_prefix_rows = torch.cat((prefix_rows, prefix_rows + ps))  # K rows, then V rows
        gqa = spec.num_heads != spec.num_kv_heads
        x = F.embedding(token_ids, self.embed)
        for index, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.input_norm)
            q, k, v = self._qkv(layer, h, cos, sin)
            if write_rows is not None:
                tok_view.index_copy_(0, write_rows + index * layer_rows, k.to(pool.dtype))
                tok_view.index_copy_(0, write_rows + (index * layer_rows + ps), v.to(pool.dtype))
            keys, values = k, v  # [T, Hkv, D]
            if kv_prefix_rows is not None:
                past = tok_view.index_select(0, kv_prefix_rows + index * layer_rows)
                past = past.to(self.dtype).view(2, start, spec.num_kv_heads, spec.head_dim)
                keys = torch.cat((past[0], keys))
                values = torch.cat((past[1], values))
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                enable_gqa=gqa)
            attn = out[0].transpose(0, 1).reshape(t, spec.num_heads * spec.head_dim)
            x = x + F.linear(attn, layer.w_o, layer.b_o)
            x = self._mlp_block(layer, x)
        return self._logits(x if all_logits else x[-1])

    def decode(self, pool: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
               write_rows: torch.Tensor, context_rows: torch.Tensor,
               context_mask: torch.Tensor | None) -> torch.Tensor:
        """One decode step for ``B`` sequences of different lengths.

        ``token_ids`` ``[B]`` int64: each sequence's newest token, at position ``positions[b]``
        (tokens already cached). ``write_rows`` ``[B]``: token rows (layer 0, K) where its K/V is
        stored. ``context_rows`` ``[B, S]``: token rows (layer 0, K) of positions ``[0, S)``,
        ``S = max(positions) + 1``, padded past each sequence's own length; ``context_mask``
        ``[B, 1, 1, S]`` float, 0 where visible and -inf on padding (``None`` when nothing is
        padded). Returns float32 logits ``[B, vocab]``.
        """
        spec = self.spec
        b = token_ids.shape[0]
        s = context_rows.shape[-1]
        ps = pool.shape[3]
        layer_rows = 2 * ps
        group = spec.num_heads // spec.num_kv_heads
        tok_view = pool.view(-1, spec.num_kv_heads, spec.head_dim)
        cos, sin = self._rope(positions)
        # K rows then V rows of every context position: one gather per layer fetches both, in
        # whole-token rows (all KV heads of a position are contiguous in a page).
        kv_rows = torch.stack((context_rows, context_rows + ps)).view(-1)
        kv_shape = (2, b, s, spec.num_kv_heads, spec.head_dim)
        x = F.embedding(token_ids, self.embed)
        for index, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.input_norm)
            q, k, v = self._qkv(layer, h, cos, sin)
            # Store first, then read the whole context back: the new position is part of it.
            tok_view.index_copy_(0, write_rows + index * layer_rows, k.to(pool.dtype))
            tok_view.index_copy_(0, write_rows + (index * layer_rows + ps), v.to(pool.dtype))
            kv = tok_view.index_select(0, kv_rows + index * layer_rows).view(kv_shape)
            if kv.dtype != self.dtype:
                kv = kv.to(self.dtype)
            # Grouped-query attention without repeating K/V: the query heads that share a KV
            # head act as that head's query rows (no causal mask needed for one new token).
            # K/V stay token-major; the attention kernel reads them through strides.
            qg = q.view(b, spec.num_kv_heads, group, spec.head_dim)
            attn = F.scaled_dot_product_attention(qg, kv[0].transpose(1, 2),
                                                  kv[1].transpose(1, 2), attn_mask=context_mask)
            x = x + F.linear(attn.reshape(b, spec.num_heads * spec.head_dim), layer.w_o,
                             layer.b_o)
            x = self._mlp_block(layer, x)
        return self._logits(x)
