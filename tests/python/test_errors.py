"""What a Python trainer sees when a session fails: each failure reaches every rank as a
WsyncError naming what went wrong (code, phase, rank), nothing is committed, nothing
hangs, and nothing is left behind (conftest.Marked checks)."""
from __future__ import annotations

import re

import pytest

from conftest import run_session

RECIPE = "tests/fixtures/recipes/external_tiny.lua"


def failure(rank) -> dict[str, str]:
    match = re.search(r"failed: status (\S+), code (\S+), phase (.+?), rank (\S+), python cause (.*)\n(.*)\n?",
                      rank.out)
    assert match, "the rank did not report a WsyncError: " + rank.describe()
    keys = ("status", "code", "phase", "rank", "cause", "text")
    return dict(zip(keys, match.groups()))


def verdict(host) -> str:
    """The host's failed verdict: the one place it prints the session's failure (not again on
    stderr)."""
    match = re.search(r"\nwsync: verdict: FAILED: (.*)\n", host.out)
    assert match, "no failed verdict: " + host.describe()
    assert match.group(1) not in host.err and host.out.count(match.group(1)) == 1, \
        "the failure is printed more than once: " + host.describe()
    return match.group(1)


def test_a_wrong_global_shape_is_refused_at_registration(marked):
    name = "model.layers.1.self_attn.o_proj.weight"
    host, ranks = run_session(marked, RECIPE, world=2, versions=1, rank_args={0: ["--wrong-shape", name]})
    assert host.popen.returncode == 1, host.describe()
    assert f"rank 0 registered {name} as bfloat16 65x64; the model config says bfloat16 64x64" in verdict(host), \
        host.describe()
    for rank in ranks:
        assert rank.popen.returncode == 1, rank.describe()
        seen = failure(rank)
        assert seen["status"] == "EFAILED" and name in seen["text"], rank.describe()
    assert "published model version" not in host.out


def test_a_missing_tensor_is_named(marked):
    name = "model.layers.0.mlp.gate.weight"
    host, ranks = run_session(marked, RECIPE, world=2, versions=1, rank_args={1: ["--skip", name]})
    assert host.popen.returncode == 1, host.describe()
    assert name in verdict(host) and "rank 1" in verdict(host), host.describe()
    for rank in ranks:
        assert rank.popen.returncode == 1, rank.describe()
        assert name in failure(rank)["text"], rank.describe()
    assert "published model version" not in host.out


def test_a_callback_that_raises_fails_the_step_on_every_rank(marked):
    host, ranks = run_session(marked, RECIPE, world=2, versions=2, rank_args={1: ["--fail-callback",
                                                                                  "offload_optimizer"]})
    assert host.popen.returncode == 1, host.describe()
    assert "callback 'offload_optimizer' failed" in verdict(host) and "rank 1" in verdict(host), host.describe()
    failing, other = failure(ranks[1]), failure(ranks[0])
    assert failing["code"] == "CALLBACK_FAILED" and failing["rank"] == "1", ranks[1].describe()
    # The Python exception is the WsyncError's cause on the rank whose callback raised it.
    assert failing["cause"] == "RuntimeError: offload_optimizer fails on purpose", ranks[1].describe()
    assert other["cause"] == "None" and "callback 'offload_optimizer' failed" in other["text"], ranks[0].describe()
    assert other["rank"] == "1", ranks[0].describe()
    assert "published model version" not in host.out


@pytest.mark.parametrize("sigpipe", ["ignored", "default"])
def test_a_dead_host_fails_publish_instead_of_hanging(marked, sigpipe):
    # The host is killed once the first publication committed, while the ranks train for
    # the next (300 ms): their next publish writes to the dead host, raises (the
    # connection is gone) and they exit; the runtime dies with its host. Python ignores
    # SIGPIPE; with SIGPIPE at SIG_DFL, as in a C trainer, that write must still fail the
    # call instead of killing the rank (-13), and wsync must leave SIGPIPE as it found it
    # (rank.py exits 3 otherwise).
    extra = ["--sigpipe-default"] if sigpipe == "default" else []
    rank_args = {rank: ["--step-ms", "300", *extra] for rank in (0, 1)}
    host, ranks = run_session(marked, RECIPE, world=2, versions=3, rank_args=rank_args,
                              kill_host_when=lambda host, ranks: all("published version 1" in r.out for r in ranks))
    assert host.popen.returncode == -9
    for rank in ranks:
        assert rank.popen.returncode == 1, rank.describe()
        seen = failure(rank)
        assert seen["status"] == "EFAILED", rank.describe()
        assert "published version 3" not in rank.out
