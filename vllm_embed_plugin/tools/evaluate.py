"""Fidelity of table formats on a real model: how far the next-token distributions move when
only the token table is replaced by dequantize(quantize(table)).

The evaluation text comes in domains (by default the packaged held-out code, technical prose
and chat, `data/heldout/`; or one file per `--corpus`), and `windows` windows of `window`
tokens are spread over each. For every position the reference is the model itself in float32
on the CPU. Two modes per format:

- input: the lookup reads the lossy table, the LM head keeps the original table;
- tied:  the same lossy table also produces the logits (as a tied model stores it once).

Reported per mode, per domain and over all of them: mean and 99th percentile of the per-token
KL(P_ref || P_quant) in nats, top-1 agreement with the reference, and the spread of the mean
across windows; then the targets (ratios against llama.cpp's formats, window by window too).
The body runs once per format (with the lossy input table); both logit sets come from its
final hidden states h_q: input = h_q @ W^T, tied = h_q @ W_q^T. At most one lossy float32
table exists at a time besides the original.

Rows are plugin formats (`TableFormat`), plain or with a column importance (`importance.py`:
a calibration file, `--importance`, or else measured here as `vllm-embed-plugin calibrate`
measures it by default, on the packaged calibration corpus, which shares no text with the
held-out domains), llama.cpp reference formats through the `gguf` package's reference
quantizers, and one experiment computed here only: "outlier rows" (the rows with the largest
error kept at 8 bits).

    python -m vllm_embed_plugin.tools.evaluate --model smollm2 --model gemma3-270m --out docs/FIDELITY.md
    vllm-embed-plugin eval --model DIR --importance DIR.safetensors --corpus mine.txt --out mine.md

This module never imports vLLM; transformers, gguf and tqdm (the `eval` extra) are imported
where they are used.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import math
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from .. import importance
from ..convert import row_chunks
from ..formats import Fp8Format, IntFormat, TableFormat
from . import DATA_DIR, ToolError, calibrate, progress_bar, real_models, run_command
from .fidelity_data import Candidate, ModeStats, Result, Roundtrip, mode_stats
from .fidelity_report import ModelReport, Section, render_markdown

__all__ = [
    "Candidate",
    "FidelityRun",
    "ModeStats",
    "Result",
    "SECTIONS",
    "degrid",
    "evaluate_model",
    "grid",
    "identity_row",
    "llama_cpp_row",
    "main",
    "outlier_row",
    "plugin_row",
]

#: Tokens per evaluation window, and windows spread over each domain's text.
DEFAULT_WINDOW = 256
DEFAULT_WINDOWS = 3
#: The packaged evaluation texts, one per domain, none of them part of the calibration corpus
#: (data/README.md).
HELDOUT_FILES = tuple(
    DATA_DIR / "heldout" / f"{name}.txt" for name in ("code", "prose", "chat", "de", "ru")
)
#: Columns the "shifted" rows move the block grid by (half a Q8_0 block).
SHIFT = 16
#: Bound on each float32 logits chunk [positions, vocab] (several live at once).
LOGIT_CHUNK_BYTES = 256 << 20
#: Reference log-probabilities are kept between formats when they fit in this many bytes.
REFERENCE_CACHE_BYTES = 3 << 30


# -- rows of the table -------------------------------------------------------------------------


def _roll(t: torch.Tensor, shift: int) -> torch.Tensor:
    return t if shift == 0 else torch.roll(t, -shift, dims=-1)


def _unroll(t: torch.Tensor, shift: int) -> torch.Tensor:
    return t if shift == 0 else torch.roll(t, shift, dims=-1)


def _chunked(table: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn applied to row chunks of `table` (bounded transient), into a new float32 table."""
    out = torch.empty(table.shape, dtype=torch.float32)
    for rows in row_chunks(*table.shape):
        out[rows] = fn(table[rows])
    return out


def _format_label(fmt: TableFormat) -> str:
    group = "row" if fmt.group_size is None else f"g{fmt.group_size}"
    if isinstance(fmt, Fp8Format):
        return f"fp8 e4m3 {group}"
    kind = "sym" if fmt.symmetric else "affine"
    search = f" search {fmt.search}" if getattr(fmt, "search", 0) else ""
    return f"int{fmt.bits} {kind} {group}{search}"


def _plugin_roundtrip(
    fmt: TableFormat, cols: int, shift: int, role: importance.Role | None = None
) -> Roundtrip:
    def roundtrip(table: torch.Tensor, measured: importance.Calibration) -> torch.Tensor:
        weights = None
        if role is not None:
            if shift:
                measured = importance.Calibration(
                    *(
                        None if m is None else torch.roll(m, (-shift, -shift), dims=(0, 1))
                        for m in (measured.second_moment, measured.input_fisher)
                    )
                )
            weights = importance.for_role(measured, role)

        def one(chunk: torch.Tensor) -> torch.Tensor:
            packed = fmt.quantize(_roll(chunk, shift), weights)
            return _unroll(fmt.dequantize(packed, cols, torch.float32), shift)

        return _chunked(table, one)

    return roundtrip


def plugin_row(
    fmt: TableFormat,
    cols: int,
    *,
    shift: int = 0,
    role: importance.Role | None = None,
    label: str | None = None,
) -> Candidate:
    """A plugin format. `shift` moves its groups off column 0 (the honest test on a table
    that was stored on aligned blocks before); `role` passes the measured importance as the
    plugin would for a table used that way: "tied" and "head" search the scales and round each
    row jointly against it (GPTQ), "lookup" (an untied table) ignores it. IntFormat only."""
    if role is not None and not isinstance(fmt, IntFormat):
        raise ValueError("only IntFormat takes an importance")
    if label is None:
        label = _format_label(fmt) + (", importance-weighted" if role else "")
        label += ", rows rounded jointly" if role in ("tied", "head") else ""
        label += f", shifted {shift}" if shift else ""
    roundtrip = _plugin_roundtrip(fmt, cols, shift, role)
    return Candidate(label, fmt.bits_per_weight(cols), roundtrip)


def identity_row(cols: int) -> Candidate:
    """The table itself (KLD exactly 0): a check of the measurement."""
    return Candidate("identity (check)", 16.0, lambda t, _: t.clone(), kind="experiment")


def llama_cpp_row(type_name: str, cols: int, *, shift: int = 0) -> Candidate:
    """llama.cpp's reference quantizer `type_name` (Q8_0, Q4_0, ...) from the `gguf` package."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[type_name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    label = f"llama.cpp {type_name}" + (f", blocks shifted {shift}" if shift else "")
    bpw = type_size * 8 / block
    if cols % block:
        return Candidate(
            label, None, None, "llama.cpp", f"rows of {cols} are not a multiple of {block}"
        )
    try:
        gguf.quants.quantize(np.zeros((1, block), dtype=np.float32), qtype)
    except NotImplementedError:
        return Candidate(label, bpw, None, "llama.cpp", "gguf ships no quantizer for it")

    def one(chunk: torch.Tensor) -> torch.Tensor:
        data = _roll(chunk.float(), shift).numpy()
        back = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
        return _unroll(torch.from_numpy(np.ascontiguousarray(back)).reshape(chunk.shape), shift)

    return Candidate(label, bpw, lambda table, _: _chunked(table, one), "llama.cpp")


def outlier_row(
    base: IntFormat,
    share: float,
    cols: int,
    *,
    high: TableFormat | None = None,
    weighted: bool = False,
) -> Candidate:
    """Experiment (no such storage exists): the `share` of rows whose `base` error is largest
    (importance-weighted squared error) kept in `high` (default int8 symmetric group-32) instead.
    The cost counted: those rows at `high`'s bits instead of `base`'s, plus a 32-bit row index
    each."""
    high = high or IntFormat("int8", 8, 32)
    base_rt = _plugin_roundtrip(base, cols, 0, "lookup" if weighted else None)
    high_rt = _plugin_roundtrip(high, cols, 0)
    base_bpw = base.bits_per_weight(cols)
    bpw = base_bpw + share * (high.bits_per_weight(cols) - base_bpw + 32 / cols)

    def roundtrip(table: torch.Tensor, measured: importance.Calibration) -> torch.Tensor:
        lossy = base_rt(table, measured)
        weights = measured.second_moment.diagonal()
        err = torch.empty(table.shape[0])
        for part in row_chunks(*table.shape):
            err[part] = ((lossy[part] - table[part]).square() * weights).sum(1)
        rows = err.topk(max(1, round(share * table.shape[0]))).indices
        lossy[rows] = high_rt(table[rows], measured)
        return lossy

    label = (
        f"{_format_label(base)}{', importance-weighted' if weighted else ''} "
        f"+ {share:.0%} outlier rows in {_format_label(high)}"
    )
    return Candidate(label, bpw, roundtrip, "experiment")


def degrid(table: torch.Tensor, block: int = 32, seed: int = 0) -> torch.Tensor:
    """A copy of a table that was stored as Q8_0 (aligned `block`-column blocks, step
    max|x|/127), moved off that grid: uniform noise of +-half a step per element, then rounded
    to BF16. Statistically a table never quantized before, so no 8-bit format can profit from
    re-finding the old grid (which Q8_0 on blocks shifted by 16 columns still partly does: a
    shifted block holding an old block's largest value gets that block's step back)."""
    cols = table.shape[1]
    if cols % block:
        raise ValueError(f"rows of {cols} are not a multiple of {block}")
    gen = torch.Generator().manual_seed(seed)

    def off_grid(chunk: torch.Tensor) -> torch.Tensor:
        x = chunk.float().view(-1, cols // block, block)
        half_step = x.abs().amax(-1, keepdim=True) / 254
        noise = torch.rand(x.shape, generator=gen).mul_(2).sub_(1).mul_(half_step)
        return (x + noise).view(-1, cols).bfloat16().float()

    return _chunked(table, off_grid)


def grid(name: str, cols: int) -> list[Candidate]:
    """The rows of one table: "quick" (a smoke test), "anchors" (llama.cpp and the fork's
    formats), "full" (anchors, plugin candidates and the experiments), "8bit" (the 8-bit class
    for a de-gridded table)."""
    I = IntFormat  # noqa: E741
    s = 9  # candidate scales on each side, as llama.cpp's make_qx_quants (2 * 9 + 1)
    anchors = [
        llama_cpp_row("Q8_0", cols),
        llama_cpp_row("Q8_0", cols, shift=SHIFT),
        llama_cpp_row("Q6_K", cols),
        llama_cpp_row("Q5_1", cols),
        llama_cpp_row("Q5_0", cols),
        llama_cpp_row("Q5_K", cols),
        llama_cpp_row("Q4_1", cols),
        llama_cpp_row("Q4_0", cols),
        llama_cpp_row("Q4_K", cols),
        plugin_row(I("int8", 8, None), cols),
        plugin_row(Fp8Format("fp8", None), cols),
    ]
    if name == "quick":
        return [
            identity_row(cols),
            llama_cpp_row("Q8_0", cols, shift=SHIFT),
            plugin_row(I("int8", 8, 32), cols, shift=SHIFT),
            plugin_row(I("int4", 4, 64, symmetric=False, search=s), cols, role="lookup"),
            llama_cpp_row("Q4_0", cols),
        ]
    if name == "anchors":
        return anchors
    if name == "plugin":
        # The formats as the plugin ships them: plain, and with a column-importance file as
        # the plugin applies it to a tied table (search + joint rounding), beside llama.cpp's
        # at the same sizes.
        from ..formats import FORMATS, make_format

        def keyed(candidate: Candidate, key: str) -> Candidate:
            return dataclasses.replace(candidate, key=key)

        rows = [keyed(llama_cpp_row("Q8_0", cols, shift=SHIFT), "Q8_0 shifted")]
        for name, fmt in FORMATS.items():
            label = f"**{name}**: {_format_label(fmt)}"
            rows.append(keyed(plugin_row(fmt, cols, label=label), name))
            if isinstance(fmt, IntFormat):
                searched = make_format(name, weighted=True)
                # An untied table given a file is converted exactly as without one
                # (ColumnImportance.lookup_only): its row would repeat the plain one.
                tied = (
                    f"**{name} + importance, tied**: {_format_label(searched)}, "
                    "rows rounded jointly"
                )
                rows.append(
                    keyed(
                        plugin_row(searched, cols, role="tied", label=tied),
                        f"{name}+tied",
                    )
                )
        return rows + [keyed(llama_cpp_row(t, cols), t) for t in ("Q5_1", "Q4_0")]
    if name == "head":
        return head_rows(cols)
    if name == "8bit":
        return [
            llama_cpp_row("Q8_0", cols),
            plugin_row(I("int8", 8, 32), cols),
            plugin_row(I("int8", 8, 32, search=s), cols, role="lookup"),
            plugin_row(I("int8", 8, 64, symmetric=False, search=s), cols),
            plugin_row(I("int8", 8, 64, symmetric=False, search=s), cols, role="lookup"),
        ]
    if name != "full":
        raise KeyError(f"unknown grid {name!r}")
    return anchors + [
        # 8-bit class, groups shifted off the Q8_0 grid the tables were published on.
        plugin_row(I("int8", 8, 32), cols, shift=SHIFT),
        plugin_row(I("int8", 8, 32, search=s), cols, shift=SHIFT, role="lookup"),
        plugin_row(I("int8", 8, 64, symmetric=False, search=s), cols, shift=SHIFT, role="lookup"),
        plugin_row(I("int6", 6, None), cols),
        # 6-bit class
        plugin_row(I("int5", 5, 16, search=s), cols, role="lookup"),
        plugin_row(I("int5", 5, 32, symmetric=False, search=s), cols),
        plugin_row(I("int5", 5, 32, symmetric=False, search=s), cols, role="lookup"),
        outlier_row(I("int5", 5, 32, search=s), 0.15, cols, weighted=True),
        # 4-bit class
        plugin_row(I("int4", 4, 32, search=s), cols),
        plugin_row(I("int4", 4, 32, search=s), cols, role="lookup"),
        plugin_row(I("int4", 4, 64, symmetric=False, search=s), cols),
        plugin_row(I("int4", 4, 64, symmetric=False, search=s), cols, role="lookup"),
        outlier_row(I("int4", 4, 64, search=s), 0.05, cols, weighted=True),
    ]


def head_rows(cols: int) -> list[Candidate]:
    """The rows of an untied LM head (`head_format`): the plugin's integer formats with a
    calibration file, as the plugin converts a head (scale search and joint rounding against
    M), plain fp8, and llama.cpp's quantizers at the same sizes (Q6_K where the columns
    allow; llama.cpp stores `output.weight` as Q6_K in its K-quant mixes)."""
    from ..formats import FORMATS, make_format

    rows = []
    for name, fmt in FORMATS.items():
        if isinstance(fmt, IntFormat):
            searched = make_format(name, weighted=True)
            label = (
                f"**{name} + importance, head**: {_format_label(searched)}, rows rounded jointly"
            )
            row = plugin_row(searched, cols, role="head", label=label)
        else:
            row = plugin_row(fmt, cols, label=f"**{name}**: {_format_label(fmt)}")
        rows.append(dataclasses.replace(row, key=f"{name}+head"))
    anchors = [("Q8_0", SHIFT, "Q8_0 shifted"), ("Q6_K", 0, "Q6_K"), ("Q5_1", 0, "Q5_1")]
    anchors += [("Q4_0", 0, "Q4_0")]
    for type_name, shift, key in anchors:
        rows.append(dataclasses.replace(llama_cpp_row(type_name, cols, shift=shift), key=key))
    return rows


#: Grids whose rows are measured as an untied LM head (`FidelityRun.evaluate_head`).
HEAD_GRIDS = {"head"}

#: What `--grid` evaluates per model: (section title, rows, de-grid the table first).
SECTIONS = {
    "quick": [("Original table", "quick", False)],
    "anchors": [("Original table", "anchors", False)],
    "plugin": [("Original table", "plugin", False)],
    "head": [
        ("Untied LM head: the lookup exact, the lossy copy computes the logits", "head", False)
    ],
    "full": [
        ("Original table", "full", False),
        ("8-bit class on the de-gridded table", "8bit", True),
    ],
}


# -- measurement -------------------------------------------------------------------------------


def packaged_domains() -> dict[str, str]:
    """The held-out evaluation texts shipped with the package, by domain name."""
    return {path.stem: path.read_text(encoding="utf-8") for path in HELDOUT_FILES}


class FidelityRun:
    """One model and its evaluation texts: the reference pass, then `evaluate(candidate)` per
    row. The column importance comes from `measured` (a calibration file) or is measured on
    `calibration` text (default: the packaged calibration corpus) as `calibrate` measures it;
    it never sees the evaluation windows unless the same text is passed for both."""

    def __init__(
        self,
        model_path: str | Path,
        domains: Mapping[str, str] | str,
        *,
        window: int = DEFAULT_WINDOW,
        windows: int = DEFAULT_WINDOWS,
        measured: importance.Calibration | None = None,
        calibration: str | None = None,
        calibration_window: int = calibrate.DEFAULT_WINDOW,
        calibration_positions: int = calibrate.DEFAULT_POSITIONS,
        degrid_table: bool = False,
        progress: bool = True,
    ):
        """`domains`: name -> text (a bare text is one domain, "text"); `windows` windows of
        `window` tokens are spread over each. `degrid_table`: replace the model's token table by
        `degrid(table)` first (the reference included)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.progress = progress
        self.model_path = Path(model_path)
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        if isinstance(domains, str):
            domains = {"text": domains}
        #: The evaluation windows (1-D token tensors), their domain, and their positions.
        self.windows: list[torch.Tensor] = []
        self.window_domain: list[str] = []
        for name, text in domains.items():
            for ids in calibrate.spread_windows(tokenizer, text, window, windows):
                self.windows.append(ids)
                self.window_domain.append(name)
        self.domain_names = list(domains)
        self.bounds: list[tuple[int, int]] = []
        for ids in self.windows:
            start = self.bounds[-1][1] if self.bounds else 0
            self.bounds.append((start, start + len(ids)))
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        model.eval()
        self.model = model
        self.body = getattr(model, model.base_model_prefix)
        self.embedding = model.get_input_embeddings()
        self.table = self.embedding.weight.data  # the original, float32
        if degrid_table:
            self.table.copy_(degrid(self.table))
        self.head = model.get_output_embeddings().weight.data
        self.tied = self.head.data_ptr() == self.table.data_ptr()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.rows, self.cols = self.table.shape
        self.vocab = self.head.shape[0]
        self.chunk = max(1, LOGIT_CHUNK_BYTES // (self.vocab * 4))

        started = time.perf_counter()
        self.h_ref = self._hidden(self.table, "reference")
        self.positions = self.h_ref.shape[0]
        if measured is None:
            text = calibration
            if text is None:
                text = calibrate.default_corpus().read_text(encoding="utf-8")
            calib = calibrate.spread_windows(
                tokenizer, text, calibration_window, calibration_positions // calibration_window
            )
            measured = importance.Calibration(
                *calibrate.measure_model(model, calib, fisher=self.tied, progress=progress)
            )
            self.calibration_positions = calib.numel()
        else:
            self.calibration_positions = None
        if measured.cols != self.cols:
            raise importance.ImportanceError(
                f"the importance is {tuple(measured.second_moment.shape)}, but this table has "
                f"{self.cols} columns: it was measured on another model"
            )
        #: M = E[h h^T] of the final hidden state, and S where measured (importance.py).
        self.measured = measured
        self._check_logits()
        cache = self.positions * self.vocab * 4 <= REFERENCE_CACHE_BYTES
        self._ref_cache: list[torch.Tensor] | None = [] if cache else None
        self.ref_top = torch.empty(self.positions, dtype=torch.long)
        for s, lp in self._reference_chunks():
            self.ref_top[s : s + lp.shape[0]] = lp.argmax(-1)
        self.reference_seconds = time.perf_counter() - started

    def windows_of(self, domain: str) -> list[tuple[int, int]]:
        return [b for b, d in zip(self.bounds, self.window_domain) if d == domain]

    # A run keeps only the final hidden states of the reference, and its log-probabilities
    # when they are small; otherwise they are recomputed chunk by chunk for each format.
    def _reference_chunks(self):
        flat = self.h_ref
        for i, s in enumerate(range(0, self.positions, self.chunk)):
            if self._ref_cache is not None and i < len(self._ref_cache):
                yield s, self._ref_cache[i]
                continue
            lp = torch.log_softmax(self._logits(flat[s : s + self.chunk], self.head), -1)
            if self._ref_cache is not None:
                self._ref_cache.append(lp)
            yield s, lp

    def _logits(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        z = h @ weight.T
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    @torch.inference_mode()
    def _hidden(
        self, table: torch.Tensor, desc: str, windows: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Final hidden states [positions, cols] of `windows` (default: the evaluation windows,
        one after the other) with `table` as the input table."""
        original = self.embedding.weight.data
        self.embedding.weight.data = table
        try:
            out = []
            for ids in progress_bar(
                self.windows if windows is None else windows, desc, self.progress
            ):
                out.append(self.body(input_ids=ids[None]).last_hidden_state[0])
            return torch.cat(out)
        finally:
            self.embedding.weight.data = original

    @torch.inference_mode()
    def _check_logits(self) -> None:
        """The logits computed here must be the model's own (softcap, scaling, head)."""
        ids = self.windows[0][:64][None]
        theirs = self.model(input_ids=ids).logits[0]
        ours = self._logits(self.h_ref[: ids.shape[1]], self.head)
        if not torch.allclose(theirs, ours, atol=1e-3, rtol=1e-3):
            raise RuntimeError(
                "final hidden states @ head^T do not reproduce the model's logits; "
                "this architecture needs support in evaluate.py"
            )

    @torch.inference_mode()
    def evaluate(self, candidate: Candidate) -> Result:
        if candidate.roundtrip is None:
            return Result(candidate)
        started = time.perf_counter()
        lossy = candidate.roundtrip(self.table, self.measured)
        h_q = self._hidden(lossy, candidate.label)
        modes = {"input": self.head}
        if self.tied:
            modes["tied"] = lossy
        kld = {m: torch.empty(self.positions) for m in modes}
        agree = {m: torch.empty(self.positions, dtype=torch.bool) for m in modes}
        for s, lp_ref in progress_bar(
            list(self._reference_chunks())
            if self._ref_cache is not None
            else self._reference_chunks(),
            "logits",
            self.progress,
            total=math.ceil(self.positions / self.chunk),
        ):
            p_ref = lp_ref.exp()
            e = s + lp_ref.shape[0]
            for mode, weight in modes.items():
                z = self._logits(h_q[s:e], weight)
                agree[mode][s:e] = z.argmax(-1) == self.ref_top[s:e]
                lp = torch.log_softmax(z, -1)
                del z
                kld[mode][s:e] = lp.neg_().add_(lp_ref).mul_(p_ref).sum(-1)
                del lp
        del lossy
        stats = {m: mode_stats(kld[m], agree[m], self.bounds) for m in modes}
        domains = {}
        for name in self.domain_names:
            per = {m: mode_stats(kld[m], agree[m], self.windows_of(name)) for m in modes}
            domains[name] = (per.get("input"), per.get("tied"))
        return Result(candidate, seconds=time.perf_counter() - started, domains=domains, **stats)

    @torch.inference_mode()
    def evaluate_head(self, candidate: Candidate) -> Result:
        """The row as an untied LM head stores it (`head_format`): the lookup exact, so the
        final hidden states are the reference's, and the lossy copy of the head computes the
        logits. The copy is made from the head (for a tied model, the table itself)."""
        if candidate.roundtrip is None:
            return Result(candidate)
        started = time.perf_counter()
        lossy = candidate.roundtrip(self.head, self.measured)
        kld = torch.empty(self.positions)
        agree = torch.empty(self.positions, dtype=torch.bool)
        for s, lp_ref in self._reference_chunks():
            e = s + lp_ref.shape[0]
            z = self._logits(self.h_ref[s:e], lossy)
            agree[s:e] = z.argmax(-1) == self.ref_top[s:e]
            lp = torch.log_softmax(z, -1)
            del z
            kld[s:e] = lp.neg_().add_(lp_ref).mul_(lp_ref.exp()).sum(-1)
            del lp
        del lossy
        domains = {
            name: (None, None, mode_stats(kld, agree, self.windows_of(name)))
            for name in self.domain_names
        }
        return Result(
            candidate,
            head=mode_stats(kld, agree, self.bounds),
            seconds=time.perf_counter() - started,
            domains=domains,
        )


# -- entry points ------------------------------------------------------------------------------


def evaluate_model(
    model: str,
    domains: Mapping[str, str],
    *,
    grid_name: str = "plugin",
    window: int = DEFAULT_WINDOW,
    windows: int = DEFAULT_WINDOWS,
    measured: importance.Calibration | None = None,
    only: str | None = None,
    skip: Sequence[str] = (),
    progress: bool = True,
) -> ModelReport:
    """Evaluate every section of `grid_name` (the rows `selected(row, only, skip)` keeps) on
    `domains` (name -> text). The importance is `measured` (a calibration file's M, and S
    where it holds one) or, when None, measured on the packaged calibration corpus as
    `calibrate` does by default."""
    path = real_models.resolve(model)
    report = None
    for title, rows_name, degridded in SECTIONS[grid_name]:
        started = time.perf_counter()
        run = FidelityRun(
            path,
            domains,
            window=window,
            windows=windows,
            measured=measured,
            degrid_table=degridded,
            progress=progress,
        )
        rows = [c for c in grid(rows_name, run.cols) if selected(c, only, skip)]
        results = []
        measure = run.evaluate_head if rows_name in HEAD_GRIDS else run.evaluate
        for i, cand in enumerate(rows):
            results.append(measure(cand))
            r = results[-1]
            if progress and r.head is not None:
                print(
                    f"[{model} {rows_name} {i + 1}/{len(rows)}] {cand.label}: "
                    f"{cand.bpw:.2f} bpw, head {r.head.kld_mean:.2e} ({r.seconds:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            if progress and r.input is not None:
                tied = f", tied {r.tied.kld_mean:.2e}" if r.tied else ""
                print(
                    f"[{model} {rows_name} {i + 1}/{len(rows)}] {cand.label}: "
                    f"{cand.bpw:.2f} bpw, input {r.input.kld_mean:.2e}{tied} "
                    f"({r.seconds:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        if report is None:
            report = ModelReport(
                model=model,
                path=str(path),
                rows=run.rows,
                cols=run.cols,
                tied=run.tied,
                sections=[],
            )
        report.sections.append(
            Section(
                title=title,
                results=results,
                positions=run.positions,
                domains={d: len(run.windows_of(d)) for d in run.domain_names},
                window=window,
                calibration_positions=run.calibration_positions,
                degridded=degridded,
                head=rows_name in HEAD_GRIDS,
                seconds=time.perf_counter() - started,
            )
        )
        del run
    return report


def _need_file(parser: argparse.ArgumentParser, path: Path | None, flag: str) -> None:
    if path is not None and not path.is_file():
        parser.exit(2, f"error: {flag} {path}: no such file\n")


#: Where `eval` writes without `--out`: the current directory, never a package's docs.
DEFAULT_OUT = Path("fidelity-report.md")


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        help="a real model name (smollm2, gemma3-270m) or a checkpoint directory; repeatable",
    )
    parser.add_argument(
        "--corpus",
        type=Path,
        action="append",
        default=None,
        help="plain text to measure on, one domain per file, named by the file's stem (so two "
        "files need different stems); repeatable (default: the packaged held-out domains, "
        f"{', '.join(p.stem for p in HELDOUT_FILES)})",
    )
    parser.add_argument(
        "--importance",
        type=Path,
        default=None,
        help="a calibration file from `vllm-embed-plugin calibrate` (default: "
        "measured here on the packaged calibration corpus, as calibrate does)",
    )
    parser.add_argument(
        "--grid",
        default="plugin",
        choices=tuple(SECTIONS),
        help="which rows: plugin (the shipped formats, plain and with a file, beside the "
        "llama.cpp formats of the targets; default), quick (a smoke test), anchors (llama.cpp "
        "and the plain formats), full (every candidate and experiment, and the 8-bit class on a "
        "de-gridded table)",
    )
    parser.add_argument(
        "--only", default=None, help="evaluate only rows whose label contains this text"
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="ROW",
        help="leave out rows: a shell pattern matched against the row's key in the plugin grid "
        "(int8, int8+tied, 'int4*', fp8, Q5_1, Q4_0, 'Q8_0 shifted'), against the label of "
        "rows in the other grids; repeatable",
    )
    parser.add_argument(
        "--window", type=int, default=DEFAULT_WINDOW, help=f"tokens per window ({DEFAULT_WINDOW})"
    )
    parser.add_argument(
        "--windows",
        type=int,
        default=DEFAULT_WINDOWS,
        help=f"windows spread over each domain's text ({DEFAULT_WINDOWS}; fewer if a text is "
        "shorter than that many windows: windows never overlap)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: all cores)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"the Markdown report to write, rewritten after every model (default: ./{DEFAULT_OUT} "
        "in the current directory)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars or per-row lines on stderr",
    )
    return parser


def corpus_domains(paths: Sequence[Path]) -> dict[str, str]:
    """Domain name (the file's stem) -> text; raises ToolError if two files share a stem."""
    domains: dict[str, str] = {}
    first: dict[str, Path] = {}
    for path in paths:
        if path.stem in first:
            raise ToolError(
                f"--corpus {first[path.stem]} and {path} would both be domain {path.stem!r}; "
                "domains are named by the file's stem: rename one"
            )
        first[path.stem] = path
        domains[path.stem] = path.read_text(encoding="utf-8")
    return domains


def selected(candidate: Candidate, only: str | None, skip: Sequence[str]) -> bool:
    """Whether `--only` and `--skip` keep this row. A `--skip` pattern is matched against a
    row's target key (`int8` leaves `int8+tied` in), against the label of a row without one."""
    if only is not None and only not in candidate.label:
        return False
    return not any(
        fnmatch.fnmatchcase(candidate.key, p) if candidate.key else p in candidate.label
        for p in skip
    )


def main(
    argv: Sequence[str] | None = None, prog: str = "python -m vllm_embed_plugin.tools.evaluate"
) -> int:
    """The command line; `prog` is how the command that was run is written into the report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    for path in args.corpus or ():
        _need_file(parser, path, "--corpus")
    _need_file(parser, args.importance, "--importance")
    if len(args.model) > 1 and args.importance is not None:
        parser.exit(2, "error: --importance FILE belongs to one model; give one --model\n")

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.corpus:
        domains = corpus_domains(args.corpus)
        shown = ", ".join(
            f"{name} (`{path}`, {len(text.split())} words)"
            for (name, text), path in zip(domains.items(), args.corpus)
        )
    else:
        domains = packaged_domains()
        shown = ", ".join(
            f"{name} (`data/heldout/{name}.txt`, {len(text.split())} words)"
            for name, text in domains.items()
        )
    measured = None
    if args.importance is not None:
        try:
            measured = importance.read(args.importance)
        except importance.ImportanceError as exc:
            parser.exit(2, f"error: --importance {exc}\n")
    calibration = (
        f"the calibration file `{args.importance}`"
        if args.importance is not None
        else "the packaged calibration corpus (`data/calibration.txt`), measured as "
        "`vllm-embed-plugin calibrate` measures it by default"
    )
    command = " ".join([prog, shlex.join(argv)])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    reports = []
    for model in args.model:
        reports.append(
            evaluate_model(
                model,
                domains,
                grid_name=args.grid,
                window=args.window,
                windows=args.windows,
                measured=measured,
                only=args.only,
                skip=args.skip,
                progress=not args.no_progress,
            )
        )
        # Written after every model, so a long run keeps what it has measured.
        md = render_markdown(
            reports, command=command, corpus=shown, calibration=calibration, shift=SHIFT
        )
        args.out.write_text(md, encoding="utf-8")
        print(f"wrote {args.out} ({len(reports)}/{len(args.model)} models)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
