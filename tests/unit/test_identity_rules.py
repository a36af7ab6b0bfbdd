"""kvpool's rules for an engine's chunk size and object grid (``kvpool.connector.identity``),
apart from vLLM's config (read in ``kvpool.vllm.identity``)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.connector.identity import chunk_tokens, settings_layout
from kvpool.errors import ConfigError, LayoutError
from kvpool.layout import GroupSpec, Layout


def _groups(*specs: str) -> list[GroupSpec]:
    return list(Layout.create(tp=1, groups=list(specs)).groups)


def test_a_chunk_is_one_block_unless_set_and_a_whole_number_of_blocks() -> None:
    full = _groups("gqa:8")
    assert chunk_tokens(0, 32, full) == 32
    assert chunk_tokens(128, 32, full) == 128
    with pytest.raises(ConfigError, match="multiple of the block size 32"):
        chunk_tokens(48, 32, full)


def test_a_sliding_window_keeps_chunks_of_one_block() -> None:
    windowed = _groups("gqa:8", "gqa:8:w64")
    assert chunk_tokens(0, 32, windowed) == chunk_tokens(32, 32, windowed) == 32
    with pytest.raises(ConfigError, match="unset chunk_size"):
        chunk_tokens(64, 32, windowed)


def test_grid_settings_that_do_not_fit_the_engine_are_a_setting_to_fix() -> None:
    shape: dict[str, Any] = {"tp": 2, "layers": 4, "groups": ["gqa:8"]}
    assert settings_layout(shape) == Layout.create(**shape)  # no grid setting
    assert settings_layout(shape, heads_per_object=2) == Layout.create(**shape, heads_per_object=2)
    with pytest.raises(ConfigError):
        settings_layout(shape, heads_per_object=3)  # 4 heads a rank: not a divisor
    with pytest.raises(LayoutError):  # the engine itself: unsupported, not a setting
        settings_layout({"tp": 3, "layers": 4, "groups": ["gqa:8"]})
