"""The config fingerprint on vLLM's real configs: every setting that changes KV bytes
changes it; settings that change no KV byte leave it alone (engines keep sharing)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvpool import amx
from kvpool.errors import ConfigError
from kvpool.vllm.connector import _ready_amx
from kvpool.vllm.identity import engine_identity

BLOCK = 32


def _config(model: Path, **args: Any) -> Any:
    return EngineArgs(model=str(model), block_size=BLOCK, **args).create_engine_config()


def _kv_config(vllm_config: Any) -> KVCacheConfig:
    m = vllm_config.model_config
    spec = FullAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=m.get_total_num_kv_heads(),
        head_size=m.get_head_size(),
        dtype=torch.bfloat16,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(m.get_total_num_hidden_layers())]
    return KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )


def _fingerprint(vllm_config: Any) -> str:
    return engine_identity(vllm_config, _kv_config(vllm_config)).space.fingerprint


@pytest.fixture(scope="module")
def base(tiny_model: Path) -> Any:
    return _config(tiny_model)


def test_settings_that_change_no_kv_byte_keep_the_fingerprint(base: Any, tiny_model: Path) -> None:
    other = _config(tiny_model, max_model_len=1024, seed=7, enforce_eager=True, max_logprobs=3)
    assert _fingerprint(other) == _fingerprint(base)


def test_hf_overrides_change_the_fingerprint(base: Any, tiny_model: Path) -> None:
    rope = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    scaled = _config(tiny_model, hf_overrides=rope)
    assert _fingerprint(scaled) != _fingerprint(base)


@pytest.mark.parametrize(
    ("part", "field", "value"),
    [
        ("model_config", "model_weights", "/weights/another-checkpoint"),
        ("model_config", "revision", "0123abcd"),
        ("model_config", "code_revision", "0123abcd"),
        ("model_config", "quantization", "fp8"),
        ("model_config", "quantization_config", {"quant_method": "fp8", "group_size": 128}),
        ("model_config", "disable_sliding_window", True),
        ("cache_config", "kv_cache_dtype_skip_layers", ["0"]),
        ("cache_config", "mamba_cache_dtype", "float32"),
        # vLLM's CPU platform resolves the SSM state dtype to float32 already.
        ("cache_config", "mamba_ssm_cache_dtype", "float16"),
        ("cache_config", "kv_cache_layout", "HND"),
        ("cache_config", "sliding_window", 64),
    ],
)
def test_each_byte_changing_setting_changes_the_fingerprint(
    base: Any, part: str, field: str, value: Any
) -> None:
    changed = copy.copy(base)
    section = copy.copy(getattr(base, part))
    assert getattr(section, field) != value, f"{field} is {value!r} already: pick another"
    object.__setattr__(section, field, value)
    object.__setattr__(changed, part, section)
    assert _fingerprint(changed) != _fingerprint(base), field


def test_the_model_config_hf_dict_is_what_vllm_resolved(base: Any) -> None:
    """A layer count or head size override reaches the fingerprint through the HF
    config too (belt and braces: both are fingerprinted on their own as well)."""
    changed = copy.copy(base)
    model = copy.copy(base.model_config)
    hf = copy.deepcopy(model.hf_config)
    hf.rms_norm_eps = hf.rms_norm_eps * 2  # no size changes, only numbers
    object.__setattr__(model, "hf_config", hf)
    object.__setattr__(changed, "model_config", model)
    assert _fingerprint(changed) != _fingerprint(base)


def test_group_kinds_from_vllms_real_spec_classes() -> None:
    from vllm.v1.kv_cache_interface import (
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    from kvpool.errors import UnsupportedEngine
    from kvpool.layout import GroupKind, GroupSpec
    from kvpool.vllm.identity import _group_spec

    swa = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=4096
    )
    assert _group_spec(swa, 8) == GroupSpec(GroupKind.GQA, 8, 4096)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    assert _group_spec(full, 8) == GroupSpec(GroupKind.GQA, 8)
    # The hybrid manager off: a window recorded on a full spec keeps every block.
    kept = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64
    )
    assert _group_spec(kept, 8) == GroupSpec(GroupKind.GQA, 8)
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert _group_spec(mla, 1) == GroupSpec(GroupKind.MLA)
    swa_mla = SlidingWindowMLASpec(
        block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, sliding_window=128
    )
    assert _group_spec(swa_mla, 1) == GroupSpec(GroupKind.MLA, 0, 128)
    replay = SlidingWindowMLASpec(
        block_size=BLOCK,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.bfloat16,
        sliding_window=128,
        bounded_replay=True,
    )
    with pytest.raises(UnsupportedEngine, match="bounded replay"):
        _group_spec(replay, 1)
    # Mamba: its state per block exists only in vLLM's "align" mode (prefix caching on).
    shapes, dtypes = ((4, 64),), (torch.float32,)
    mamba = MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=dtypes, mamba_cache_mode="align")
    assert _group_spec(mamba, 8) == GroupSpec(GroupKind.MAMBA)
    assert GroupSpec(GroupKind.MAMBA).needed_chunks(5, BLOCK) == range(4, 5)  # the last state
    for mode in ("none", "all"):
        off = MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=dtypes, mamba_cache_mode=mode)
        with pytest.raises(UnsupportedEngine, match="pooled only with vLLM's prefix caching on"):
            _group_spec(off, 8)
    replicated = MambaSpec(
        block_size=BLOCK, shapes=shapes, dtypes=dtypes, mamba_cache_mode="align",
        tp_replicated=True,
    )  # fmt: skip
    with pytest.raises(UnsupportedEngine, match="replicated"):
        _group_spec(replicated, 8)


@pytest.mark.parametrize("window", [1, 2, 31, 32, 33, 64, 65, 100, 4096])
@pytest.mark.parametrize("block", [16, 32, 64])
def test_a_window_needs_the_chunks_vllm_needs_for_a_hit(window: int, block: int) -> None:
    """kvpool's window rule against vLLM's own (SlidingWindowManager)."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    from kvpool.layout import GroupKind, GroupSpec

    g = GroupSpec(GroupKind.GQA, 8, window)
    need = SlidingWindowManager._contiguous_blocks_for_hit(window, block, False)
    for hit in range(0, 200):
        assert len(g.needed_chunks(hit, block)) == min(hit, need), hit


def test_under_dcp_a_chunk_counts_the_tokens_of_vllms_scheduler_block(base: Any) -> None:
    """With DCP 2, one block-table entry and one block hash span block_size x 2
    tokens (each DCP rank's physical block holds its half): kvpool's chunks count
    the same tokens as vLLM's own resolution of block and hash sizes."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    config = copy.deepcopy(base)
    config.parallel_config.tensor_parallel_size = 4  # 2 KV heads: 2 ranks share each
    config.parallel_config.decode_context_parallel_size = 2
    kv = _kv_config(config)
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(kv, config)
    identity = engine_identity(config, kv)
    assert identity.block_size == scheduler_block == hash_block == 2 * BLOCK
    assert identity.chunk_size == 2 * BLOCK and identity.blocks_per_chunk == 1
    assert identity.layout.dcp == 2
    assert engine_identity(base, _kv_config(base)).block_size == BLOCK


def test_dcp1_and_dcp2_engines_on_one_token_grid_share_a_fingerprint(base: Any) -> None:
    """DCP2 at block size 32 has block-table entries of 64 tokens like DCP1 at 64:
    on one grid of 2 token classes their fingerprints are equal (they share
    objects); on the default grids (one class per DCP rank) they differ. (Not
    block 16 beside 32: vLLM's CPU kernel runs another ISA, "vec16", at 16.)"""
    one, two = _engine(base, block=2 * BLOCK), _engine(base, block=BLOCK, dcp=2, tp=4)
    assert one.chunk_size == two.chunk_size == 2 * BLOCK
    assert one.space.fingerprint != two.space.fingerprint
    one = _engine(base, block=2 * BLOCK, token_classes=2)
    two = _engine(base, block=BLOCK, dcp=2, tp=4, token_classes=2)  # 2 KV heads: 2 ranks each
    assert one.space.fingerprint == two.space.fingerprint
    assert set(one.layout.contents(0)) == set(two.layout.contents(0))


def _engine(base: Any, *, block: int, dcp: int = 1, tp: int = 1, **settings: Any) -> Any:
    config = copy.deepcopy(base)
    config.parallel_config.tensor_parallel_size = tp
    config.parallel_config.decode_context_parallel_size = dcp
    config.cache_config.block_size = block
    kv = _kv_config(config)
    for g in kv.kv_cache_groups:
        g.kv_cache_spec = dataclasses.replace(g.kv_cache_spec, block_size=block)
    return engine_identity(config, kv, **settings)


def test_the_block_size_and_the_cpu_kernels_isa_are_in_the_fingerprint(
    base: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object holds whole blocks in the attention kernel's byte order. vLLM's CPU
    kernel stores a block's K head_size-major, so block sizes 32 and 64 lay out one
    chunk's bytes differently even though kvpool names the chunk alike; and its
    ISA changes the order too (AMX packs K and V in pairs): a bf16 engine on a
    host with AMX and one without must not share. DCP1 at block 64 and DCP2 at
    32 have one block-table entry of 64 tokens and stay alike."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)  # a host
    # without AMX first: the build machine may have it or not
    at = {b: _engine(base, block=b, chunk_size=2 * BLOCK).space for b in (BLOCK, 2 * BLOCK)}
    assert at[BLOCK].fingerprint != at[2 * BLOCK].fingerprint
    assert at[BLOCK].config["extra"]["kv_layout"] == "cpu/vec"
    dcp2 = _engine(base, block=BLOCK, dcp=2, tp=4, token_classes=2)
    dcp1 = _engine(base, block=2 * BLOCK, token_classes=2)
    assert dcp1.space.fingerprint == dcp2.space.fingerprint
    bf16, fp32 = copy.deepcopy(base), copy.deepcopy(base)
    bf16.model_config.dtype = torch.bfloat16
    fp32.model_config.dtype = torch.float32
    before = _fingerprint(bf16), _fingerprint(fp32)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert _fingerprint(bf16) != before[0]
    assert _fingerprint(fp32) == before[1]  # fp32 runs "vec" on AMX hosts too


def test_vllms_hash_settings_leave_the_fingerprint_alone(
    base: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """xxhash without PYTHONHASHSEED (random per process in vLLM) is fine: kvpool
    names chunks itself."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fast = copy.deepcopy(base)
    fast.cache_config.prefix_caching_hash_algo = "xxhash"
    assert _fingerprint(fast) == _fingerprint(base)


def test_a_worker_asks_for_amx_tile_data_and_stops_at_start_where_bf16_attention_cannot_have_it(
    base: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's "amx" attention (bf16, on a CPU with AMX) needs tile data it never asks
    for: the worker asks at start. Where Linux refuses, a bf16 engine stops at start
    with what to change; a float32 engine ("vec") only warns."""
    bf16, fp32 = copy.deepcopy(base), copy.deepcopy(base)
    bf16.model_config.dtype = torch.bfloat16
    fp32.model_config.dtype = torch.float32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(amx, "cpu_has_amx", lambda: True)
    asked: list[bool] = []
    monkeypatch.setattr(amx, "request_tile_data", lambda: asked.append(True))
    caplog.set_level("INFO", logger="kvpool")
    _ready_amx(bf16, _kv_config(bf16))
    assert asked == [True]
    assert "AMX tile data enabled for this worker" in caplog.text

    def refuse() -> None:
        raise amx.AmxDenied("Linux refused AMX tile data (EPERM)")

    monkeypatch.setattr(amx, "request_tile_data", refuse)
    with pytest.raises(ConfigError, match=r"AMX path.*EPERM.*--dtype float32"):
        _ready_amx(bf16, _kv_config(bf16))
    _ready_amx(fp32, _kv_config(fp32))  # "vec": nothing runs tile instructions
    assert "does not take its AMX path" in caplog.text
    monkeypatch.setattr(amx, "cpu_has_amx", lambda: False)
    _ready_amx(bf16, _kv_config(bf16))  # no AMX: nothing to ask
