"""Unit tests of partition specs (pure logic, no cluster)."""

import pytest

from pathways_torch import P, ShardingError
from pathways_torch.rpc import pathways_pb2 as pb
from pathways_torch.sharding import (shard_shape, spec_candidates, spec_from_proto,
                                     spec_to_proto, validate_spec)

AXES, MESH = ("data", "model"), (4, 2)


def test_spec_entries_and_normalization():
    assert P("data", None).axes(0) == ("data",)
    assert P("data", None).axes(1) == ()
    assert P(("data", "model")).axes(0) == ("data", "model")
    assert P("data", None, None).normalized(3) == P("data")
    assert P() == P(None, None).normalized(2)
    with pytest.raises(ShardingError):
        P(3)


def test_validate_accepts_valid_specs():
    for spec in [P(), P("data"), P(None, "model"), P("data", "model"),
                 P(("data", "model"), None), P("model", "data")]:
        validate_spec(spec, (64, 128), AXES, MESH)


@pytest.mark.parametrize("spec,shape,words", [
    (P("batch"), (8, 8), "names mesh axis 'batch'"),
    (P("data", "data"), (8, 8), "twice"),
    (P("data"), (6, 8), "cannot split evenly"),
    (P(None, ("data", "model")), (8, 12), "cannot split evenly"),
    (P("data", None, None), (8, 8), "rank"),
])
def test_validate_rejects_with_advice(spec, shape, words):
    with pytest.raises(ShardingError, match=words):
        validate_spec(spec, shape, AXES, MESH)


def test_proto_round_trip():
    for spec in [P(), P("data"), P(None, "model"), P(("data", "model"), None)]:
        msg = pb.Spec()
        spec_to_proto(spec, msg)
        assert spec_from_proto(msg).normalized(2) == spec.normalized(2)


def test_candidates_are_unique_and_valid():
    cands = list(spec_candidates(2, AXES))
    assert len(cands) == len(set(cands))
    assert P() == cands[0]
    assert P("data", "model") in cands and P(("model", "data")) in cands
    for c in cands:
        validate_spec(c, (8, 8), AXES, MESH)


def test_shard_shape():
    assert shard_shape((64, 128), P("data", "model"), AXES, MESH) == (16, 64)
    assert shard_shape((64, 128), P(("data", "model")), AXES, MESH) == (8, 128)
