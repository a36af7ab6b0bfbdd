"""What an engine is, in kvpool's terms, read from vLLM's real config and groups.

    engine_identity(vllm_config, kv_cache_config, chunk_size)
        -> EngineIdentity (``kvpool.connector.identity``): the Layout (sizes,
           KV groups and their kinds), the KeySpace (model + config
           fingerprint), block and chunk size, DP index; or UnsupportedEngine
           with the reason
    byte_fields(model_config, cache_config)  the settings beyond sizes and dtypes
                         that change KV bytes (HF config with overrides, weights,
                         quantisation, cache dtypes), for the fingerprint
    worker_rank(layout)  this worker's rank in the layout, from vLLM's process
                         groups (TP, PP, PCP, DCP); checks the group construction

The scheduler and every worker call ``engine_identity`` on the same config and
so agree on every key. DP identity is ``parallel_config.data_parallel_index``
(see ``kvpool.keys.dp_index_of``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from kvpool.connector.identity import EngineIdentity, chunk_tokens, settings_layout
from kvpool.errors import UnsupportedEngine
from kvpool.keys import KeySpace, dp_index_of
from kvpool.layout import GroupKind, GroupSpec, Layout, RankCoords

__all__ = [
    "EngineIdentity",
    "attention_isas",
    "byte_fields",
    "engine_identity",
    "layer_index",
    "pp_stages",
    "worker_rank",
]


def _group_spec(spec: Any, total_kv_heads: int) -> GroupSpec:
    """Map a vLLM KVCacheSpec to a kvpool group kind (by class, duck-typed).

    A full-attention spec that records a sliding window (vLLM's hybrid manager
    off) allocates every block, so it is pooled as full attention; a
    ``SlidingWindowSpec`` (hybrid manager on) keeps only the window's blocks."""
    names = {c.__name__ for c in type(spec).__mro__}
    if "MambaSpec" in names:
        # States exist at block boundaries only in vLLM's "align" mode (prefix
        # caching on); vLLM hands the connector each one (``boundary_state_offloads``).
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            raise UnsupportedEngine(
                f"Mamba / linear-attention state is pooled only with vLLM's prefix caching "
                f"on (mamba_cache_mode 'align'), this engine runs {mode!r}; the engine "
                "serves without kvpool"
            )
        if getattr(spec, "tp_replicated", False):
            raise UnsupportedEngine(
                f"{type(spec).__name__} with a state replicated over TP ranks is not pooled yet"
            )
        return GroupSpec(GroupKind.MAMBA)
    if "SlidingWindowSpec" in names:
        # A window of whole tokens that vLLM itself prefix-caches (not DeepSeek-V4's
        # bounded replay, nor states packing several tokens).
        if not getattr(spec, "prefix_cacheable", True) or getattr(spec, "tokens_per_state", 1) != 1:
            raise UnsupportedEngine(
                f"{type(spec).__name__} with bounded replay or several tokens per state "
                "is not pooled yet"
            )
        if "SlidingWindowMLASpec" in names:  # one latent per token, windowed
            return GroupSpec(GroupKind.MLA, 0, int(spec.sliding_window))
        return GroupSpec(GroupKind.GQA, total_kv_heads, int(spec.sliding_window))
    if "MLAAttentionSpec" in names:
        return GroupSpec(GroupKind.MLA)
    if "FullAttentionSpec" in names and not names & {"RSWASpec", "SinkFullAttentionSpec"}:
        return GroupSpec(GroupKind.GQA, total_kv_heads)
    raise UnsupportedEngine(
        f"KV cache group kind {type(spec).__name__} is not supported by kvpool yet "
        "(full attention, sliding window and MLA are)"
    )


def engine_identity(
    vllm_config: Any,
    kv_cache_config: Any,
    chunk_size: int = 0,
    layer_bands: Sequence[int] = (),
    heads_per_object: int = 1,
    token_classes: int = 0,
    tenant: str = "",
) -> EngineIdentity:
    """The engine's layout and key space; ``UnsupportedEngine`` if it cannot be pooled.
    ``layer_bands`` (the setting): the layers where a band begins; empty = where
    each PP stage begins; ``heads_per_object`` (the setting): KV heads per object;
    ``token_classes`` (the setting): DCP's token grid, 0 = the DCP size;
    ``tenant`` (the setting): the tenant whose space the keys are in."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    total_heads = int(model.get_total_num_kv_heads())
    groups = [_group_spec(g.kv_cache_spec, total_heads) for g in kv_cache_config.kv_cache_groups]
    if not groups:
        raise UnsupportedEngine("the model has no KV cache groups")
    device = _device_type()
    if device != "cpu":  # the copies are host memmoves (the worker refuses such tensors too)
        raise UnsupportedEngine(f"KV caches on {device}: kvpool moves host memory only so far")
    block_size = int(cache.block_size)
    for g in kv_cache_config.kv_cache_groups:
        if int(g.kv_cache_spec.block_size) != block_size:
            raise UnsupportedEngine(
                f"KV groups with block size {g.kv_cache_spec.block_size} != {block_size} "
                "are not supported yet"
            )
    # Under DCP a block-table entry (and one block hash) spans block_size x dcp
    # tokens; each DCP rank's physical block holds its token class of them
    # (vLLM's resolve_kv_cache_block_sizes). Chunks are counted in those tokens.
    block_size *= int(getattr(parallel, "decode_context_parallel_size", 1))
    chunk = chunk_tokens(chunk_size, block_size, groups)
    pp = int(parallel.pipeline_parallel_size)
    layers = int(model.get_total_num_hidden_layers())
    shape: dict[str, Any] = {
        "tp": int(parallel.tensor_parallel_size),
        "pp": pp,
        "layers": layers,
        "stages": pp_stages(layers, pp),
        "pcp": int(getattr(parallel, "prefill_context_parallel_size", 1)),
        "dcp": int(getattr(parallel, "decode_context_parallel_size", 1)),
        "groups": groups,
        "dp_index": dp_index_of(parallel),
        "interleave": int(getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1),
    }
    # the engine's own layout (LayoutError: unsupported), with the grid settings
    layout = settings_layout(shape, layer_bands, heads_per_object, token_classes)
    model_dtype = str(model.dtype).removeprefix("torch.")
    kv_dtype = str(cache.cache_dtype)
    if kv_dtype == "auto":
        kv_dtype = model_dtype
    space = KeySpace.create(
        model=str(model.model),
        layout=layout,
        kv_dtype=kv_dtype,
        model_dtype=model_dtype,
        chunk_size=chunk,
        head_size=int(model.get_head_size()),
        num_layers=layers,
        extra={
            # An object holds whole blocks in the kernel's byte order (the CPU kernel
            # stores K head_size-major per block), so engines at other block sizes
            # (x DCP) cannot share its bytes, though they name chunks alike.
            "block_size": block_size,
            "device": device,
            "kv_layout": _kv_layout(vllm_config, kv_cache_config),
            **byte_fields(model, cache),
        },
        tenant=tenant,
    )
    return EngineIdentity(layout, space, block_size, chunk, layout.dp_index)


def _kv_layout(vllm_config: Any, kv_cache_config: Any) -> str:
    """How the attention kernel lays out a block's bytes, where the sizes and
    dtypes leave it open: ``attention_isas`` joined. (Only host KV caches are
    pooled: ``engine_identity`` refuses the others first.)"""
    return "cpu/" + ",".join(attention_isas(vllm_config, kv_cache_config))


def attention_isas(vllm_config: Any, kv_cache_config: Any) -> list[str]:
    """Per KV group, the ISA vLLM's CPU attention kernel takes (its ``_get_attn_isa``):
    "vec" stores each block's K head_size-major, "amx" packs K and V in pairs, so a
    bf16 engine on a host with AMX and one without write the same KV in different
    byte orders and must never share objects; "amx" also needs AMX tile data
    (``kvpool.amx``). A Mamba group gets "mamba-" and a digest of its state shapes."""
    cache = vllm_config.cache_config
    dtype = vllm_config.model_config.dtype
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:  # pragma: no cover - another vLLM: name the host's features
        import torch

        return [f"amx={torch.cpu._is_amx_tile_supported()}"]
    isas = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        if "MambaSpec" in {c.__name__ for c in type(spec).__mro__}:
            # A state block is its tensors' bytes back to back (vLLM's own views).
            state = [str(spec.shapes), str(spec.dtypes), str(getattr(spec, "mamba_type", ""))]
            isas.append("mamba-" + _digest(state))
            continue
        head = getattr(spec, "head_size", None)
        try:
            isas.append(_get_attn_isa(dtype, int(spec.block_size), head, cache.cache_dtype))
        except NotImplementedError as exc:  # vLLM refuses the engine too
            raise UnsupportedEngine(f"vLLM's CPU attention: {exc}") from None
    return isas


# hf_config keys that never change KV bytes: the path (``model`` is fingerprinted),
# the library version, and output switches of transformers' forward.
_HF_IGNORED = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_cache",
    }
)


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def byte_fields(model: Any, cache: Any) -> dict[str, str]:
    """The engine settings beyond layout, dtypes and sizes that change KV bytes.

    The model's whole HF config (as vLLM resolved it, ``--hf-overrides`` applied:
    rope scaling, sliding windows, head counts ...), the weights (``model_weights``,
    revisions), quantisation, and the cache settings that change what a layer
    stores (KV dtype skips, Mamba state dtypes, KV layout, sliding window). Not
    vLLM's ``ModelConfig.compute_hash``: it ignores ``hf_overrides`` and covers
    fields that change no KV byte (``max_model_len``, ``max_logprobs``), which
    would split a pool between engines that can share it.
    """
    hf = getattr(model, "hf_config", None)
    hf_dict = hf.to_dict() if hf is not None and hasattr(hf, "to_dict") else {}
    fields = {
        "hf_config": _digest({k: v for k, v in hf_dict.items() if k not in _HF_IGNORED}),
        "model_weights": getattr(model, "model_weights", None),
        "revision": getattr(model, "revision", None),
        "code_revision": getattr(model, "code_revision", None),
        "quantization": getattr(model, "quantization", None),
        "quantization_config": _digest(getattr(model, "quantization_config", None)),
        "disable_sliding_window": getattr(model, "disable_sliding_window", None),
        "sliding_window": getattr(cache, "sliding_window", None),
        "kv_cache_dtype_skip_layers": _digest(getattr(cache, "kv_cache_dtype_skip_layers", None)),
        "mamba_cache_dtype": getattr(cache, "mamba_cache_dtype", None),
        "mamba_ssm_cache_dtype": getattr(cache, "mamba_ssm_cache_dtype", None),
        "kv_cache_layout": getattr(cache, "kv_cache_layout", None),
    }
    return {k: "" if v is None else str(v) for k, v in fields.items()}


def _device_type() -> str:
    """The KV tensor layout family differs by platform (CPU vs GPU backends)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - only without vLLM
        return "unknown"
    return str(current_platform.device_type)


def pp_stages(layers: int, pp: int) -> list[tuple[int, int]]:
    """Each PP stage's layers ``[first, end)`` as vLLM splits them (its
    ``get_pp_indices``, which honours ``VLLM_PP_LAYER_PARTITION``)."""
    if pp == 1:
        return [(0, layers)]
    from vllm.distributed.utils import get_pp_indices

    return [tuple(get_pp_indices(layers, k, pp)) for k in range(pp)]


def layer_index(name: str) -> int:
    """The model's layer index in a KV layer's name (``model.layers.12.self_attn.attn``);
    ``UnsupportedEngine`` when the name has none."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return int(extract_layer_index(name))
    except (AssertionError, ValueError) as exc:
        raise UnsupportedEngine(
            f"KV layer {name!r} has no layer index kvpool can read ({exc}); layer bands need it"
        ) from None


def worker_rank(layout: Layout) -> int:
    """This worker's rank in ``layout``, from vLLM's initialised process groups.

    Raises ``UnsupportedEngine`` if vLLM built its groups differently from the
    layout's default coordinates (then keys could disagree between ranks).
    """
    from vllm.distributed import parallel_state as ps

    tp_rank = int(ps.get_tensor_model_parallel_rank())
    pp_rank = int(ps.get_pp_group().rank_in_group)
    pcp_rank = int(ps.get_pcp_group().rank_in_group) if layout.pcp > 1 else 0
    dcp_rank = int(ps.get_dcp_group().rank_in_group) if layout.dcp > 1 else 0
    rank = tp_rank + layout.tp * (pcp_rank + layout.pcp * pp_rank)
    mine = RankCoords(rank, tp_rank, pp_rank, pcp_rank, dcp_rank)
    if layout.coord(rank) != mine:
        raise UnsupportedEngine(
            f"vLLM's process groups give this worker {mine}, but kvpool expects "
            f"{layout.coord(rank)}; please report this layout"
        )
    return rank
