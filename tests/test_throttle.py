"""A client in a loop of refused requests is answered ever more slowly; good requests and other clients never wait."""

import time

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from draftsmith.serve.throttle import ErrorScore, ThrottleRefusals


def test_the_first_refusals_are_free_then_each_adds_a_step_up_to_the_cap():
    scores = ErrorScore(free=3, step=0.1, most=0.25, tau=60)
    delays = [scores.refused("a", now=0.0) for _ in range(7)]
    assert delays[:3] == [0.0, 0.0, 0.0]
    assert delays[3:] == [0.1, 0.2, 0.25, 0.25]
    assert scores.refused("b", now=0.0) == 0.0  # another client starts from nothing


def test_a_client_that_stops_is_forgiven():
    scores = ErrorScore(free=3, step=0.1, most=1.0, tau=10)
    for _ in range(10):
        scores.refused("a", now=0.0)
    assert scores.refused("a", now=0.0) > 0
    assert scores.refused("a", now=100.0) == 0.0  # ten time constants later its score has decayed


def test_refusals_are_held_back_and_good_answers_are_not():
    async def bad(request):
        return PlainTextResponse("no", status_code=400)

    async def good(request):
        return PlainTextResponse("yes")

    app = ThrottleRefusals(Starlette(routes=[Route("/bad", bad), Route("/good", good)]), ErrorScore(free=2, step=0.2))
    client = TestClient(app)
    start = time.perf_counter()
    assert [client.get("/bad").status_code for _ in range(2)] == [400, 400]
    assert time.perf_counter() - start < 0.15  # the free ones
    start = time.perf_counter()
    assert client.get("/bad").status_code == 400
    assert time.perf_counter() - start >= 0.2
    start = time.perf_counter()
    assert client.get("/good").text == "yes"
    assert time.perf_counter() - start < 0.15  # the same client's good request is answered at once
