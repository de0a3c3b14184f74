"""CUDA graphs of the LM head's GEMM, for the calls vLLM makes outside its own graphs.

vLLM replays the model forward as CUDA graphs but computes the logits after the replay, in
eager mode, once per decode step. There the host cost of a Triton launch (argument binding,
the kernel and tile choice, split-K scratch and its reduction) is paid on every step: 75-150
us against cuBLAS's 15 us on an H200. `HeadGraphs` records each head call once per number of
rows M (at its first use) and then replays it: one copy of x into a static input, one replay.

The logits of a replayed call live in a buffer the head owns, so they are overwritten by the
head's next call. That is the contract of vLLM's own graphed forward, whose hidden states
the next replay overwrites; vLLM consumes the logits (sampling, logprobs) before it computes
any more. Calls inside a graph capture (vLLM's or a test's) and calls with more than MAX_ROWS
rows launch the kernels directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Decode sizes up to this many rows get a graph each (vLLM's default max_num_seqs is 256);
#: prefill-sized calls are rare (prompt logprobs) and launch directly.
MAX_ROWS = 256
#: Smallest output buffer, in rows: buffers grow in powers of two up to MAX_ROWS.
MIN_BUFFER_ROWS = 16

#: launch(x [m, cols], out [m, rows]) -> None: writes the logits of x into out.
Launch = Callable[[torch.Tensor, torch.Tensor], None]


class HeadGraphs:
    """One table's head calls, recorded per number of rows and replayed."""

    def __init__(self) -> None:
        #: rows of x -> (the graph, its static input x [m, cols], its output [m, rows]).
        self._recorded: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._key: tuple | None = None
        self._x: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._pool = None
        self._stream: torch.cuda.Stream | None = None

    def logits(
        self, launch: Launch, key: tuple, x2: torch.Tensor, rows: int
    ) -> torch.Tensor | None:
        """The logits [m, rows] of x2 [m, cols] through a replayed graph, or None where a graph
        does not apply (the caller launches directly). `key` names everything the recorded
        kernels read besides x (the table's storage, x's dtype): a new key records anew."""
        if torch.cuda.is_current_stream_capturing():
            return None
        m = x2.shape[0]
        recorded = self._recorded.get(m) if key == self._key else None
        if recorded is None:
            if not 0 < m <= MAX_ROWS:
                return None
            if key != self._key or self._out.shape[0] < m:
                self._reset(key, x2, rows, m)
            recorded = self._recorded[m] = self._record(launch, m)
        graph, x, out = recorded
        x.copy_(x2)
        graph.replay()
        return out

    def _reset(self, key: tuple, x2: torch.Tensor, rows: int, m: int) -> None:
        """New static buffers (large enough for m rows) and no graphs: they read the old ones."""
        self._recorded.clear()
        # A pool whose graphs are all gone is released: the next graphs need a new one.
        self._pool = torch.cuda.graph_pool_handle()
        if self._stream is None:
            self._stream = torch.cuda.Stream(x2.device)
        capacity = min(MAX_ROWS, max(MIN_BUFFER_ROWS, 1 << (m - 1).bit_length()))
        self._key = key
        self._x = x2.new_zeros((MAX_ROWS, x2.shape[1]))
        self._out = x2.new_empty((capacity, rows))

    def _record(self, launch: Launch, m: int):
        x, out = self._x[:m], self._out[:m]
        caller = torch.cuda.current_stream()
        self._stream.wait_stream(caller)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            launch(x, out)  # compiles the kernels and fills the allocator outside the capture
            # Not torch.cuda.graph(): it collects garbage and empties the cache per capture.
            # thread_local: vLLM's other threads may touch CUDA while this captures.
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                launch(x, out)
            finally:
                graph.capture_end()
        caller.wait_stream(self._stream)
        return graph, x, out
