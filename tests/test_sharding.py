"""Unit tests of partition specs (pure logic, no cluster)."""

import pytest

from pathways_torch import P, ShardingError
from pathways_torch.rpc import pathways_pb2 as pb
from pathways_torch.sharding import (host_box, member_blocks, member_region, shard_shape,
                                     spec_candidates, spec_from_proto, spec_to_proto,
                                     validate_spec)

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


@pytest.mark.parametrize("mesh,members", [((4, 2), 2), ((4, 2), 4), ((2, 4), 2),
                                          ((4, 2), 8)])
def test_member_region_inverts_member_blocks(mesh, members):
    """For every spec whose host parts are boxes: the box a host holds of an array,
    given only its shape, leads back to the array's shape and the box's start."""
    shape, checked = (16, 8), 0
    for spec in spec_candidates(2, AXES):
        for m in range(members):
            blocks, _ = member_blocks(shape, spec, AXES, mesh, m, members)
            try:
                box = host_box(blocks)
            except ShardingError:
                with pytest.raises(ShardingError, match="not one box"):
                    member_region((1, 1), spec, AXES, mesh, m, members)
                continue
            local = tuple(e - s for s, e in box)
            assert member_region(local, spec, AXES, mesh, m, members) == (
                shape, tuple(s for s, _ in box)), (spec, m)
            checked += 1
    assert checked >= len(spec_candidates(2, AXES)) * members // 2


def test_member_region_refuses_what_no_array_splits_into():
    with pytest.raises(ShardingError, match="divisible by 2"):     # 2 data rows a host
        member_region((3, 8), P("data"), AXES, MESH, 0, 2)
    with pytest.raises(ShardingError, match="rank 1"):
        member_region((4,), P(None, "data"), AXES, MESH, 0, 2)
    with pytest.raises(ShardingError, match="'batch'"):
        member_region((4,), P("batch"), AXES, MESH, 0, 2)
