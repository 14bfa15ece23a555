"""Decode steps replayed as CUDA graphs (`compile=graph`), and the decode modes a step can run in.

A decode step of a small model is a few dozen tiny kernels: on a GPU its time is kernel launches and Python,
not arithmetic. Measured on an H100 for the small base's shape (dim 256, 8 blocks, vocabulary 8192): a
1-token step took 1.69 ms eager, 2.48 ms with default torch.compile, and 0.68 ms replayed as a CUDA graph
(fp32; 0.29 ms in bf16). `GraphedStep` captures a step function once per input signature and replays it:

- a top-level tensor argument is an input: copied into the graph's own static buffer before each replay;
- tensors inside a list are state the step updates in place (a cache's per-layer key/value buffers): the
  graph is captured on them, so their addresses are part of the signature (verify/backends/cache.py hands a
  new cache the buffers of a dropped one of the same shape, so decoding prompt after prompt reuses graphs);
- anything else (None, ints, tuples of ints) is part of the signature as it is.

The outputs of a replay are cloned out of the graph's static outputs, so a later replay never overwrites a
tensor a caller still holds. On a CPU there is nothing to capture: the same object runs the step eagerly on
its static buffers (`capture=False`), so signatures, copies and outputs are exercised by the CPU tests and
only the capture itself is CUDA-only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

MODES = (False, True, "graph")  # eager | torch.compile'd steps | steps replayed as CUDA graphs
WARMUP = 2  # eager runs on a side stream before a capture (lazy initialisation stays out of the graph)


def check_mode(value: Any, name: str = "compile") -> bool | str:
    """A decode mode: false (eager), true (torch.compile with static shapes) or graph (CUDA graphs)."""
    if not any(value is m or (isinstance(m, str) and value == m) for m in MODES):
        raise ValueError(f"{name}={value!r}: must be true, false or graph")
    return value


def _signature(args: tuple) -> tuple:
    key = []
    for a in args:
        if isinstance(a, Tensor):
            key.append(("input", tuple(a.shape), a.dtype, a.device))
        elif isinstance(a, list):
            key.append(("state", tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in a)))
        else:
            key.append(a)
    return tuple(key)


def _clone(out: Any) -> Any:
    if isinstance(out, Tensor):
        return out.clone()
    return tuple(_clone(o) for o in out)


@dataclass
class _Captured:
    args: tuple  # the arguments the step runs on: static input buffers, the state lists, the rest as given
    inputs: list[tuple[int, Tensor]]  # (argument index, static buffer) of every input tensor
    graph: Any  # torch.cuda.CUDAGraph, or None where nothing was captured (CPU)
    outputs: Any  # the graph's static outputs (None without a graph)


class GraphedStep:
    """`step(*args)` with static shapes -> the same outputs, replayed from one CUDA graph per signature.

    `capture=None` captures where the state tensors live on a GPU; `max_graphs` bounds how many are kept (the
    least recently used is dropped: each holds its own memory pool). `captures` and `capture_s` count the
    graphs captured and the seconds spent capturing, reported apart from decoding like compile time."""

    def __init__(self, step: Callable[..., Any], *, capture: bool | None = None, max_graphs: int = 64):
        self.step, self.capture, self.max_graphs = step, capture, max_graphs
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.captures, self.capture_s = 0, 0.0

    @torch.inference_mode()
    def __call__(self, *args: Any) -> Any:
        key = _signature(args)
        entry = self.graphs.get(key)
        if entry is None:
            return self._capture(key, args)
        self.graphs.move_to_end(key)
        for i, buffer in entry.inputs:
            buffer.copy_(args[i])
        if entry.graph is None:
            return self.step(*entry.args)
        entry.graph.replay()
        return _clone(entry.outputs)

    def _capture(self, key: tuple, args: tuple) -> Any:
        start = time.perf_counter()
        inputs = [(i, a.clone()) for i, a in enumerate(args) if isinstance(a, Tensor)]
        static = list(args)
        for i, buffer in inputs:
            static[i] = buffer
        static = tuple(static)
        on_gpu = any(isinstance(a, Tensor) and a.is_cuda for a in args)
        capture = on_gpu if self.capture is None else self.capture
        if not capture:
            entry, out = _Captured(static, inputs, None, None), self.step(*static)
        else:
            entry = self._record(static, inputs)
            entry.graph.replay()  # capturing records kernels without running them
            out = _clone(entry.outputs)
            torch.cuda.synchronize()
        self.graphs[key] = entry
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return out

    def _record(self, static: tuple, inputs: list[tuple[int, Tensor]]) -> _Captured:
        # A step writes its new keys and values into the cache at the slots it is given; running it again
        # with the same inputs writes the same values, so the warm-up runs and the replay that follows the
        # capture leave the cache as one eager step would.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self.step(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.step(*static)
        return _Captured(static, inputs, graph, outputs)


def static_step(step: Callable[..., Any], mode: bool | str, *, options: dict | None = None) -> Callable[..., Any]:
    """`step` in a decode mode: as it is (false), torch.compile'd with static shapes (true), or a
    GraphedStep (graph). Callers of the last two pass whole cache buffers, so every call of a width has the
    same shapes."""
    check_mode(mode)
    if mode == "graph":
        return GraphedStep(step)
    if mode is True:
        return torch.compile(step, dynamic=False, options=options)
    return step
