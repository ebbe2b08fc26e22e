"""Two Python trainer ranks with numpy shards publish into the reference runtime through a
host started with `wsync run` (tests/fixtures/recipes/external_tiny.lua: the demo's tiny
Qwen3-MoE, TP2, host backend, every resident slice checked after each publication
against the synthetic values, which the ranks compute with numpy apart from wsync)."""
from __future__ import annotations

import re

from conftest import run_session

RECIPE = "tests/fixtures/recipes/external_tiny.lua"


def publications(rank) -> list[tuple[int, int, str, int]]:
    return [(int(v), int(m), h, int(r)) for v, m, h, r in
            re.findall(r"published version (\d+): model version (\d+), manifest (\w+), receipts (\d+)", rank.out)]


def test_two_ranks_publish_three_verified_versions(marked):
    host, ranks = run_session(marked, RECIPE, world=2, versions=3)
    assert host.popen.returncode == 0, host.describe()
    for rank in ranks:
        assert rank.popen.returncode == 0, rank.describe()
    assert "verdict: OK: 3 model versions published, every resident TP slice verified" in host.out, host.describe()
    assert host.out.count(", verified") >= 3, host.describe()
    first, second = publications(ranks[0]), publications(ranks[1])
    assert [p[0] for p in first] == [1, 2, 3], ranks[0].describe()
    assert first == second  # the same model versions, manifest and receipts on every rank
    versions = [p[1] for p in first]
    assert versions == sorted(versions) and len(set(versions)) == 3
    assert all(p[3] == 2 for p in first), "each publication has a receipt of both TP workers"
    assert len({p[2] for p in first}) == 1 and re.fullmatch(r"[0-9a-f]{64}", first[0][2])


def test_storage_moved_by_the_schedule_is_read_where_it_is(marked):
    # offload_actor and onload_actor give every shard a new array: the agent must read
    # the new memory at the next publication (values are checked after each one).
    host, ranks = run_session(marked, RECIPE, world=2, versions=3, rank_args={0: ["--move"], 1: ["--move"]})
    assert host.popen.returncode == 0, host.describe()
    assert "verdict: OK: 3 model versions published, every resident TP slice verified" in host.out
    for rank in ranks:
        assert rank.popen.returncode == 0, rank.describe()
        moved = re.search(r"moved (\d+) shards", rank.out)
        assert moved and int(moved.group(1)) >= 3 * 20, rank.describe()


def test_the_trainers_own_values_are_checked(marked):
    # Random values (not wsync's synthetic ones), checked with verify = "values": every
    # resident tensor's sum against the sums of the two ranks' rows, storage moved by
    # the schedule included.
    host, ranks = run_session(marked, "tests/fixtures/recipes/external_tiny_values.lua", world=2, versions=3,
                              rank_args={0: ["--random", "--move"], 1: ["--random"]})
    assert host.popen.returncode == 0, host.describe()
    assert ("verdict: OK: 3 model versions published, every resident TP slice verified against the trainer's "
            "values") in host.out, host.describe()
    for rank in ranks:
        assert rank.popen.returncode == 0, rank.describe()
