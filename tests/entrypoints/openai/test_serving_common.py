"""RequestTimer: what the server's TTFT and ITL histograms observe, per sample of a request (E2E latency
comes from the engine's finished-request stats: test_server.py)."""

from types import SimpleNamespace

import pytest

from fp8serve.entrypoints.openai import serving_common
from fp8serve.entrypoints.openai.serving_common import RequestTimer
from fp8serve.outputs import CompletionOutput, RequestOutput


class Recorder:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)


def output(samples: list[tuple[int, str | None]], finished: bool = False) -> RequestOutput:
    """samples: (number of tokens, finish_reason) per sample index."""
    return RequestOutput("r", None, [1, 2], None,
                         [CompletionOutput(i, "", list(range(n)), None, None, reason)
                          for i, (n, reason) in enumerate(samples)], finished)


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(serving_common.time, "monotonic", lambda: now[0])
    return now


def test_one_sample(clock):
    metrics = SimpleNamespace(ttft=Recorder(), itl=Recorder())
    timer = RequestTimer(metrics, start=clock[0])
    clock[0] = 100.5
    timer.on_output(output([(1, None)]))
    clock[0] = 100.6
    timer.on_output(output([(4, None)]))  # three tokens at once (kept drafts): they share the gap
    clock[0] = 100.6
    timer.on_output(output([(4, None)]))  # nothing new: nothing observed
    clock[0] = 100.8
    timer.on_output(output([(5, "length")], finished=True))
    assert metrics.ttft.values == pytest.approx([0.5])
    assert metrics.itl.values == pytest.approx([0.1 / 3] * 3 + [0.2])


def test_every_sample_of_an_n_request_counts(clock):
    """n = 3: three TTFTs and each sample's own gaps (a sample that ends without a new token, e.g. on a
    stop string, adds none)."""
    metrics = SimpleNamespace(ttft=Recorder(), itl=Recorder())
    timer = RequestTimer(metrics, start=clock[0])
    clock[0] = 101.0
    timer.on_output(output([(1, None), (1, None), (0, None)]))  # the third sample has no token yet
    clock[0] = 101.5
    timer.on_output(output([(2, "stop"), (3, None), (1, None)]))
    clock[0] = 102.0
    timer.on_output(output([(2, "stop"), (3, "stop"), (2, "length")], finished=True))
    assert metrics.ttft.values == pytest.approx([1.0, 1.0, 1.5])
    assert metrics.itl.values == pytest.approx([0.5, 0.25, 0.25, 0.5])
