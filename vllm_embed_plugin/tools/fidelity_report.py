"""The Markdown report of a fidelity run (`docs/FIDELITY.md`): tables per model, section and
domain, and the targets against llama.cpp's formats. It renders what `evaluate` measured and
measures nothing itself."""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .fidelity_data import ModeStats, Result

__all__ = [
    "BIT_CLASSES",
    "ModelReport",
    "Section",
    "bit_class",
    "render_markdown",
    "tilde",
    "verdict",
]

#: (name, largest bits/weight) from the smallest budget up; a row belongs to the first class
#: whose budget it fits.
BIT_CLASSES = (("4-bit class", 4.5), ("6-bit class", 6.0), ("8-bit class", 8.5))


def bit_class(bpw: float | None) -> str:
    if bpw is None:
        return "n/a"
    for name, limit in BIT_CLASSES:
        if bpw <= limit + 1e-9:
            return name
    return f"above {BIT_CLASSES[-1][1]} bpw"


def tilde(text: str) -> str:
    """`text` with the user's home directory written as ~ (reports are shared)."""
    home = str(Path.home())
    return text.replace(home + "/", "~/") if home not in ("", "/") else text


def verdict(ratio: float, limit: float) -> str:
    """A target's ratio and whether it holds: "0.42x, met", "1.00x, **missed by < 1%**". The
    ratio gets a third decimal when two would print it equal to the limit it missed."""
    shown = f"{ratio:.2f}"
    if ratio > limit and shown == f"{limit:.2f}":
        shown = f"{ratio:.3f}"
    if ratio <= limit:
        return f"{shown}x, met"
    over = ratio / limit - 1
    return f"{shown}x, **missed by {'< 1%' if over < 0.01 else f'{over:.0%}'}**"


def _fmt_kld(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def _table(results: Sequence[Result]) -> list[str]:
    lines = [
        "| format | bpw | input KLD mean | input KLD p99 | input top-1 "
        "| tied KLD mean | tied KLD p99 | tied top-1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = [name for name, _ in BIT_CLASSES][::-1] + [f"above {BIT_CLASSES[-1][1]} bpw", "n/a"]
    by_class: dict[str, list[Result]] = {}
    for r in results:
        by_class.setdefault(bit_class(r.candidate.bpw), []).append(r)
    for name in sorted(by_class, key=lambda c: order.index(c) if c in order else len(order)):
        budget = dict(BIT_CLASSES).get(name)
        title = f"{name} (<= {budget} bpw)" if budget else name
        lines.append(f"| **{title}** | | | | | | | |")

        def key(r: Result):
            return (r.tied or r.input).kld_mean if (r.tied or r.input) else math.inf

        for r in sorted(by_class[name], key=key):
            c = r.candidate
            label = f"*{c.label}*" if c.kind == "llama.cpp" else c.label
            bpw = "n/a" if c.bpw is None else f"{c.bpw:.2f}"
            cells = []
            for m in (r.input, r.tied):
                if m is None:
                    cells += ["n/a" if c.roundtrip is None else "-"] * 3
                else:
                    cells += [_fmt_kld(m.kld_mean), _fmt_kld(m.kld_p99), f"{m.top1:.2%}"]
            if c.roundtrip is None and c.note:
                cells[0] = f"n/a ({c.note})"
            lines.append(f"| {label} | {bpw} | " + " | ".join(cells) + " |")
    return lines


@dataclass
class Section:
    title: str
    results: list[Result]
    positions: int
    #: Domain name -> windows measured on it.
    domains: dict[str, int]
    window: int
    #: Positions the importance was measured on here; None when it came from a file.
    calibration_positions: int | None
    degridded: bool
    seconds: float
    #: Rows measured as an untied LM head (the lookup exact): one column, "head".
    head: bool = False


@dataclass
class ModelReport:
    model: str
    path: str
    rows: int
    cols: int
    tied: bool
    sections: list[Section]

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.sections)


_PREAMBLE = """\
Only the token table is replaced by dequantize(quantize(table)); everything else is the original
model in float32 on the CPU. KLD = per-token KL(P_ref || P_quant) in nats over every position of
the evaluation windows (mean and 99th percentile); top-1 = agreement of the arg-max token with the
reference. *input*: only the lookup reads the lossy table, the LM head keeps the original;
*tied*: the same lossy table also produces the logits. bpw = stored bits per weight, scales,
minimums and side tables included. Within a class, rows are sorted by tied KLD.

- *Italic* rows are llama.cpp's reference quantizers (the `gguf` package): the anchors. K-quants
  need rows that are a multiple of 256 columns (n/a otherwise).
- *+ importance*: the plugin given a file from `vllm-embed-plugin calibrate`
  (`VLLM_EMBED_IMPORTANCE`), which holds M = E[h h^T], the second moment of the final hidden
  state h (what the tied head multiplies the table with). The scales are searched (*search N*:
  N candidate scales on each side of the plain one, each refit by least squares, llama.cpp's
  way) weighing each column's squared error by M's diagonal. *tied*: as the plugin treats a
  tied table, each row's codes are also chosen jointly against M (GPTQ), so their errors cancel
  in the logits, plus S, the lookup's Fisher information, where the file holds it (M + S:
  what a row's error costs in the logits and in the lookup together). An untied table given a file is converted exactly as without one (M
  describes the head's input, not the lookup's; docs/CALIBRATION.md), so the plain rows are
  also the untied tables with a file. M comes from the calibration text named above, never
  from the evaluation windows. Rows without it are the plugin with no file.
- Every domain is measured on several windows spread over its text; a figure's spread is the
  lowest and highest mean KLD of one window (and, for the targets, the lowest and highest ratio
  window by window, the same windows for both rows)."""

_GRIDDED_NOTE = """- Both real tables were published as Q8_0 on aligned 32-column blocks: aligned Q8_0, and any
  int8 on aligned 32-column groups, reproduce them almost exactly. Rows *shifted {shift}* move the
  group grid by {shift} columns: the fair 8.5-bit reference. It is not fully
  fair either: a shifted block that holds an old block's largest value gets that block's step
  back and reproduces half its values; that favours shifted Q8_0 and shifted int8 g32 alike."""

_OUTLIER_NOTE = """- *outlier rows*: an experiment, not a storage format of the plugin: the share of rows with the
  largest importance-weighted error kept in int8 symmetric group-32 instead; bpw counts those
  rows at 8.5 bits plus a 32-bit row index each."""

_DEGRID_NOTE = """- The last section per model measures the 8-bit class on a *de-gridded* table: every value
  moved by uniform noise of +-half its old Q8_0 step, then rounded to BF16 (a table that was
  never quantized; the reference model uses it too). Judge 8-bit formats there too."""


def preamble(reports: Sequence[ModelReport], shift: int) -> str:
    """The explanation above the tables, with the notes that apply to the rows present."""
    labels = [r.candidate.label for rep in reports for sec in rep.sections for r in sec.results]
    parts = [_PREAMBLE, _GRIDDED_NOTE.format(shift=shift)]
    if any("outlier rows" in label for label in labels):
        parts.append(_OUTLIER_NOTE)
    if any(sec.degridded for rep in reports for sec in rep.sections):
        parts.append(_DEGRID_NOTE)
    return "\n".join(parts)


#: The issue's targets: (row, key of the row, key of the reference row, largest ratio of mean
#: KLDs, mode). Each is judged per domain on its mean; the spread is the ratio window by window.
#: A file never raises an untied table's KLD by construction (an untied table given a file is
#: converted exactly as without one); for a tied table, LOOKUP_TARGETS checks the lookup side.
TARGETS = (
    ("`int4` + file, tied", "int4+tied", "Q4_0", 0.6, "tied"),
    ("`int5` + file, tied", "int5+tied", "Q5_1", 0.5, "tied"),
    ("`int8` + file, tied", "int8+tied", "Q8_0 shifted", 0.9, "tied"),
)
#: The same for an untied LM head (`head_format`, a calibration file), issue 25.
HEAD_TARGETS = (
    ("`int4` + file, head", "int4+head", "Q4_0", 0.6, "head"),
    ("`int5` + file, head", "int5+head", "Q5_1", 0.5, "head"),
    ("`int8` + file, head", "int8+head", "Q8_0 shifted", 0.9, "head"),
)


#: (format): with a file, the tied table's lookup-side (input) KLD may exceed the plain row's
#: by at most the plain row's window spread (highest minus lowest window mean).
LOOKUP_TARGETS = ("int8", "int5", "int4")


def lookup_verdict(with_file: ModeStats, plain: ModeStats) -> str:
    """Whether a file kept a tied table's lookup side within the plain row's window spread."""
    low, high = plain.spread
    excess = with_file.kld_mean - plain.kld_mean
    ratio = with_file.kld_mean / plain.kld_mean if plain.kld_mean > 0 else math.inf
    held = "met" if excess <= high - low else "**missed**"
    return f"{ratio:.2f}x plain (spread {_short(low)}–{_short(high)}), {held}"


def _short(x: float) -> str:
    """2.7e-2 style: two significant digits, a short exponent."""
    if x == 0:
        return "0"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _with_spread(m: ModeStats | None) -> str:
    if m is None:
        return "-"
    low, high = m.spread
    return f"{_short(m.kld_mean)} ({_short(low)}–{_short(high)})"


def _domain_table(results: Sequence[Result], domains: Sequence[str]) -> list[str]:
    """Per-domain mean KLD and its spread (lowest–highest window), tied then input."""
    head = " | ".join([f"{d}, tied" for d in domains] + [f"{d}, input" for d in domains])
    lines = [f"| format | bpw | {head} |", "|---|---|" + "---|" * (2 * len(domains))]

    def key(r: Result):
        first = r.domain(domains[0], "tied") or r.domain(domains[0], "input")
        return (-(r.candidate.bpw or 0), first.kld_mean if first else math.inf)

    for r in sorted((r for r in results if r.domains), key=key):
        c = r.candidate
        label = f"*{c.label}*" if c.kind == "llama.cpp" else c.label
        cells = [_with_spread(r.domain(d, "tied")) for d in domains] + [
            _with_spread(r.domain(d, "input")) for d in domains
        ]
        lines.append(f"| {label} | {c.bpw:.2f} | " + " | ".join(cells) + " |")
    return lines


def target_ratios(row: Result, ref: Result, domain: str, mode: str) -> tuple[float, float, float]:
    """(ratio of the domain's mean KLDs, lowest and highest ratio window by window)."""
    a, b = row.domain(domain, mode), ref.domain(domain, mode)
    pairs = [x / y for x, y in zip(a.window_klds, b.window_klds) if y > 0]
    ratio = a.kld_mean / b.kld_mean if b.kld_mean > 0 else math.inf
    return ratio, min(pairs, default=ratio), max(pairs, default=ratio)


def _head_table(results: Sequence[Result], domains: Sequence[str]) -> list[str]:
    """Head-only rows: per-domain mean KLD with its spread, then all domains together."""
    lines = [
        "| format | bpw | " + " | ".join(domains) + " | all: KLD mean | KLD p99 | top-1 |",
        "|---|---|" + "---|" * (len(domains) + 3),
    ]
    measured = sorted(
        (r for r in results if r.head is not None),
        key=lambda r: (-(r.candidate.bpw or 0), r.head.kld_mean),
    )
    for r in measured:
        c = r.candidate
        label = f"*{c.label}*" if c.kind == "llama.cpp" else c.label
        cells = [_with_spread(r.domain(d, "head")) for d in domains]
        cells += [_fmt_kld(r.head.kld_mean), _fmt_kld(r.head.kld_p99), f"{r.head.top1:.2%}"]
        lines.append(f"| {label} | {c.bpw:.2f} | " + " | ".join(cells) + " |")
    for r in results:
        if r.head is None and r.candidate.note:
            lines.append(f"| *{r.candidate.label}* | n/a ({r.candidate.note}) |")
    return lines


def _target_table(results: Sequence[Result], domains: Sequence[str], targets=TARGETS) -> list[str]:
    by_key = {r.candidate.key: r for r in results if r.candidate.key and r.domains}
    lines = ["| target | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
    for title, key, ref_key, limit, mode in targets:
        row, ref = by_key.get(key), by_key.get(ref_key)
        if row is None or ref is None or row.domain(domains[0], mode) is None:
            continue
        cells = []
        for d in domains:
            ratio, low, high = target_ratios(row, ref, d, mode)
            shown, judged = verdict(ratio, limit).split("x, ", 1)
            cells.append(f"{shown}x ({low:.2f}–{high:.2f}), {judged}")
        anchor = ref.candidate.label.replace("**", "")
        lines.append(
            f"| {title} <= {limit:g}x {anchor.split(':')[0]} ({mode} KLD) | "
            + " | ".join(cells)
            + " |"
        )
    for name in LOOKUP_TARGETS:
        row, plain = by_key.get(f"{name}+tied"), by_key.get(name)
        if row is None or plain is None or row.domain(domains[0], "input") is None:
            continue
        cells = [lookup_verdict(row.domain(d, "input"), plain.domain(d, "input")) for d in domains]
        lines.append(
            f"| `{name}` + file, tied: input KLD <= plain + window spread | "
            + " | ".join(cells)
            + " |"
        )
    return lines if len(lines) > 2 else []


def render_markdown(
    reports: Sequence[ModelReport],
    *,
    command: str,
    corpus: str,
    shift: int,
    calibration: str = "",
    date: str | None = None,
) -> str:
    """The whole report. `shift`: the columns the "shifted" rows moved the block grid by."""
    date = date or datetime.date.today().isoformat()
    minutes = sum(r.seconds for r in reports) / 60
    out = [
        "# Fidelity of embedding-table formats",
        "",
        f"Generated {date} in {minutes:.0f} min by:",
        "",
        "```",
        command,
        "```",
        "",
        f"Evaluation text, one domain each: {corpus}.",
        "",
        f"Column importance (*+ importance* rows): {calibration}." if calibration else "",
        "",
        *preamble(reports, shift).splitlines(),
    ]
    for rep in reports:
        out += [
            "",
            f"## {rep.model}",
            "",
            f"Checkpoint `{rep.path}`: token table {rep.rows} x {rep.cols}, "
            f"{'tied' if rep.tied else 'untied'} LM head.",
        ]
        for sec in rep.sections:
            domains = list(sec.domains)
            where = (
                f"measured here on {sec.calibration_positions} positions"
                if sec.calibration_positions is not None
                else "read from the file"
            )
            out += [
                "",
                f"### {sec.title}",
                "",
                f"{sec.positions} positions: "
                + ", ".join(f"{d} {n} window{'s' if n > 1 else ''}" for d, n in sec.domains.items())
                + f" of up to {sec.window} tokens; column importance {where}; "
                f"{sec.seconds / 60:.1f} min.",
                "",
                "Mean KLD per domain, and in brackets the lowest and highest mean of one window:",
                "",
                *(_head_table if sec.head else _domain_table)(sec.results, domains),
            ]
            targets = _target_table(sec.results, domains, HEAD_TARGETS if sec.head else TARGETS)
            if targets:
                out += [
                    "",
                    "Targets, per domain: the ratio of mean KLDs, in brackets the lowest and "
                    "highest ratio window by window:",
                    "",
                    *targets,
                ]
            if not sec.head:
                out += ["", "All domains together:", "", *_table(sec.results)]
    return tilde("\n".join(out)) + "\n"
