"""A job's settings: one shape, the same defaults and refusals on every side of the wire."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataquay.client.job_settings import EXCHANGE_CODINGS, SETTINGS, JobSettings, named_settings
from dataquay.client.placement import MODES, PARTITIONS
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.node.exchange.coding import SCHEMES

names = st.text(alphabet="abcdefghij0123456789-", min_size=1, max_size=12)
job_settings = st.builds(
    JobSettings,
    job_id=names,
    dataset=st.one_of(st.just(""), names),
    mode=st.sampled_from(sorted(MODES)),
    q=st.floats(min_value=0.0, max_value=1.0),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
    drop_last=st.booleans(),
    partition=st.sampled_from(PARTITIONS),
    batch_size=st.integers(min_value=0, max_value=2**32 - 1),
    nodes=st.lists(names, max_size=5).map(tuple),
    ranks_per_node=st.integers(min_value=0, max_value=2**32 - 1),
    exchange_coding=st.sampled_from(EXCHANGE_CODINGS),
)


@given(job_settings)
def test_settings_round_trip_through_the_proto(settings: JobSettings) -> None:
    spec = settings.to_proto()
    assert JobSettings.from_proto(spec) == settings
    assert JobSettings.from_proto(jpb.JobSpec.FromString(spec.SerializeToString())) == settings


@given(job_settings, st.sets(st.sampled_from(SETTINGS)))
def test_a_join_sets_only_the_settings_it_names(settings: JobSettings, named: set[str]) -> None:
    spec = settings.to_proto(named=named)
    assert spec.job_id == settings.job_id
    empty = {name for name in ("dataset", "nodes") if not getattr(settings, name)}
    assert named_settings(spec) == named - empty
    parsed = JobSettings.from_proto(spec)
    for name in SETTINGS:
        expected = getattr(settings if name in named else JobSettings(), name)
        assert getattr(parsed, name) == expected, name


def test_unset_settings_take_the_defaults() -> None:
    assert JobSettings.from_proto(jpb.JobSpec(job_id="j")) == JobSettings("j")
    assert named_settings(jpb.JobSpec(job_id="j", q=0.0, seed=0, nodes=[])) == {"q", "seed"}


@given(
    st.sampled_from(sorted(MODES)),
    st.one_of(st.floats(), st.floats(min_value=0.0, max_value=1.0)),
    st.integers(min_value=0, max_value=64),
)
def test_validation_refuses_q_and_batch_sizes_the_mode_cannot_run_with(mode: str, q: float, batch_size: int) -> None:
    settings = JobSettings(mode=mode, q=q, batch_size=batch_size)
    if not 0.0 <= q <= 1.0:
        with pytest.raises(ValueError, match=rf"^q {re.escape(str(q))} is not in \[0, 1\]$"):
            settings.check()
    elif mode == "partial" and q == 0.0:
        with pytest.raises(ValueError, match=r"^q must be in \(0, 1\] for mode partial"):
            settings.check()
    elif mode == "locality" and batch_size < 1:
        with pytest.raises(ValueError, match="^batch_size must be at least 1 for mode locality"):
            settings.check()
    else:
        settings.check()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (JobSettings(mode="sideways"), "mode must be one of global, local, partial, locality, not 'sideways'"),
        (JobSettings(partition="rows"), "partition must be one of sample, shard, not 'rows'"),
        (JobSettings(q=math.nan), "q nan is not in"),
        (JobSettings(seed=-1), "seed must not be negative, not -1"),
        (JobSettings(batch_size=-1), "batch_size must not be negative"),
        (JobSettings(ranks_per_node=-1), "ranks_per_node must not be negative"),
        (JobSettings(exchange_coding="lt"), "exchange_coding must be one of none, coded, uber, not 'lt'"),
    ],
)
def test_a_bad_setting_is_named_first(settings: JobSettings, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings.check()


def test_names_are_checked_alone_since_a_join_leaves_the_rest_to_the_job() -> None:
    JobSettings(mode="partial").check_names()
    with pytest.raises(ValueError, match="mode must be one of"):
        JobSettings(mode="scatter").check_names()
    with pytest.raises(ValueError, match="partition must be one of"):
        JobSettings(partition="file").check_names()


def test_the_exchange_codings_are_the_planners_schemes() -> None:
    assert EXCHANGE_CODINGS == tuple(SCHEMES)
