"""Small PNG plots rendered offline (matplotlib, Agg), well under 100 KB so they inline as ``data:`` URIs.
Drawing costs ~0.1 s a plot, most of a ``dataset_stats`` run: plots drawn from data are looked up by a
hash of their inputs (in this process, then in the folder of :func:`cached_in`) before drawing.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from speech_assets.layout import PLOT_SUFFIX
from speech_assets.utils import atomic_path

DPI = 100
SIZE = (12.0, 4.5)
TITLE, LABEL, TICK, SMALL = 15, 13, 11, 10  # font sizes in points
MAX_BARS = 40
RENDER_VERSION = "3"  # bump when a plot's drawing changes, so cached PNGs are not reused
MEMORY_ENTRIES = 32  # PNGs kept in this process (a few tens of KB each)

_memory: OrderedDict[str, bytes] = OrderedDict()
_folders: list[Path] = []  # innermost cached_in() last
_used: list[set[str]] = []  # the keys looked up inside each cached_in()


def _key(kind: str, *parts: object) -> str:
    """sha256 of a plot's kind, inputs and the versions of what draws it."""
    import matplotlib

    digest = hashlib.sha256(f"{kind}|{RENDER_VERSION}|{matplotlib.__version__}".encode())
    for part in parts:
        if isinstance(part, np.ndarray):
            digest.update(f"|{part.dtype.str}{part.shape}|".encode())
            digest.update(np.ascontiguousarray(part).tobytes())
        else:
            digest.update(b"|" + json.dumps(part, sort_keys=True, default=repr).encode())
    return digest.hexdigest()


@contextlib.contextmanager
def cached_in(folder: Path) -> Iterator[None]:
    """Inside the block, plots are also looked up in and saved to ``folder``; on leaving it, PNGs
    there that the block did not use are removed (the folder holds the last report's plots)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _folders.append(folder)
    _used.append(set())
    try:
        yield
    finally:
        _folders.pop()
        used = _used.pop()
    for stale in folder.glob(f"*{PLOT_SUFFIX}"):
        if stale.stem not in used:
            stale.unlink(missing_ok=True)


def _render(draw, size: tuple[float, float] = SIZE, key: str | None = None) -> bytes:
    if key is None:
        return _draw(draw, size)
    if _used:
        _used[-1].add(key)
    cached = _folders[-1] / f"{key}{PLOT_SUFFIX}" if _folders else None
    png = _memory.get(key)
    if png is None and cached is not None:
        with contextlib.suppress(OSError):
            png = cached.read_bytes()
    png = png or _draw(draw, size)
    _memory[key] = png
    _memory.move_to_end(key)
    while len(_memory) > MEMORY_ENTRIES:
        _memory.popitem(last=False)
    if cached is not None and not cached.exists():
        with atomic_path(cached, durable=False) as tmp:  # a lost one is redrawn
            Path(tmp).write_bytes(png)
    return png


def legend_below(axis) -> None:
    """Under the axes, so that it never covers a point."""
    handles, _ = axis.get_legend_handles_labels()
    axis.legend(
        fontsize=SMALL, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(len(handles), 3), frameon=False
    )


@contextlib.contextmanager
def figure_of(draw, size: tuple[float, float] = SIZE) -> Iterator[Any]:
    """The laid-out figure of ``draw(figure)``, closed on leaving."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=size, dpi=DPI)
    try:
        draw(figure)
        figure.tight_layout()
        yield figure
    finally:
        plt.close(figure)


def _draw(draw, size: tuple[float, float]) -> bytes:
    with figure_of(draw, size) as figure:
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
        return buffer.getvalue()


def training_curve_drawing(rows: Sequence[Mapping[str, Any]]):
    """What :func:`training_curve` draws, for :func:`figure_of`."""
    from speech_assets.train import accuracy

    held = accuracy.curve_points(list(rows))

    def draw(figure) -> None:
        for index, (key, label) in enumerate(
            (("loss", "loss"), ("masked_accuracy", "masked accuracy"), ("lr", "learning rate"))
        ):
            axis = figure.add_subplot(1, 3, index + 1)
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            axis.plot([x for x, _ in points], [y for _, y in points], marker=".", linewidth=1, label="training batches")
            if key == "masked_accuracy" and held:
                axis.plot([h[0] for h in held], [h[1] for h in held], marker="o", linewidth=1.5, label=accuracy.LABEL)
                majority = {"marker": "_", "markersize": 10, "linestyle": "--", "color": "0.35"}
                axis.plot(
                    [h[0] for h in held], [h[2] for h in held], linewidth=1, label="held-out majority class", **majority
                )
                legend_below(axis)
            axis.set_title(label, fontsize=TITLE)
            axis.set_xlabel("step", fontsize=LABEL)
            axis.tick_params(labelsize=TICK)
            axis.grid(alpha=0.3)

    return draw


def training_curve(rows: Sequence[Mapping[str, Any]]) -> bytes:
    """Loss, masked accuracy (training, and held-out on leak-free frames against the majority-class
    rate) and learning rate against step, from rows of the trainer's metrics.jsonl."""
    from speech_assets.train import accuracy

    columns = ("step", "loss", "masked_accuracy", "lr", accuracy.CURVE_ACCURACY, accuracy.CURVE_MAJORITY)
    return _render(
        training_curve_drawing(rows), key=_key("training_curve", [[r.get(k) for k in columns] for r in rows])
    )


def histogram(values: Sequence[float], title: str, xlabel: str, bins: int = 30) -> bytes:
    data = np.asarray(values, dtype=float)

    def draw(figure) -> None:
        axis = figure.add_subplot(1, 1, 1)
        axis.hist(data, bins=bins, color="#4878a8")
        axis.set_title(title, fontsize=TITLE)
        axis.set_xlabel(xlabel, fontsize=LABEL)
        axis.set_ylabel("count", fontsize=LABEL)
        axis.tick_params(labelsize=TICK)

    return _render(draw, key=_key("histogram", data, title, xlabel, bins))


def bars(labels: Sequence[str], values: Sequence[float], title: str, ylabel: str) -> bytes:
    """A bar per label (at most ``MAX_BARS``, the largest, when there are more)."""
    order = np.argsort(np.asarray(values, dtype=float))[::-1][:MAX_BARS]
    shown = [str(labels[i]) for i in order]
    heights = [float(values[i]) for i in order]
    suffix = f" (top {len(shown)} of {len(labels)})" if len(labels) > len(shown) else ""

    def draw(figure) -> None:
        axis = figure.add_subplot(1, 1, 1)
        axis.bar(range(len(shown)), heights, color="#6a9f58")
        axis.set_xticks(range(len(shown)), shown, rotation=90, fontsize=SMALL)
        axis.set_title(title + suffix, fontsize=TITLE)
        axis.set_ylabel(ylabel, fontsize=LABEL)
        axis.tick_params(axis="y", labelsize=TICK)

    return _render(draw, key=_key("bars", shown, np.asarray(heights, dtype=float), title + suffix, ylabel))


def cluster_sizes(counts_by_client: Mapping[str, np.ndarray]) -> bytes:
    """Each client's cluster sizes as a share of its frames, largest first (rank on the x axis)."""

    def draw(figure) -> None:
        axis = figure.add_subplot(1, 1, 1)
        for client, counts in sorted(counts_by_client.items()):
            counts = np.sort(np.asarray(counts, dtype=float))[::-1]
            axis.plot(np.arange(1, len(counts) + 1), counts / max(counts.sum(), 1.0), label=client, linewidth=1)
        axis.set_title("cluster sizes (share of frames, by rank)", fontsize=TITLE)
        axis.set_xlabel("cluster rank", fontsize=LABEL)
        axis.set_yscale("log")
        axis.tick_params(labelsize=TICK)
        if len(counts_by_client) <= 12:
            legend_below(axis)

    parts = [
        part for client, counts in sorted(counts_by_client.items()) for part in (client, np.asarray(counts, float))
    ]
    return _render(draw, key=_key("cluster_sizes", *parts))


def curves(x: Sequence[float], series: Mapping[str, Sequence[float]], title: str, xlabel: str) -> bytes:
    """Several named lines against one x axis (e.g. WER against labelled minutes)."""

    def draw(figure) -> None:
        axis = figure.add_subplot(1, 1, 1)
        for name, values in series.items():
            axis.plot(list(x), list(values), marker=".", label=name, linewidth=1)
        axis.set_title(title, fontsize=TITLE)
        axis.set_xlabel(xlabel, fontsize=LABEL)
        axis.tick_params(labelsize=TICK)
        axis.grid(alpha=0.3)
        legend_below(axis)

    return _render(draw)


def round_curve_drawing(lines: Sequence[Mapping[str, Any]]):
    """What :func:`round_curve` draws, for :func:`figure_of`."""
    from speech_assets.train import accuracy

    rounds = [line["round"] for line in lines]

    def series(key: str) -> tuple[list[int], list[float]]:
        points = [(line["round"], line.get(key)) for line in lines if line.get(key) is not None]
        return [x for x, _ in points], [float(y) for _, y in points]

    def draw(figure) -> None:
        loss = figure.add_subplot(1, 2, 1)
        loss.plot(*series("train_loss"), marker="o", linewidth=1)  # none under DP: the clients withhold it
        loss.set_title("local train loss (mean over clients)", fontsize=TITLE)
        axis = figure.add_subplot(1, 2, 2)
        majority = {"marker": "_", "markersize": 10, "linestyle": "--", "color": "C0"}
        for key, label, style in (
            (accuracy.ACCURACY, "global encoder + own head", {"marker": "o", "color": "C0"}),
            (accuracy.MAJORITY, "majority class", majority),
        ):
            x, y = series(key)
            if x:
                axis.plot(x, y, linewidth=1, label=label, **style)
        drawn_any = bool(axis.lines)
        axis.set_title(accuracy.LABEL + ("" if drawn_any else " (no round evaluated)"), fontsize=TITLE)
        if drawn_any:
            legend_below(axis)
        for each in (loss, axis):
            each.set_xlabel("round", fontsize=LABEL)
            each.tick_params(labelsize=TICK)
            each.grid(alpha=0.3)
            each.set_xticks(rounds)

    return draw


def round_curve(lines: Sequence[Mapping[str, Any]]) -> bytes:
    """A federated run's train loss, and the held-out masked accuracy (leak-free frames) against the
    majority-class rate, per round (lines of :func:`speech_assets.federated.history.summarize_rounds`)."""
    return _render(round_curve_drawing(lines))


def vad_decision(wave: np.ndarray, voiced: Sequence[bool], frame_ms: int, span: tuple[float, float] | None) -> bytes:
    """A waveform (16 kHz mono) with the VAD's voiced frames shaded and the span it kept
    (``(start_s, end_s)``, ``None`` when it never triggered) marked."""
    bins = 800  # min/max per bin: the envelope, whatever the length
    usable = len(wave) // bins * bins
    envelope = wave[:usable].reshape(bins, -1) if usable else wave.reshape(1, -1)
    times = (np.arange(envelope.shape[0]) + 0.5) * envelope.shape[1] / 16_000
    flags = np.asarray(voiced, dtype=bool)

    def draw(figure) -> None:
        axis = figure.add_subplot(1, 1, 1)
        axis.fill_between(times, envelope.min(axis=1), envelope.max(axis=1), color="#4878a8", linewidth=0)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(np.int8), [0]])))
        for first, end in zip(edges[::2], edges[1::2]):  # one shaded band per run of voiced frames
            axis.axvspan(first * frame_ms / 1000, end * frame_ms / 1000, color="#6a9f58", alpha=0.35, linewidth=0)
        if span is not None:
            for edge in span:
                axis.axvline(edge, color="#c0392b", linewidth=1.5)
        kept = f"span kept {span[0]:.2f}-{span[1]:.2f} s" if span else "never triggered"
        axis.set_title(f"VAD: {int(flags.sum())}/{len(flags)} frames voiced (green), {kept}", fontsize=LABEL)
        axis.set_xlabel("seconds", fontsize=LABEL)
        axis.set_xlim(0, max(len(wave) / 16_000, 1e-3))
        axis.set_yticks([])
        axis.tick_params(labelsize=TICK)

    return _render(draw, size=(9.0, 2.2), key=_key("vad_decision", envelope.astype(np.float32), flags, frame_ms, span))


# Dagster's asset page shows a markdown metadata value inline only when it is shorter than this
# (longer ones hide behind "[Show Markdown]"): the inline chart must fit in it.
INLINE_MARKDOWN_LIMIT = 1000
INLINE_COLOURS = ("#1f77b4", "#ff7f0e", "#555")


def inline_chart(
    title: str, series: Mapping[str, Sequence[tuple[float, float]]], limit: int = INLINE_MARKDOWN_LIMIT
) -> str:
    """A markdown SVG line chart small enough for Dagster to draw inline: up to three named
    ``[(x, y), ...]`` series (one named "majority..." is the dashed grey baseline), each series'
    last value in the legend. Points are thinned until the markdown is shorter than ``limit``."""
    shown = {name: [(float(x), float(y)) for x, y in points] for name, points in list(series.items())[:3] if points}
    if not shown:
        return f"*{title}: nothing measured yet*"
    xs = [x for points in shown.values() for x, _ in points]
    ys = [y for points in shown.values() for _, y in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    width, height, top = 200, 60, 24

    def place(x: float, y: float) -> str:
        px = 0 if x1 == x0 else (x - x0) / (x1 - x0) * width
        py = top + height - (0 if y1 == y0 else (y - y0) / (y1 - y0) * height)
        return f"{px:.0f},{py:.0f}"

    def svg(step: int) -> str:
        parts = [
            f"<svg xmlns='http://www.w3.org/2000/svg' viewBox='-2,0,{width + 40},{top + height + 12}' width='360'>"
        ]
        legend = []
        for index, (name, points) in enumerate(shown.items()):
            baseline = "majority" in name
            colour = INLINE_COLOURS[2] if baseline else INLINE_COLOURS[index % 2]
            kept = points[::step] if points[-1] in points[::step] else [*points[::step], points[-1]]
            dash = " stroke-dasharray='4'" if baseline else ""
            parts.append(
                f"<polyline points='{','.join(place(x, y) for x, y in kept)}' fill='none' stroke='{colour}'{dash}/>"
            )
            legend.append(f"<tspan fill='{colour}'>{name} {points[-1][1]:.3g}</tspan>")
        parts.append(f"<text y='9' font-size='8'>{title}</text><text y='19' font-size='8'>{' '.join(legend)}</text>")
        parts.append(f"<text x='{width + 2}' y='{top + 6}' font-size='7'>{y1:.3g}</text>")
        parts.append(f"<text x='{width + 2}' y='{top + height}' font-size='7'>{y0:.3g}</text>")
        parts.append(f"<text y='{top + height + 10}' font-size='7'>{x0:g}</text>")
        parts.append(f"<text x='{width - 20}' y='{top + height + 10}' font-size='7'>{x1:g}</text></svg>")
        encoded = "".join(parts).replace("%", "%25").replace("#", "%23").replace("<", "%3C").replace(">", "%3E")
        encoded = encoded.replace(" ", "%20").replace("(", "%28").replace(")", "%29")
        return f"![{title}](data:image/svg+xml,{encoded})"

    step, longest = 1, max(len(points) for points in shown.values())
    text = svg(step)
    while len(text) >= limit and step < longest:
        step += 1
        text = svg(step)
    return text if len(text) < limit else f"*{title}: {', '.join(f'{n} {p[-1][1]:.3g}' for n, p in shown.items())}*"


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def markdown_image(png: bytes, alt: str) -> str:
    return f"![{alt}]({data_uri(png)})"


def html_image(png: bytes, alt: str, css_class: str = "plot") -> str:
    return f'<img class="{css_class}" alt="{alt}" src="{data_uri(png)}">'
