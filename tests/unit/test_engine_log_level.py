"""The demo engine's kvpool log level (``kvpool.demo.engine.log_level``): the
spec's, else vLLM's ``VLLM_LOGGING_LEVEL`` (what ``vllm serve`` gives kvpool),
else warnings only."""

from __future__ import annotations

import logging

from kvpool.demo.engine import log_level


def test_the_spec_wins_over_vllms_level() -> None:
    assert log_level({"log_level": "DEBUG"}, {"VLLM_LOGGING_LEVEL": "ERROR"}) == "DEBUG"


def test_vllms_level_applies_without_one_in_the_spec() -> None:
    # bench engines (no log_level in their spec) then show each load piece's times
    assert log_level({}, {"VLLM_LOGGING_LEVEL": "debug"}) == "DEBUG"


def test_warnings_only_by_default() -> None:
    assert log_level({}, {}) == "WARNING"
    assert log_level({"log_level": None}, {"VLLM_LOGGING_LEVEL": ""}) == "WARNING"


def test_the_level_is_one_logging_accepts() -> None:
    logger = logging.getLogger("kvpool-test-level")
    logger.setLevel(log_level({}, {"VLLM_LOGGING_LEVEL": "info"}))
    assert logger.level == logging.INFO
