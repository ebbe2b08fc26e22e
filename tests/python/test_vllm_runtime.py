"""The vllm runtime's Python side without vLLM: its protocol codec, its state machine over an
engine in place of vLLM (vllm_stand_in), its header and receipt checks, and the manifest
encoding it shares with the C core."""
from __future__ import annotations

import json
import re
import struct

import pytest

from vllm_stand_in import Engine as StandIn
from wsync import Host
from wsync.manifest import Manifest, digest
from wsync.vllm import protocol
from wsync.vllm.contract import check_receipts
from wsync.vllm.worker.receipts import receipt
from wsync.vllm.runtime.commands import Runtime
from wsync.vllm.failure import Failure
from wsync.vllm.runtime.server import Server


def frame(message: dict) -> bytes:
    return protocol.encode(message)


class TestProtocol:
    def test_frames_round_trip_across_any_split(self):
        messages = [protocol.success({"id": 3, "cmd": "info"}, {"a": 1}),
                    protocol.failure({"id": 4, "cmd": "x"}, "NOPE", "no", fatal=True)]
        stream = b"".join(frame(message) for message in messages)
        for cut in range(len(stream) + 1):
            decoder = protocol.Decoder()
            assert decoder.push(stream[:cut]) + decoder.push(stream[cut:]) == messages

    def test_a_bad_stream_fails_for_good(self):
        decoder = protocol.Decoder(limit=8)
        with pytest.raises(protocol.FrameError, match="frame of 9 bytes exceeds the 8-byte limit"):
            decoder.push(struct.pack(">I", 9))
        with pytest.raises(protocol.FrameError, match="exceeds"):
            decoder.push(b"")
        for body, says in ((b"[1]", "a JSON list, not an object"), (b"{no", "undecodable frame")):
            with pytest.raises(protocol.FrameError, match=says):
                protocol.Decoder().push(struct.pack(">I", len(body)) + body)

    def test_encoding_refuses_an_oversize_body(self):
        with pytest.raises(ValueError, match="exceeds the 10-byte limit"):
            protocol.encode({"text": "x" * 20}, limit=10)

    @pytest.mark.parametrize("message, code, says", [
        ({"protocol": 2, "id": 1, "cmd": "info"}, "PROTOCOL_MISMATCH", "peer speaks protocol 2"),
        ({"protocol": 1, "id": "1", "cmd": "info"}, "BAD_REQUEST", "numeric id"),
        ({"protocol": 1, "id": 1.5, "cmd": "info"}, "BAD_REQUEST", "not an integer"),
        ({"protocol": 1, "id": True, "cmd": "info"}, "BAD_REQUEST", "numeric id"),
        ({"protocol": 1, "id": 1, "cmd": "info", "payload": 3}, "BAD_REQUEST", "payload is not an object"),
    ])
    def test_requests_are_checked(self, message, code, says):
        got_code, reason = protocol.check_request(message)
        assert got_code == code and says in reason

    def test_the_server_answers_in_order_and_names_unknown_commands(self):
        server = Server({"echo": lambda payload: {"said": payload.get("x")}}, name="test runtime")
        assert server.answer({"protocol": 1, "id": 7, "cmd": "echo", "payload": {"x": 1}}) == \
            {"protocol": 1, "id": 7, "cmd": "echo", "ok": True, "result": {"said": 1}}
        unknown = server.answer({"protocol": 1, "id": 8, "cmd": "fly"})
        assert unknown["error"]["code"] == "UNKNOWN_COMMAND" and "(it has: echo)" in unknown["error"]["message"]
        refused = server.answer({"protocol": 1, "id": "x", "cmd": "echo"})
        assert refused["id"] == 0 and refused["error"]["code"] == "BAD_REQUEST"

    def test_an_exception_in_a_handler_is_fatal_with_its_traceback(self):
        def broken(_payload):
            raise KeyError("missing")
        answer = Server({"go": broken}).answer({"protocol": 1, "id": 1, "cmd": "go"})
        assert answer["error"]["fatal"] is True and "KeyError" in answer["error"]["message"]
        assert "Traceback" in answer["error"]["traceback"]


def header(runtime: Runtime, **changes) -> dict:
    base = {"protocol": 1, "transport": "shm", "publication_id": "ab" * 16, "model_version": runtime.model_version + 1,
            "manifest": "", "tp_world": runtime.tp, "uuids": [w["device"]["uuid"] for w in runtime.engine.workers()]}
    base["manifest"] = digest([("a", "bfloat16", [2, 3])])
    base.update(changes)
    return base


class Recording(StandIn):
    """The stand-in with weight commands that only record what they are told (the state
    machine's tests need no buffers): receipts from the records of the chunks loaded."""

    def init_weights(self, payload):
        self.chunks, self.loaded = {}, []
        gates = payload.get("gates")
        return [{"rank": rank, "ordered": gates is not None and self.fault != "no_gate"} for rank in range(self.tp)]

    def start_update(self, header):
        self.loaded = []

    def load_chunk(self, payload):
        if self.fault == f"load_chunk:{payload['chunk']}":
            raise Failure("LOAD_FAILED", "TP worker 0: injected failure", fatal=True, rank=0)
        self.chunks.setdefault(payload["chunk"], payload.get("tensors"))
        self.loaded.append(payload["chunk"])
        return [{"rank": rank, "bytes": 12} for rank in range(self.tp)]

    def finish_update(self, header):
        manifest = Manifest()
        for chunk in self.loaded:
            for tensor in self.chunks[chunk]:
                manifest.add(tensor["name"], tensor["dtype"], tensor["shape"])
        digest_hex = "0" * 64 if self.fault == "finish:receipt" else manifest.hexdigest()
        return [receipt(header, rank, self.uuids[rank], digest_hex, manifest.count, manifest.bytes, 1)
                for rank in range(self.tp)]


@pytest.fixture
def runtime():
    engine = Recording(tp=2, devices=[0, 1], backend="host", model="", load="direct", engine_args={}, timeouts={})
    runtime = Runtime(engine, tp=2, load="direct")
    runtime.init_weights({"tp": 2, "transport": "shm", "buffers": [["a"], ["b"]]})
    yield runtime
    engine.close()


def publish(runtime: Runtime, release: bool = False, **changes) -> dict:
    started = header(runtime, **changes)
    runtime.start_update({"header": started})
    tensors = [{"name": "a", "dtype": "bfloat16", "shape": [2, 3], "offset": 0, "bytes": 12}]
    runtime.load_chunk({"chunk": 1, "buffer": 1, "tensors": tensors})
    finish = {"publication_id": started["publication_id"], "model_version": started["model_version"]}
    if release:
        finish["release"] = True
    return runtime.finish_update(finish)


class TestRuntime:
    def test_a_publication_commits_its_version_and_stamps_later_results(self, runtime):
        before = runtime.generate({"prompts": [[1, 2]], "sampling": {"max_tokens": 2}})
        assert before["model_version"] == 0
        finished = publish(runtime)
        assert finished["model_version"] == 1 and finished["prefix_cache_reset"] is True
        assert [r["tp_rank"] for r in finished["receipts"]] == [0, 1]
        after = runtime.generate({"prompts": [[1, 2]], "sampling": {"max_tokens": 2}})
        assert after["model_version"] == 1 and after["outputs"][0]["model_version"] == 1
        assert after["engine_seconds"] >= 0
        assert after["outputs"][0]["token_ids"] != before["outputs"][0]["token_ids"]
        assert runtime.info()["prefix_cache_resets"] == 1

    def test_an_idle_engine_commits_by_salt_and_requests_in_flight_get_vllms_reset(self, runtime):
        finished = publish(runtime)
        assert finished["prefix_cache"] == "salted" and finished["commit_seconds"] >= 0
        assert runtime.engine.commits[-1] == {"model_version": 1, "preempt": False, "in_flight": False}
        runtime.submit({"requests": [{"prompt": [1, 2], "max_tokens": 64}]})
        runtime.pause({"mode": "keep"})
        finished = publish(runtime)
        assert finished["prefix_cache"] == "reset"
        assert runtime.engine.commits[-1] == {"model_version": 2, "preempt": True, "in_flight": True}

    def test_init_says_ordered_only_when_every_worker_mapped_its_gate(self, runtime):
        payload = {"tp": 2, "transport": "shm", "buffers": [["a"], ["b"]]}
        assert runtime.init_weights(payload)["ordered"] is False
        assert runtime.init_weights(dict(payload, gates=["ga", "gb"]))["ordered"] is True
        runtime.engine.fault = "no_gate"
        assert runtime.init_weights(dict(payload, gates=["ga", "gb"]))["ordered"] is False
        runtime.engine.fault = None
        with pytest.raises(Failure) as refused:
            runtime.init_weights(dict(payload, gates=["ga"]))
        assert refused.value.code == "BAD_METADATA" and "the gate of each of the 2 TP ranks" in refused.value.message

    def test_finish_releases_in_its_answer_only_when_asked(self, runtime):
        assert "released" not in publish(runtime)
        assert publish(runtime, release=True)["released"] is True

    def test_no_generation_between_start_and_finish(self, runtime):
        runtime.start_update({"header": header(runtime)})
        with pytest.raises(Failure) as refused:
            runtime.generate({"prompts": [[1]]})
        assert refused.value.code == "STATE_REFUSED" and not refused.value.fatal
        assert "between start and finish" in refused.value.message

    @pytest.mark.parametrize("changes, says", [
        ({"protocol": 2}, "header for protocol 2"),
        ({"transport": "cuda_ipc"}, "header for transport cuda_ipc; the buffers this runtime imported are shm"),
        ({"publication_id": "xyz"}, "publication id xyz is not 128 bits in hex"),
        ({"model_version": 0}, "model version 0 does not follow the committed version 0"),
        ({"manifest": "00"}, "manifest 00 is not a SHA-256 in hex"),
        ({"tp_world": 4}, "header for TP 4, runtime has 2 workers"),
        ({"uuids": ["x", "y"]}, "header puts rank 0 on device x; TP worker 0 is on"),
    ])
    def test_a_header_that_does_not_match_breaks_the_runtime(self, runtime, changes, says):
        with pytest.raises(Failure) as failed:
            runtime.start_update({"header": header(runtime, **changes)})
        assert failed.value.code == "BAD_HEADER" and failed.value.fatal and says in failed.value.message

    def test_a_failed_weight_command_breaks_it_for_good(self, runtime):
        runtime.engine.fault = "load_chunk:1"
        runtime.start_update({"header": header(runtime)})
        with pytest.raises(Failure) as failed:
            runtime.load_chunk({"chunk": 1, "buffer": 1, "tensors": []})
        assert failed.value.fatal and failed.value.rank == 0
        with pytest.raises(Failure) as later:
            runtime.info()
        assert later.value.code == "RUNTIME_BROKEN" and "injected failure" in later.value.message

    def test_a_bad_receipt_is_refused_before_the_commit(self, runtime):
        runtime.engine.fault = "finish:receipt"
        with pytest.raises(Failure) as failed:
            publish(runtime)
        assert failed.value.code == "RECEIPT_INVALID" and "consumed manifest 000" in failed.value.message
        assert runtime.model_version == 0

    def test_a_pause_refuses_generation_until_resume(self, runtime):
        assert runtime.pause({"mode": "keep", "kv": "recompute"}) == {"mode": "keep", "aborted": 0, "finished": 0,
                                                                        "held": 0}
        with pytest.raises(Failure, match="paused \\(keep\\): resume first"):
            runtime.generate({"prompts": [[1]]})
        with pytest.raises(Failure, match="paused already"):
            runtime.pause({"mode": "wait"})
        runtime.resume({})
        assert runtime.generate({"prompts": [[1]], "sampling": {"max_tokens": 1}})["outputs"]
        with pytest.raises(Failure, match="resume without a pause"):
            runtime.resume({})
        for bad in ({"mode": "later"}, {"mode": "keep", "kv": "forget"}):
            with pytest.raises(Failure) as refused:
                runtime.pause(bad)
            assert refused.value.code == "INVALID_ARGUMENT"

    def test_finish_must_name_the_publication_being_updated(self, runtime):
        runtime.start_update({"header": header(runtime)})
        with pytest.raises(Failure) as failed:
            runtime.finish_update({"publication_id": "cd" * 16, "model_version": 1})
        assert failed.value.code == "WRONG_PUBLICATION"


class TestReceipts:
    HEADER = {"publication_id": "ab" * 16, "model_version": 3, "tp_world": 2, "uuids": ["u0", "u1"],
              "manifest": "m" * 64}

    def receipts(self):
        return [receipt(self.HEADER, rank, f"u{rank}", "m" * 64, 5, 10, 7) for rank in range(2)]

    @pytest.mark.parametrize("field, value, says", [
        ("publication_id", "cd" * 16, "publication id"),
        ("model_version", 2, "model version 2 is not 3"),
        ("tp_rank", 0, "claims TP rank 0 of 2"),
        ("uuid", "u9", "device u9, the header says u1"),
        ("manifest", "x" * 64, "consumed manifest"),
        ("resident_tensors", 6, "filled 6 resident tensors of 7"),
    ])
    def test_each_field_is_checked_naming_the_rank(self, field, value, says):
        receipts = self.receipts()
        check_receipts(self.HEADER, receipts, [7, 7])
        receipts[1][field] = value
        with pytest.raises(Failure) as failed:
            check_receipts(self.HEADER, receipts, [7, 7])
        assert failed.value.rank == 1 and f"receipt of TP rank 1: {says}" in failed.value.message

    def test_one_receipt_per_rank(self):
        with pytest.raises(Failure, match="1 receipts for TP 2"):
            check_receipts(self.HEADER, self.receipts()[:1])


def test_the_manifest_is_the_c_cores():
    """The demo plan's manifest, computed here and by libwsync, record by record."""
    with Host() as host:
        tensors = json.loads(host.eval(
            "local plan = require('wsync.plan').build({ family = 'qwen3_moe', config = 'tiny' }, "
            "{ bytes = 163840, count = 2 }) local records = {} "
            "for _, t in ipairs(plan.canonical) do records[#records + 1] = { t.name, t.dtype, t.shape } end "
            "return require('cjson').encode({ records = records, manifest = plan.manifest })"))
    ours = Manifest()
    for name, dtype, shape in tensors["records"]:
        ours.add(name, dtype, shape)
    assert ours.count == 45
    assert ours.hexdigest() == tensors["manifest"]
    with pytest.raises(ValueError, match="dtype 'complex' is not one wsync knows"):
        ours.add("x", "complex", [1])


class TestWire:
    """vLLM 0.26's packed update_info as wsync builds it (vLLM's own parser reads it in the gpu
    tier; here the layout, with a stand-in for torch's classes)."""

    TORCH = __import__("types").SimpleNamespace(Tensor="Tensor", Size=lambda dims: ("Size", tuple(dims)),
                                                storage=__import__("types").SimpleNamespace(TypedStorage="Typed"),
                                                uint8="uint8")
    HANDLE = bytes(range(64))
    DESCRIPTOR = f"4096:{bytes(range(64)).hex()}"

    @staticmethod
    def tensors(*spans):
        return [{"name": f"t{index}", "dtype": "bfloat16", "shape": [size // 2], "offset": offset, "bytes": size}
                for index, (offset, size) in enumerate(spans)]

    def test_descriptors_and_storage_handles(self):
        from wsync.vllm import compat
        from wsync.vllm.worker import wire
        assert wire.parse_descriptor(self.DESCRIPTOR) == (4096, self.HANDLE)
        for bad in ("4096", "x:00", f"4096:{'00' * 63}", f"0:{self.HANDLE.hex()}"):
            with pytest.raises(ValueError, match="descriptor"):
                wire.parse_descriptor(bad)
        handle = compat.storage_handle(self.HANDLE)
        assert len(handle) == 66 and handle[0] == 2 and handle[1:2] == b"c" and handle[2:] == self.HANDLE

    def test_a_chunk_is_one_update_unless_it_has_a_gap(self):
        from wsync.vllm.worker import wire
        assert [len(run) for run in wire.runs(self.tensors((64, 8), (0, 64), (72, 8)))] == [3]
        assert [[t["offset"] for t in run] for run in wire.runs(self.tensors((0, 8), (16, 8)))] == [[0], [16]]
        with pytest.raises(ValueError, match="overlaps"):
            wire.runs(self.tensors((0, 8), (4, 8)))

    def test_update_info_has_exactly_the_keys_vllm_026_takes(self):
        from wsync.vllm import compat
        from wsync.vllm.worker import wire
        run = wire.runs(self.tensors((128, 64), (192, 32)))[0]
        info = wire.update_info_v026(self.TORCH, run, "uuid-0", self.DESCRIPTOR, b"/refcount")
        assert set(info) == {"names", "dtype_names", "shapes", "packed", "tensor_sizes", "ipc_handles"}
        assert info["names"] == ["t0", "t1"] and info["tensor_sizes"] == [64, 32] and info["packed"] is True
        assert info["shapes"] == [[32], [16]] and info["dtype_names"] == ["bfloat16", "bfloat16"]
        args = info["ipc_handles"]["uuid-0"]
        assert len(args) == 15
        assert args[0] == "Tensor" and args[1] == ("Size", (96,)) and args[3] == 128 and args[5] == "uint8"
        assert args[7] == compat.storage_handle(self.HANDLE) and args[8] == 4096 and args[9] == 0
        assert args[11] == b"/refcount" and args[14] is False
        with pytest.raises(ValueError, match="beyond the 4096-byte buffer"):
            wire.update_info_v026(self.TORCH, self.tensors((4090, 8)), "uuid-0", self.DESCRIPTOR, b"")

    def test_lua_literals_hold_any_text(self):
        from wsync.host import lua_literal
        texts = ['a]]b]=]c"\n\\\u00e9', "ends]", "ends]=", "]]", "]=]]==]", "\nleading newline",
                 "cr\r\nlf", "", '{"residents": {"a": [1, 2]}}' * 2000]
        with Host() as host:
            for text in texts:
                assert host.eval("return " + lua_literal(text), result_bytes=1 << 20) == text
            # (eval's answer is a C string: the NUL is seen in the length.)
            assert host.eval("return #" + lua_literal("nul\0byte")) == "8"
        # (A long bracket for JSON, bytes escaped for text Lua would not read back as is.)
        assert lua_literal('{"a": [1]}') == '[[{"a": [1]}]]'
        assert lua_literal("x]]") == "[=[x]]]=]"
        assert lua_literal("cr\r").startswith('"')


def test_the_direct_loader_lists_the_engines_parameters_again_only_when_they_moved():
    from wsync.vllm.worker.extension import DirectLoader
    calls = []
    where = {"a": 1000}

    class Recorded(DirectLoader):
        def _call(self, cmd, payload):
            calls.append((cmd, payload))
            return {}

    loader = Recorded({"rank": 0, "world": 1, "device": {"backend": "host", "index": 0}}, None,
                      lambda: {name: {"pointer": pointer} for name, pointer in where.items()},
                      lambda: tuple(sorted(where.items())))
    loader.opened = True
    loader.init_weights({"buffers": [[]]})
    assert calls[-1][1]["residents"] == {"a": {"pointer": 1000}}
    loader.start_update({"header": {}})
    assert calls[-1][1].get("residents_unchanged") is True and "residents" not in calls[-1][1]
    where["a"] = 2000  # (a parameter moved: in a sleep, say)
    loader.start_update({"header": {}})
    assert calls[-1][1]["residents"] == {"a": {"pointer": 2000}} and "residents_unchanged" not in calls[-1][1]
    loader.start_update({"header": {}})
    assert calls[-1][1].get("residents_unchanged") is True

    class Failing(Recorded):
        def _call(self, cmd, payload):
            super()._call(cmd, payload)
            if cmd == "start_update" and "residents" in payload:
                raise Failure("DIRECT_UNSUPPORTED", "refused", fatal=True)
            return {}

    # A refused binding is never taken for a bound one.
    failing = Failing(loader.identity, None, loader.residents, loader.fingerprint)
    failing.opened = True
    failing.init_weights({"buffers": [[]]})
    where["a"] = 3000
    with pytest.raises(Failure):
        failing.start_update({"header": {}})
    with pytest.raises(Failure):
        failing.start_update({"header": {}})
    assert "residents" in calls[-1][1]
    # No fingerprint: the parameters go with every publication.
    plain = Recorded(loader.identity, None, loader.residents)
    plain.opened = True
    plain.init_weights({"buffers": [[]]})
    plain.start_update({"header": {}})
    assert "residents" in calls[-1][1]


def test_eval_reuses_its_result_buffer_and_grows_it():
    with Host() as host:
        assert host.eval("return 'a'") == "a"
        first = host._eval_buffer
        assert host.eval("return string.rep('b', 100)") == "b" * 100
        assert host._eval_buffer is first
        big = host.eval("return string.rep('c', 3 * 1024 * 1024)", result_bytes=4 << 20)
        assert big == "c" * (3 << 20)
        assert host._eval_buffer is not first
        assert host.eval("return 'd'") == "d"


def run_until(runtime: Runtime, done, steps: int = 10000) -> None:
    """Runs the runtime's generation steps (as its server does between commands) until
    ``done()``."""
    for _ in range(steps):
        if done():
            return
        if not runtime.idle():
            break
    assert done(), "generation stopped before the condition held"


class TestStreaming:
    """submit / poll / pause / resume with a streaming engine (wsync.vllm.runtime.streams)."""

    def test_requests_stream_and_are_forgotten_once_polled_finished(self, runtime):
        ids = runtime.submit({"requests": [{"prompt": [1, 2], "max_tokens": 3}, {"prompt": [5], "max_tokens": 2}]})
        assert ids == {"ids": [1, 2]}
        run_until(runtime, lambda: runtime.streams.in_flight() == 0)
        polled = runtime.poll({})
        assert [(r["id"], len(r["tokens"]), r["done"], r["finish"]) for r in polled["requests"]] == \
            [(1, 3, True, "length"), (2, 2, True, "length")]
        assert polled["requests"][0]["spans"] == [{"version": 0, "first_token": 0, "last_token": 2}]
        assert polled["in_flight"] == 0 and runtime.poll({})["requests"] == []
        with pytest.raises(Failure, match="no request 1"):
            runtime.poll({"ids": [1]})

    def test_keep_holds_requests_across_a_publication_and_recomputes_their_kv(self, runtime):
        runtime.submit({"requests": [{"prompt": [3, 4], "max_tokens": 12}, {"prompt": [9], "max_tokens": 12}]})
        run_until(runtime, lambda: runtime.streams.requests[1]["tokens"][4:5] != [])
        paused = runtime.pause({"mode": "keep", "kv": "recompute"})
        assert paused == {"mode": "keep", "aborted": 0, "finished": 0, "held": 2}
        assert runtime.idle() is False  # held: no step
        before = [len(runtime.streams.requests[rid]["tokens"]) for rid in (1, 2)]
        publish(runtime)
        assert runtime.engine.recomputed == 2
        assert runtime.resume({}) == {"held": 2, "kv": "recomputed"}
        run_until(runtime, lambda: runtime.streams.in_flight() == 0)
        for rid, produced in zip((1, 2), runtime.poll({})["requests"]):
            count = before[rid - 1]
            assert produced["spans"] == [{"version": 0, "first_token": 0, "last_token": count - 1},
                                         {"version": 1, "first_token": count, "last_token": 11, "kv": "recomputed"}]
            assert produced["model_version"] == 0 and len(produced["tokens"]) == 12

    def test_abort_ends_requests_in_flight_and_wait_finishes_them(self, runtime):
        runtime.submit({"requests": [{"prompt": [1], "max_tokens": 50}]})
        run_until(runtime, lambda: len(runtime.streams.requests[1]["tokens"]) >= 2)
        assert runtime.pause({"mode": "abort"})["aborted"] == 1
        (aborted,) = runtime.poll({})["requests"]
        assert aborted["done"] and aborted["finish"] == "aborted" and len(aborted["tokens"]) < 50
        assert runtime.resume({}) == {"held": 0, "kv": None}
        runtime.submit({"requests": [{"prompt": [1], "max_tokens": 5}]})
        assert runtime.pause({"mode": "wait"}) == {"mode": "wait", "aborted": 0, "finished": 1, "held": 0}
        (waited,) = runtime.poll({})["requests"]
        assert waited["done"] and waited["finish"] == "length" and len(waited["tokens"]) == 5
        runtime.resume({})

    def test_requests_submitted_while_paused_wait_for_resume(self, runtime):
        runtime.pause({"mode": "keep"})
        runtime.submit({"requests": [{"prompt": [2], "max_tokens": 2}]})
        assert runtime.idle() is False and runtime.streams.requests[1]["tokens"] == []
        runtime.resume({})
        run_until(runtime, lambda: runtime.streams.in_flight() == 0)
        assert len(runtime.poll({})["requests"][0]["tokens"]) == 2

    def test_what_streaming_refuses(self, runtime):
        with pytest.raises(Failure) as refused:
            runtime.pause({"mode": "keep", "kv": "keep"})
        assert refused.value.code == "NOT_SUPPORTED" and "recomputes held requests' KV" in refused.value.message
        runtime.submit({"requests": [{"prompt": [1], "max_tokens": 100}]})
        with pytest.raises(Failure, match="generate while 1 streaming requests are in flight"):
            runtime.generate({"prompts": [[1]]})
        for bad, says in (([{"prompt": []}], "prompt 1 is not a non-empty list"),
                          ([{"prompt": [1], "max_tokens": 0}], "max_tokens must be an integer from 1"),
                          ([{"prompt": [1], "sampling": {"beam": 2}}], "sampling parameters beam are not taken"),
                          ([{"prompt": [1], "sampling": {"n": 2}}], "sampling parameters n are not taken"),
                          ("x", "submit needs a list")):
            with pytest.raises(Failure, match=says) as failed:
                runtime.submit({"requests": bad})
            assert failed.value.code == "INVALID_ARGUMENT" and not failed.value.fatal
        # all or none: a request the engine refuses withdraws the ones before it
        with pytest.raises(Failure, match="request 2: the prompt's 2 tokens and max_tokens 65535 exceed") as refused:
            runtime.submit({"requests": [{"prompt": [1], "max_tokens": 3}, {"prompt": [1, 2], "max_tokens": 65535}]})
        assert refused.value.code == "INVALID_ARGUMENT" and not refused.value.fatal
        assert runtime.streams.in_flight() == 1 and sorted(runtime.streams.requests) == [1]
        runtime.start_update({"header": header(runtime)})
        assert runtime.idle() is False  # (no generation between start and finish)

    def test_a_sleep_aborts_the_requests_in_flight(self, runtime):
        runtime.submit({"requests": [{"prompt": [1], "max_tokens": 100}]})
        runtime.idle()
        runtime.sleep({"level": 1})
        (aborted,) = runtime.poll({})["requests"]
        assert aborted["finish"] == "aborted" and runtime.streams.in_flight() == 0


class TestChannel:
    """wsync.vllm.runtime.channels and wsync.vllm.worker.channel: the runtime's sockets to vLLM's workers, beside collective_rpc."""

    @staticmethod
    def open(tmp_path, handlers):
        from wsync.vllm.runtime.channels import Channels
        from wsync.vllm.worker.channel import serve
        paths = [str(tmp_path / f"tp{rank}.sock") for rank in range(len(handlers))]
        threads = [serve(path, handler) for path, handler in zip(paths, handlers)]
        return Channels(paths, timeout=5), threads

    def test_a_command_reaches_every_worker_and_the_answers_come_back_by_rank(self, tmp_path):
        seen = []

        def worker(rank):
            def handle(cmd, payload):
                seen.append((rank, cmd, json.loads(payload)))
                return json.dumps({"ok": True, "result": {"rank": rank}})
            return handle
        channels, threads = self.open(tmp_path, [worker(0), worker(1)])
        for chunk in (1, 2):
            answers = channels.call("load_chunk", json.dumps({"chunk": chunk}), timeout=5)
            assert [json.loads(answer)["result"]["rank"] for answer in answers] == [0, 1]
        assert sorted((rank, cmd, payload["chunk"]) for rank, cmd, payload in seen) == \
            [(0, "load_chunk", 1), (0, "load_chunk", 2), (1, "load_chunk", 1), (1, "load_chunk", 2)]
        assert list(tmp_path.iterdir()) == []  # (each socket file goes once connected)
        channels.close()
        for thread in threads:
            thread.join(5)
            assert not thread.is_alive()

    def test_a_worker_that_goes_away_or_does_not_answer_fails_the_command(self, tmp_path):
        import threading
        hold = threading.Event()

        def slow(cmd, payload):
            hold.wait(10)
            return "{}"
        channels, _ = self.open(tmp_path, [lambda cmd, payload: "{}", slow])
        with pytest.raises(Failure) as timed_out:
            channels.call("finish_update", "{}", timeout=0.3)
        assert timed_out.value.code == "TIMEOUT" and "TP workers [1] did not answer finish_update" in \
            timed_out.value.message
        with pytest.raises(Failure) as died:
            channels.call("load_chunk", "{}", timeout=5, dead=lambda: "vLLM's EngineCore (pid 7) died")
        assert died.value.code == "ENGINE_DIED" and died.value.message == \
            "vLLM's EngineCore (pid 7) died during load_chunk" and died.value.fatal
        hold.set()
        channels.close()

    def test_a_channel_closed_by_its_worker_is_named(self, tmp_path):
        from wsync.vllm.runtime.channels import Channels
        import socket
        path = str(tmp_path / "tp0.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        channels = Channels([path], timeout=5)
        accepted, _ = listener.accept()
        accepted.close()
        listener.close()
        with pytest.raises(Failure) as died:
            channels.call("load_chunk", "{}", timeout=5)
        assert died.value.code == "ENGINE_DIED" and "TP worker 0 closed its channel" in died.value.message
        channels.close()

    def test_a_channel_reset_by_its_worker_is_the_engines_death(self, tmp_path):
        # (A killed EngineCore's socket is reset, not closed in order: on the H200 a SIGKILL
        # during load_chunk gave ConnectionResetError, reported as a worker failure before.)
        from wsync.vllm.runtime.channels import Channels
        import select
        import socket
        import threading
        path = str(tmp_path / "tp0.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)

        def worker():  # dies with the request unread: its end closes with data queued
            accepted, _ = listener.accept()
            select.select([accepted], [], [], 5)
            accepted.close()
        thread = threading.Thread(target=worker)
        thread.start()
        channels = Channels([path], timeout=5)
        with pytest.raises(Failure) as died:
            channels.call("load_chunk", "{}", timeout=5, dead=lambda: "vLLM's EngineCore (pid 7) died")
        thread.join(5)
        listener.close()
        assert died.value.code == "ENGINE_DIED" and died.value.fatal
        assert died.value.message == ("TP worker 0's channel broke during load_chunk ([Errno 104] Connection reset "
                                      "by peer; vLLM's EngineCore (pid 7) died)")
        channels.close()


def test_the_check_against_vllms_loader_goes_a_bounded_group_of_parameters_at_a_time():
    from wsync.vllm.worker.extension import check_groups
    tensors = [{"name": name} for name in ("q", "k", "v", "e0", "e1", "e2", "huge", "norm")]
    writes = {"q": ["qkv"], "k": ["qkv"], "v": ["qkv"], "e0": ["w13"], "e1": ["w13"], "e2": ["w13"],
              "huge": ["big"], "norm": ["n"]}
    sizes = {"qkv": 30, "w13": 60, "big": 500, "n": 1}
    groups = check_groups(tensors, writes, sizes.__getitem__, 100)
    # a parameter counts once however many tensors fill it; one over the bound goes alone
    assert [([t["name"] for t in group], sorted(residents)) for group, residents in groups] == [
        (["q", "k", "v", "e0", "e1", "e2"], ["qkv", "w13"]), (["huge"], ["big"]), (["norm"], ["n"])]
    assert check_groups([], writes, sizes.__getitem__, 100) == []


class TestCaller:
    """wsync.vllm.runtime.engine.Caller: blocking calls into vLLM on one thread, watched."""

    def test_calls_run_in_order_on_one_thread_and_their_errors_come_back(self):
        import threading
        from wsync.vllm.runtime.engine import Caller
        caller = Caller(lambda: None)
        threads = {caller("a", threading.get_ident), caller("b", threading.get_ident)}
        assert len(threads) == 1 and threading.get_ident() not in threads
        assert caller("sum", lambda: 1 + 2) == 3
        with pytest.raises(ZeroDivisionError):
            caller("bad", lambda: 1 / 0)

    def test_a_call_into_a_dead_engine_fails_at_once_naming_what_died(self):
        import threading
        import time
        from wsync.vllm.runtime.engine import Caller
        died = threading.Event()
        caller = Caller(lambda: "vLLM's EngineCore (pid 9) died" if died.is_set() else None)
        threading.Timer(0.3, died.set).start()
        started = time.monotonic()
        with pytest.raises(Failure) as failed:
            caller("load_chunk", lambda: time.sleep(10))  # (an answer that does not come in time)
        assert failed.value.code == "ENGINE_DIED" and failed.value.fatal
        assert failed.value.message == "vLLM's EngineCore (pid 9) died during load_chunk"
        assert time.monotonic() - started < 5


def test_the_engines_timing_summary_gives_medians_the_workers_parts_and_the_first_call():
    from wsync.vllm.runtime.engine import VllmEngine
    engine = VllmEngine.__new__(VllmEngine)  # (no vLLM: only the summary's bookkeeping)
    engine.channel = "socket"
    engine._timing = {"start_update": [(0.010, 0.009, {"fingerprint": 0.004, "loader": 0.005}),
                                       (0.002, 0.001, {"fingerprint": 0.0004, "loader": 0.0005}),
                                       (0.003, 0.002, {"fingerprint": 0.0006, "loader": 0.0007})],
                      "finish_update": [(0.001, 0.0005, {})]}
    assert engine.timing_summary() == (
        "start_update x3: median 3.00 ms per call in the channel, 2.00 in the workers, fingerprint 0.60, loader "
        "0.70 (first 10.00, 9.00); finish_update x1: median 1.00 ms per call in the channel, 0.50 in the workers "
        "(first 1.00, 0.50)")


class TestFaultSpecs:
    """The one fault-spec grammar of the Python side (wsync.vllm.failure.fault_items), as the
    runtime's $WSYNC_RUNTIME_FAULT and the engine's $WSYNC_VLLM_FAULT read it."""

    def test_items_with_and_without_n(self):
        from wsync.vllm.failure import fault_items
        assert fault_items("crash@sleep,hang@load_chunk#2", ("crash", "hang"), "x") == [
            {"kind": "crash", "cmd": "sleep", "nth": None}, {"kind": "hang", "cmd": "load_chunk", "nth": 2}]

    @pytest.mark.parametrize("item", ["explode@sleep", "crash", "crash@", "crash@sleep#x", " crash@sleep",
                                      "worker0:crash@sleep", "crash@sle-ep"])
    def test_a_bad_item_is_refused_by_name(self, item):
        from wsync.vllm.runtime.server import Faults
        with pytest.raises(ValueError, match=f"bad fault spec item '{re.escape(item)}'"):
            Faults("hang@info," + item)

    def test_the_engines_faults_are_checked_at_its_start(self, monkeypatch):
        from wsync.vllm.runtime import engine
        monkeypatch.setenv("WSYNC_VLLM_FAULT", "kill_engine@load_chunk#2,bad_receipt@finish_update")
        assert engine._faults() == {"load_chunk#2": "kill_engine", "finish_update": "bad_receipt"}
        monkeypatch.setenv("WSYNC_VLLM_FAULT", "kill_engin@load_chunk#2")
        with pytest.raises(ValueError, match="bad vLLM fault 'kill_engin@load_chunk#2'"):
            engine._faults()
