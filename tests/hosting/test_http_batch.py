"""POST /v1/batch and the client's coalescer: batched calls mean exactly what single calls mean,
and the calls of many episodes stepping in the same loop tick travel in few requests."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from http_helpers import fault_task, http, metrics, start_server, wire_task

from steprl.hosting.client import RemoteEnv, RetryPolicy
from steprl.hosting.coalesce import Coalescers
from steprl.hosting.http_backend import HttpEnvBackend
from steprl.hosting.protocol import MAX_BATCH_CALLS, NDJSON


@pytest.fixture(scope="module")
def server():
    with start_server(max_instances=64, handler_timeout_s=2.0) as s:
        yield s


def _create(c: httpx.Client, **params: Any) -> str:
    r = c.post("/v1/envs", json={"env": "fault_count", "params": params})
    assert r.status_code == 200, r.text
    instance_id: str = r.json()["instance_id"]
    return instance_id


def _batch(c: httpx.Client, *calls: tuple[str, str, dict[str, Any]]) -> list[dict[str, Any]]:
    r = c.post("/v1/batch", json={"calls": [{"instance_id": i, "op": op, "body": b} for i, op, b in calls]})
    assert r.status_code == 200, r.text
    results: list[dict[str, Any]] = r.json()["results"]
    assert len(results) == len(calls)
    return results


def _single(c: httpx.Client, instance_id: str, op: str, body: dict[str, Any]) -> dict[str, Any]:
    if op == "close":
        r = c.delete(f"/v1/envs/{instance_id}")
    else:
        r = c.post(f"/v1/envs/{instance_id}/{op}", json=body)
    return {"status": r.status_code, "body": r.json()}


def _shape(result: dict[str, Any]) -> tuple[int, Any]:
    """Status and answer, or status and error type (messages name the instance)."""
    body = result["body"]
    return result["status"], body["error"]["type"] if "error" in body else body


def test_batched_calls_answer_what_the_single_routes_answer(server):
    reset = {"task": wire_task(), "seed": 0}
    script = [
        ("step", {"action": "a", "seq": 1}),  # before reset: 409 not_reset
        ("reset", reset),
        ("step", {"action": "a", "seq": 1}),
        ("step", {"action": "a", "seq": 1}),  # a repeat: the cached answer
        ("step", {"action": "b", "seq": 3}),  # out of order: 409 seq_conflict
        ("step", {"action": "b"}),  # no seq: 422
        ("step", {"action": "b", "seq": 2}),  # the episode (length 2) ends
        ("step", {"action": "c", "seq": 3}),  # 409 episode_over
        ("close", {}),
        ("close", {}),  # closing twice is fine
        ("step", {"action": "c", "seq": 3}),  # 409 instance_closed
    ]
    with http(server) as c:
        one, many = _create(c, episode_len=2), _create(c, episode_len=2)
        singles = [_single(c, one, op, body) for op, body in script]
        batched = [_batch(c, (many, op, body))[0] for op, body in script]
    assert [_shape(r) for r in batched] == [_shape(r) for r in singles]
    assert [r["status"] for r in batched] == [409, 200, 200, 200, 409, 422, 200, 409, 200, 200, 409]


def test_a_duplicate_step_in_one_batch_and_across_batches_is_applied_once(server):
    with http(server) as c:
        a, b = _create(c, episode_len=5), _create(c, episode_len=5)
        replayed0 = metrics(server)["steps_replayed"]
        _batch(
            c, (a, "reset", {"task": wire_task(), "seed": 0}), (b, "reset", {"task": wire_task(), "seed": 0})
        )
        step1 = {"action": "x", "seq": 1}
        first = _batch(c, (a, "step", step1), (a, "step", step1), (b, "step", step1))
        assert [r["body"]["observation"] for r in first] == ["applied 1", "applied 1", "applied 1"]
        again = _batch(c, (a, "step", step1), (b, "step", {"action": "y", "seq": 2}))
        assert again[0] == first[0] and again[1]["body"]["observation"] == "applied 2"
        assert metrics(server)["steps_replayed"] == replayed0 + 2
        closed = _batch(c, (a, "close", {}), (b, "close", {}))
        assert [r["status"] for r in closed] == [200, 200]


def test_mixed_items_get_their_own_status_and_the_batch_is_200(server):
    with http(server) as c:
        ok = _create(c, episode_len=3)
        _single(c, ok, "reset", {"task": wire_task(), "seed": 0})
        results = _batch(
            c,
            (ok, "step", {"action": "x", "seq": 1}),
            ("0123456789abcdef", "step", {"action": "x", "seq": 1}),
            (ok, "step", {"action": "x", "seq": 1, "extra": True}),
            ("0123456789abcdef", "close", {}),
        )
        assert [_shape(r)[0] for r in results] == [200, 404, 422, 404]
        assert [_shape(r)[1] for r in results[1:]] == ["not_found", "validation_error", "not_found"]
        assert results[0]["body"]["observation"] == "applied 1"
        assert _batch(c, (ok, "close", {}))[0]["status"] == 200
        # The batch itself: the same auth and body validation as every route.
        assert httpx.post(f"{server.url}/v1/batch", json={"calls": []}, trust_env=False).status_code == 401
        assert c.post("/v1/batch", json={"calls": []}).status_code == 422
        too_many = [{"instance_id": ok, "op": "close", "body": {}}] * (MAX_BATCH_CALLS + 1)
        assert c.post("/v1/batch", json={"calls": too_many}).status_code == 422
        assert c.post("/v1/batch", json={"calls": [{"instance_id": ok, "op": "fly"}]}).status_code == 422


async def _episodes(backend: HttpEnvBackend, n: int, steps: int) -> list[list[str]]:
    async def one(i: int) -> list[str]:
        env = backend.make_env(fault_task(i=i))
        try:
            out = [(await env.reset(fault_task(i=i), i)).text]
            for k in range(steps):
                out.append((await env.step(f"a{k}")).observation)
            return out
        finally:
            await env.close()

    return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.parametrize("coalesce", [True, False])
def test_episodes_stepping_together_share_few_requests(server, coalesce):
    n, steps = 32, 4
    retry = RetryPolicy(max_attempts=3, base_s=0.01)
    backend = HttpEnvBackend(
        server.url, server.token, "fault_count", {"episode_len": 10}, retry=retry, coalesce=coalesce
    )
    before = metrics(server)
    got = asyncio.run(_episodes(backend, n, steps))
    after = metrics(server)
    assert got == [[f"ready fault_count-{i}"] + [f"applied {k + 1}" for k in range(steps)] for i in range(n)]
    calls = n * (steps + 3)  # create, reset, steps, close per episode
    requests = after["requests"] - before["requests"] - 1  # less the metrics request itself
    batched = after["batch_calls"] - before["batch_calls"]
    if coalesce:
        assert batched == calls
        # Every episode steps in the same tick: about one request per round.
        assert requests <= 2 * (steps + 3), requests
        assert backend.coalescers is not None and backend.coalescers.batches_sent == requests
    else:
        assert batched == 0 and requests == calls
    assert after["instances_live"] == before["instances_live"]


def test_batched_creates_answer_what_the_create_route_answers(server):
    with http(server) as c:
        good, unknown, bad_params = (
            {"env": "fault_count", "params": {"episode_len": 1}},
            {"env": "no_such_env"},
            {"env": "fault_count", "params": {"no_such_param": 1}},
        )
        singles = [c.post("/v1/envs", json=b) for b in (good, unknown, bad_params)]
        batched = _batch(c, ("", "create", good), ("", "create", unknown), ("", "create", bad_params))
        assert [r["status"] for r in batched] == [r.status_code for r in singles] == [200, 422, 422]
        assert [_shape(r)[1] for r in batched[1:]] == [r.json()["error"]["type"] for r in singles[1:]]
        for instance_id in (singles[0].json()["instance_id"], batched[0]["body"]["instance_id"]):
            assert c.delete(f"/v1/envs/{instance_id}").status_code == 200


def test_a_batch_over_the_body_cap_is_split_not_failed():
    with start_server(max_body_bytes=4096) as srv:
        backend = HttpEnvBackend(srv.url, srv.token, "fault_count", {"episode_len": 3})

        async def two() -> list[str]:
            envs = [backend.make_env(fault_task(i=i)) for i in range(2)]
            try:
                await asyncio.gather(*(e.reset(fault_task(i=i), i) for i, e in enumerate(envs)))
                big = "x" * 3000  # one step fits under the cap, two in one batch do not
                return [t.observation for t in await asyncio.gather(*(e.step(big) for e in envs))]
            finally:
                await asyncio.gather(*(e.close() for e in envs))

        assert asyncio.run(two()) == ["applied 1", "applied 1"]
        # create, reset, the refused pair of steps and its two halves, close
        assert backend.coalescers is not None and backend.coalescers.batches_sent == 6


def _ready(c: httpx.Client, env: str, **params: Any) -> str:
    r = c.post("/v1/envs", json={"env": env, "params": params})
    assert r.status_code == 200, r.text
    instance_id: str = r.json()["instance_id"]
    assert _single(c, instance_id, "reset", {"task": wire_task(env), "seed": 0})["status"] == 200
    return instance_id


def test_a_batch_of_steps_with_a_hung_and_a_raising_env_answers_each_as_its_route_would(server):
    """The step lane (one thread group, one deadline): the hung step is 504 and its instance
    destroyed, the raising one 500 and broken, every other step applied once."""
    with http(server) as c:
        quick = [_ready(c, "fault_count", episode_len=5) for _ in range(6)]
        hung = _ready(c, "fault_sleep", where="step", close_wakes=True)
        raising = _ready(c, "fault_raise", where="step")
        ids = [quick[0], hung, *quick[1:3], raising, *quick[3:]]  # the hung one blocks a drainer
        before = metrics(server)
        results = _batch(c, *((i, "step", {"action": "x", "seq": 1}) for i in ids))
        after = metrics(server)
        shapes = [_shape(r) for r in results]
        assert shapes[1] == (504, "handler_timeout") and shapes[4] == (500, "env_error")
        quick_answers = [r for i, r in zip(ids, results, strict=True) if i in quick]
        assert [r["body"]["observation"] for r in quick_answers] == ["applied 1"] * 6
        assert after["instances_destroyed"] == before["instances_destroyed"] + 1
        assert (
            _single(c, hung, "step", {"action": "x", "seq": 2})["body"]["error"]["type"] == "instance_closed"
        )
        assert (
            _single(c, raising, "step", {"action": "x", "seq": 2})["body"]["error"]["type"]
            == "instance_broken"
        )
        # the quick ones go on, one step at a time, with nothing applied twice
        again = _batch(c, *((i, "step", {"action": "y", "seq": 2}) for i in quick))
        assert [r["body"]["observation"] for r in again] == ["applied 2"] * 6
        _batch(c, *((i, "close", {}) for i in [*quick, raising]))
        assert after["batch_results_by_status"]["504"] >= 1


def test_steps_past_the_thread_limit_are_503_with_retry_after():
    with start_server(max_instances=8, max_threads=2, handler_timeout_s=2.0) as srv, http(srv) as c:
        hung = [_ready(c, "fault_sleep", where="step", close_wakes=True) for _ in range(2)]
        quick = _ready(c, "fault_count", episode_len=5)
        results = _batch(c, *((i, "step", {"action": "x", "seq": 1}) for i in [*hung, quick]))
        assert [_shape(r) for r in results] == [(504, "handler_timeout")] * 2 + [(503, "server_busy")]
        assert "Retry-After" in results[2]["headers"]


@pytest.mark.parametrize("plain_http", [True, False], ids=["keep-alive client", "httpx"])
def test_a_slow_step_does_not_hold_back_the_answer_batched_with_it(server, plain_http):
    """Both steps travel in one batch; the server streams each answer as it is final, so the
    quick episode goes on while the slow env is still working."""
    coalescers = Coalescers(plain_http=plain_http)
    slow = RemoteEnv(
        server.url,
        server.token,
        "fault_sleep",
        {"where": "step", "seconds": 1.0},
        coalescers=coalescers,
    )
    quick = RemoteEnv(server.url, server.token, "fault_count", {"episode_len": 5}, coalescers=coalescers)

    async def go() -> tuple[float, bool, float, str, str]:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(slow.reset(fault_task("fault_sleep"), 0), quick.reset(fault_task(), 0))
            sent = coalescers.batches_sent
            t0 = loop.time()
            slow_step = asyncio.ensure_future(slow.step("a"))
            quick_step = asyncio.ensure_future(quick.step("a"))
            quick_answer = await quick_step
            quick_at, slow_pending = loop.time() - t0, not slow_step.done()
            slow_answer = await slow_step
            assert coalescers.batches_sent == sent + 1  # one batch carried both steps
            return quick_at, slow_pending, loop.time() - t0, quick_answer.observation, slow_answer.observation
        finally:
            await asyncio.gather(slow.close(), quick.close())

    quick_at, slow_pending, slow_at, quick_obs, slow_obs = asyncio.run(go())
    assert quick_obs == slow_obs == "applied 1"
    assert slow_pending and quick_at < 0.6 and slow_at >= 0.9


def _streamed(text: str) -> list[dict[str, Any]]:
    """The results of a streamed answer: one JSON array per line (per burst)."""
    return [item for line in text.splitlines() for item in json.loads(line)]


def test_a_streamed_batch_answers_what_the_batch_answers(server):
    """Accept: application/x-ndjson gets the results as lines of arrays, each result with its
    call's index and equal to what the call gets in the answer that is not streamed."""
    shapes = {}
    with http(server) as c:
        for accept in ("application/json", NDJSON):
            ok = _create(c, episode_len=3)
            _single(c, ok, "reset", {"task": wire_task(), "seed": 0})
            calls = [
                {"instance_id": ok, "op": "step", "body": {"action": "x", "seq": 1}},
                {"instance_id": "0123456789abcdef", "op": "step", "body": {"action": "x", "seq": 1}},
                {"instance_id": ok, "op": "step", "body": {"action": "x", "seq": 1, "extra": True}},
                {"instance_id": "", "op": "create", "body": {"env": "no_such_env"}},
                {"instance_id": ok, "op": "close", "body": {}},
            ]
            r = c.post("/v1/batch", json={"calls": calls}, headers={"Accept": accept})
            assert r.status_code == 200
            if accept == NDJSON:
                assert r.headers["content-type"] == NDJSON
                lines = _streamed(r.text)
                by_index = {line.pop("index"): line for line in lines}
                assert sorted(by_index) == list(range(len(calls)))
                results = [by_index[i] for i in range(len(calls))]
            else:
                results = r.json()["results"]
            shapes[accept] = [_shape(x) for x in results]
    assert shapes["application/json"] == shapes[NDJSON]
    assert [status for status, _ in shapes[NDJSON]] == [200, 404, 422, 422, 200]


def test_a_quick_streamed_batch_comes_in_one_piece_and_a_slow_one_in_chunks(server):
    with http(server) as c:
        quick = [_ready(c, "fault_count", episode_len=5) for _ in range(4)]
        slow = _ready(c, "fault_sleep", where="step", seconds=0.3)
        step = {"action": "x", "seq": 1}
        at_once = c.post(
            "/v1/batch",
            json={"calls": [{"instance_id": i, "op": "step", "body": step} for i in quick]},
            headers={"Accept": NDJSON},
        )
        assert "content-length" in at_once.headers and "transfer-encoding" not in at_once.headers
        assert len(at_once.text.splitlines()) == 1  # one burst, one line
        indices = [x["index"] for x in _streamed(at_once.text)]
        assert indices == [0, 1, 2, 3]  # in call order, as an answer that is not streamed
        step2 = {"action": "x", "seq": 2}
        calls = [{"instance_id": i, "op": "step", "body": step2} for i in quick]
        streamed = c.post(
            "/v1/batch",
            json={"calls": [{"instance_id": slow, "op": "step", "body": step}, *calls]},
            headers={"Accept": NDJSON},
        )
        assert streamed.headers.get("transfer-encoding") == "chunked"
        bursts = [[x["index"] for x in json.loads(line)] for line in streamed.text.splitlines()]
        assert bursts == [[1, 2, 3, 4], [0]]  # the quick ones together, the slow call's answer last
        _batch(c, *((i, "close", {}) for i in [*quick, slow]))


def test_finished_event_loops_are_not_kept_alive(server):
    """The trainer runs one asyncio.run per rollout phase: each loop's coalescer (and its
    transport) must go with the loop, not pile up for the whole run."""
    import gc

    backend = HttpEnvBackend(server.url, server.token, "fault_count", {"episode_len": 3})

    async def phase() -> None:
        envs = [backend.make_env(fault_task(i=i)) for i in range(4)]
        await asyncio.gather(*(e.reset(fault_task(i=i), i) for i, e in enumerate(envs)))
        await asyncio.gather(*(e.close() for e in envs))

    for _ in range(3):
        asyncio.run(phase())
    gc.collect()
    assert backend.coalescers is not None and backend.coalescers.loops_alive() == 0
