"""The runtime contract's Python twin (wsync.vllm.contract) on the cases of
tests/fixtures/contract/*.json, which the Lua contract's spec
(tests/unit/scripts/runtime/contract_spec.lua) reads too: the same code and the same message
for every case, so that the vllm runtime and the host cannot drift apart."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest

from wsync.vllm import contract
from wsync.vllm.failure import Failure

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "contract"


def cases(name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    fixture = json.loads((FIXTURES / f"{name}.json").read_text())
    return [pytest.param(fixture, case, id=case["name"]) for case in fixture["cases"]]


def changed(value: dict[str, Any], changes: dict[str, Any], remove: list[str]) -> dict[str, Any]:
    value = dict(value, **changes)
    for key in remove:
        value.pop(key, None)
    return value


def outcome(check: Callable[[], None]) -> tuple[Any, Any, Any, Any]:
    try:
        check()
    except Failure as failed:
        return failed.code, failed.message, failed.rank, failed.fatal
    return None, None, None, None


def expect(case: dict[str, Any], got: tuple[Any, Any, Any, Any], fatal: bool = True) -> None:
    code, message, rank, was_fatal = got
    assert code == case["code"], (case["name"], message)
    if case["code"] is not None:
        assert message == case["message"]
        assert rank == case.get("rank")
        assert was_fatal is fatal


@pytest.mark.parametrize("fixture, case", cases("header"))
def test_header(fixture: dict[str, Any], case: dict[str, Any]) -> None:
    runtime = dict(fixture["runtime"], **case.get("runtime", {}))
    header = case["header"] if "header" in case else changed(fixture["header"], case.get("changes", {}),
                                                             case.get("remove", []))
    expect(case, outcome(lambda: contract.check_header(header, runtime)))


@pytest.mark.parametrize("fixture, case", cases("receipts"))
def test_receipts(fixture: dict[str, Any], case: dict[str, Any]) -> None:
    receipts = copy.deepcopy(fixture["receipts"])
    if "receipts" in case:
        receipts = case["receipts"]
    if "receipt" in case:
        receipts[case["receipt"]] = changed(receipts[case["receipt"]], case.get("changes", {}), case.get("remove", []))
    resident = case["resident_tensors"] if "resident_tensors" in case else fixture["resident_tensors"]
    expect(case, outcome(lambda: contract.check_receipts(fixture["header"], receipts, resident)))


@pytest.mark.parametrize("fixture, case", cases("finish"))
def test_finish(fixture: dict[str, Any], case: dict[str, Any]) -> None:
    result = changed(copy.deepcopy(fixture["result"]), case.get("changes", {}), case.get("remove", []))
    if "receipt" in case:
        index = case["receipt"]
        result["receipts"][index] = dict(result["receipts"][index], **case["receipt_changes"])
    # (Only the receipts' own failures are fatal: a wrong commit is the host's refusal.)
    expect(case, outcome(lambda: contract.check_finish(fixture["header"], result)), fatal="receipt" in case)


def test_show_writes_values_as_the_lua_side_does() -> None:
    assert [contract.show(v) for v in (None, True, False, 3, 3.0, 2.5, "x", [1], {"a": 1})] == \
        ["nil", "true", "false", "3", "3", "2.5", "x", "(a table)", "(a table)"]
