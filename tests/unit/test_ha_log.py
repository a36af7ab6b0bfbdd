"""Reading how far the HA leader's log reached etcd (``kvpool.pool.ha``)."""

from __future__ import annotations

import pytest

from kvpool.errors import StoreUnavailable
from kvpool.pool.ha import log_durable_seq, parse_durable_prefix
from kvpool.pool.processes import free_ports


def test_the_durable_prefix_gives_its_last_sequence_number() -> None:
    assert parse_durable_prefix(b'{"batch_id":4,"last_seq":34,"schema_version":1}') == 34


@pytest.mark.parametrize(
    "value", [b"[1,2,3]", b'{"batch_id":4}', b'{"last_seq":"34"}', b"not json"]
)
def test_a_record_of_another_form_is_refused(value: bytes) -> None:
    with pytest.raises(ValueError):
        parse_durable_prefix(value)


def test_an_etcd_that_does_not_answer_is_unavailable() -> None:
    (port,) = free_ports(1)
    with pytest.raises(StoreUnavailable, match="did not answer"):
        log_durable_seq(f"127.0.0.1:{port}", timeout=0.5)
