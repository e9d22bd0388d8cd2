"""A load's target (tiering.io.target): parsed once from device, devices, sharding and rank,
written back as the same request fields, and refused with the code the service answers."""

from __future__ import annotations

from typing import Any

import pytest

from tiering.errors import InvalidDevice, InvalidInput, InvalidSharding
from tiering.io import Device, LoadTarget

SPEC = {"world_size": 2, "rules": [{"pattern": "*.q.weight", "dim": 0}]}
CUDA0, CUDA1 = Device("cuda", 0), Device("cuda", 1)


def test_one_device_several_every_gpu_and_a_sharding() -> None:
    one = LoadTarget.parse()
    assert (one.devices, one.many, one.sharding, one.rank) == ((Device("cpu"),), False, None, None)
    assert LoadTarget.of("cuda") == LoadTarget.parse(device="cuda:0")
    assert LoadTarget.of(one) is one
    two = LoadTarget.parse(devices=["cuda:0", "cuda:1"])
    assert (two.devices, two.many, two.ranks(2)) == ((CUDA0, CUDA1), True, [None, None])
    # "cuda:*" as a string or a list of one: every GPU, counted where the load runs.
    for every in ("cuda:*", ["cuda:*"], " CUDA:* "):
        t = LoadTarget.parse(devices=every)
        assert t.every_gpu and t.many
    # A string names one device, and still asks for the per-device reply.
    assert LoadTarget.parse(devices="cuda:1") == LoadTarget((CUDA1,), many=True)
    ranks = LoadTarget.parse(devices=["cuda:0", "cuda:1"], sharding=SPEC)
    assert ranks.sharding is not None and ranks.sharding.world_size == 2
    assert ranks.ranks(2) == [0, 1]
    # One rank goes into device (or the one of devices): the per-device reply too.
    mine = LoadTarget.parse(device="cuda:1", sharding=SPEC, rank=1)
    assert (mine.devices, mine.many, mine.ranks(1)) == ((CUDA1,), True, [1])


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"device": "cuda:1"},
        {"devices": ["cuda:1", "cuda:0"]},
        {"devices": "cuda:*"},
        {"devices": ["cuda:0", "cuda:1"], "sharding": SPEC},
        {"devices": "cuda:*", "sharding": {**SPEC, "strict": True}},
        {"device": "cpu", "sharding": SPEC, "rank": 1},
    ],
)
def test_the_request_fields_parse_back_to_the_same_target(kw: dict[str, Any]) -> None:
    # What the client writes is what the service parses: one spelling, both sides.
    target = LoadTarget.parse(**kw)
    assert LoadTarget.parse(**target.to_json()) == target


@pytest.mark.parametrize(
    ("kw", "error", "words"),
    [
        ({"device": "cpu", "devices": ["cpu"]}, InvalidInput, "not both"),
        ({"device": "npu:0"}, InvalidDevice, "not a device"),
        ({"devices": []}, InvalidDevice, "at least one"),
        ({"devices": ["cuda:0"] * 65}, InvalidDevice, "over the limit"),
        ({"devices": ["cpu", "cuda:0"]}, InvalidDevice, "cpu cannot be one of several"),
        ({"devices": ["cuda:0", "cuda"]}, InvalidDevice, "named twice"),
        ({"devices": ["cuda:*", "cuda:1"]}, InvalidDevice, "give it alone"),
        ({"devices": {"cuda:0": 1}}, InvalidDevice, "must be a list"),
        ({"rank": 0}, InvalidSharding, "needs a sharding spec"),
        ({"sharding": SPEC, "rank": 2}, InvalidSharding, "rank must be in"),
        ({"sharding": {"world_size": 0}}, InvalidSharding, "world_size"),
        ({"sharding": SPEC}, InvalidSharding, "one device per rank"),
        ({"devices": ["cuda:0", "cuda:1"], "sharding": SPEC, "rank": 0}, InvalidSharding, "one"),
    ],
)
def test_a_bad_target_is_refused_naming_the_problem(
    kw: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        LoadTarget.parse(**kw)


def test_every_gpu_is_counted_where_it_loads() -> None:
    every = LoadTarget.parse(devices="cuda:*", sharding=SPEC)
    assert every.ranks(2) == [0, 1]
    with pytest.raises(InvalidSharding, match="one device per rank"):
        every.ranks(4)
    with pytest.raises(InvalidInput, match="shared loads take one device"):
        every.alone("shared loads")
    assert LoadTarget.parse(device="cuda:1").alone("shared loads") == CUDA1
