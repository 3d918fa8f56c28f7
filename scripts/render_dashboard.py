"""Render the Grafana dashboard's panels from a real Prometheus into one HTML page: each
panel's PromQL run through Prometheus' HTTP API (``/api/v1/query_range`` for timeseries,
``/api/v1/query`` at the end of the range for stat and bargauge), laid out as the dashboard's
``gridPos`` lays it out, with its title, legend (the series' labels, as its legendFormat
writes them) and axes, as inline SVG. For where Grafana is not at hand, e.g. a dashboard
loaded from ``autospec metrics --backfill`` (``promtool tsdb create-blocks-from
openmetrics``):

    .venv/bin/python scripts/render_dashboard.py --prometheus http://127.0.0.1:9090 \\
        --dashboard dashboards/autospec.json --out DIR [--start T --end T]

Template variables: ``$category`` and ``$pair`` become ``.*`` (Grafana's "All"),
``$__rate_interval`` the ``--rate-interval`` (default 5m). ``--start``/``--end``: epoch
seconds or ISO 8601 times; by default the span of ``autospec:requests_total`` over the last
``--lookback`` (default 30d). Standard library only, plus autospec's SVG helpers.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from html import escape
from pathlib import Path

from autospec.report.svg import Series, line_chart, placeholder

# Grafana's classic palette: more colours than series in one of the dashboard's panels
PALETTE = ("#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9",
           "#705da0", "#508642", "#cca300", "#447ebc", "#c15c17", "#890f02", "#0a437c",
           "#6d1f62", "#584477", "#b7dbab", "#f4d598", "#70dbed", "#f9ba8f", "#f29191",
           "#82b5d8", "#e5a8e2", "#aea2e0", "#629e51", "#e5ac0e", "#64b0c8", "#e0752d")
COL_PX, ROW_PX, GAP_PX = 56, 46, 8  # a grid column and row of the page, the gap between
BAR_PX = 15  # a bargauge's row


def api(base: str, path: str, **params) -> list:
    url = f"{base.rstrip('/')}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=60) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{url}: {body}")
    return body["data"]["result"]


def when(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        t = datetime.fromisoformat(text)
        return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


def data_span(base: str, lookback: str) -> tuple[float, float]:
    """(first, last) sample time of autospec:requests_total in the last ``lookback``."""
    now = datetime.now(timezone.utc).timestamp()
    out = []
    for agg in ("min", "max"):
        res = api(base, "query", time=now, query=f"{agg}({agg}_over_time("
                  f"timestamp(autospec:requests_total)[{lookback}:1m]))")
        out.append(float(res[0]["value"][1]) if res else None)
    if None in out:
        sys.exit(f"no autospec:requests_total in {base} in the last {lookback}: "
                 "give --start and --end")
    return out[0], out[1] + 60


# the dashboard's template variables: ".*" is Grafana's "All"; --var NAME=REGEX picks values,
# as its variable menus do (a page of every category and proposer can hold more bars than fit)
VARS = {"category": ".*", "pair": ".*"}


def substitute(expr: str, rate_interval: str) -> str:
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$\{?(category|pair)\}?", lambda m: VARS[m.group(1)], expr)


def legend(fmt: str | None, metric: dict) -> str:
    if not fmt:
        name = metric.get("__name__", "")
        rest = ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items()) if k != "__name__")
        return f"{name}{{{rest}}}" if rest else (name or "value")
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt).strip()


def unit_of(panel: dict) -> tuple[float, str, str, str]:
    """(scale, axis label, format spec, suffix) for the panel's Grafana unit."""
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "none")
    if unit == "percentunit":
        return 100.0, "%", ".3g", "%"
    if unit == "Bps":
        return 1e-9, "GB/s", ".3g", " GB/s"
    return 1.0, "", ".3g", ""


def fmt_value(v: float, spec: str, suffix: str = "") -> str:
    return format(v, spec) + suffix if math.isfinite(v) else str(v)


def time_ticks(start: float, end: float, n: int = 6) -> list[tuple[float, str]]:
    step = max(60, (end - start) / n)
    step = next((s for s in (60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
                 if s >= step), step)
    t = math.ceil(start / step) * step
    out = []
    while t <= end:
        out.append((t, datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M")))
        t += step
    return out


def legend_html(entries: list[tuple[str, str, str]]) -> str:
    """(colour, name, value) per series, flowing in columns under the chart."""
    items = "".join(
        f'<span class="li"><i style="background:{c}"></i>{escape(n)}'
        f'{f" <b>{escape(v)}</b>" if v else ""}</span>' for c, n, v in entries)
    return f'<div class="legend">{items}</div>'


def render_timeseries(panel, base, start, end, step, rate_interval, width, height):
    scale, y_label, spec, suffix = unit_of(panel)
    series, entries, queries = [], [], []
    for target in panel["targets"]:
        expr = substitute(target["expr"], rate_interval)
        queries.append(expr)
        for res in api(base, "query_range", query=expr, start=start, end=end, step=step):
            pts = [(float(t), float(v) * scale) for t, v in res["values"]]
            color = PALETTE[len(series) % len(PALETTE)]
            name = legend(target.get("legendFormat"), res["metric"])
            series.append(Series("", pts, color=color, dots=len(pts) < 3, stroke=1.5))
            finite = [y for _, y in pts if math.isfinite(y)]
            entries.append((color, name, f"last {fmt_value(finite[-1], spec, suffix)}"
                            if finite else "last: none"))
    legend_h = legend_height(entries, width)
    chart_h = max(140, height - legend_h)
    if not series:
        svg = placeholder(panel["title"], "no data. " + panel.get("description", ""), width,
                          chart_h)
    else:
        svg = line_chart(series, title=panel["title"], x_label="time (UTC)", y_label=y_label,
                         x_ticks=time_ticks(start, end), y_fmt=spec, width=width,
                         height=chart_h, y_min=0.0, x_range=(start, end))
    return svg + legend_html(entries), queries, len(series)


def render_instant(panel, base, end, rate_interval, width, height):
    """stat and bargauge: the value of each series at ``end``, as labelled horizontal bars
    (bargauge) or big numbers (stat)."""
    scale, y_label, spec, suffix = unit_of(panel)
    rows, queries = [], []
    for target in panel["targets"]:
        expr = substitute(target["expr"], rate_interval)
        queries.append(expr)
        res = api(base, "query", query=expr, time=end)
        res.sort(key=lambda r: legend_sort_key(legend(target.get("legendFormat"), r["metric"])))
        for r in res:
            rows.append((legend(target.get("legendFormat"), r["metric"]),
                         float(r["value"][1]) * scale, target["expr"]))
    title = f'<div class="ptitle">{escape(panel["title"])}</div>'
    if not rows:
        return (title + f'<div class="nodata">no data. {escape(panel.get("description", ""))}'
                '</div>', queries, 0)
    if panel["type"] == "stat":
        body = "".join(f'<div class="stat"><span class="big">{fmt_value(v, spec, suffix)}</span>'
                       f'<span>{escape(n)}</span></div>' for n, v, _ in rows)
        return title + body, queries, len(rows)
    groups: dict[str, list] = {}  # one scale per target: speedup and k do not share a bar
    for n, v, expr in rows:
        groups.setdefault(expr, []).append((n, v))
    room = max(1, height - 24)
    row_px = max(11, min(BAR_PX, room // max(len(v) for v in groups.values())))
    body = []
    for g, items in enumerate(groups.values()):
        cols = math.ceil(len(items) * row_px / room)
        body.append(f'<div class="bars" style="column-count:{cols};flex:{cols}">')
        top = max((v for _, v in items if math.isfinite(v)), default=1.0) or 1.0
        if suffix == "%":
            top = max(top, 100.0)
        for n, v in items:
            frac = max(0.0, min(1.0, v / top)) if math.isfinite(v) else 0.0
            body.append(f'<div class="bar" style="height:{row_px}px;font-size:{min(11, row_px - 1)}px">'
                        f'<span class="bl">{escape(n)}</span>'
                        f'<span class="bt"><i style="width:{100 * frac:.1f}%;background:'
                        f'{PALETTE[g * 5 % len(PALETTE)]}"></i></span>'
                        f'<span class="bv">{fmt_value(v, spec, suffix)}</span></div>')
        body.append("</div>")
    return title + f'<div class="groups">{"".join(body)}</div>', queries, len(rows)


def legend_sort_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def legend_height(entries, width) -> int:
    if not entries:
        return 0
    per_row = max(1, int(width // max(150, max(7 * len(n) + 90 for _, n, _ in entries))))
    return 16 * math.ceil(len(entries) / per_row) + 6


CSS = """
body{font-family:sans-serif;margin:0;background:#f4f5f5;color:#222}
header{padding:8px 12px;font-size:13px}
header h1{font-size:18px;margin:0 0 4px}
.grid{position:relative;margin:0 12px}
.panel{position:absolute;background:#fff;border:1px solid #d8d9da;border-radius:3px;
 overflow:hidden;box-sizing:border-box;padding:4px}
.legend{font-size:11px;display:flex;flex-wrap:wrap;gap:1px 12px;padding:2px 4px}
.li{white-space:nowrap}.li i{display:inline-block;width:10px;height:3px;margin:0 4px 3px 0}
.ptitle{font-weight:bold;font-size:11px;text-align:center;padding:2px}
.nodata{color:#777;text-align:center;margin-top:60px;font-size:13px}
.stat{display:flex;flex-direction:column;align-items:center;margin-top:24px}
.big{font-size:40px;font-weight:bold;color:#299c46}
.groups{display:flex;gap:14px}
.bars{font-size:11px;padding:2px 6px;column-gap:14px}
.bar{display:flex;align-items:center;gap:6px;height:15px;break-inside:avoid}
.bl{width:40%;text-align:right;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.bt{flex:1;background:#eee;height:10px}.bt i{display:block;height:10px}
.bv{width:40px;text-align:right}
.q{font-family:monospace;font-size:10px;color:#666;white-space:pre-wrap}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prometheus", required=True, metavar="URL")
    ap.add_argument("--dashboard", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path, help="directory for dashboard.html")
    ap.add_argument("--start", type=when)
    ap.add_argument("--end", type=when)
    ap.add_argument("--rate-interval", default="5m")
    ap.add_argument("--lookback", default="30d")
    ap.add_argument("--note", default="", help="a line under the title (e.g. the data's source)")
    ap.add_argument("--var", action="append", default=[], metavar="NAME=REGEX",
                    help="a template variable's value, e.g. category=code-edit|qa-quote "
                         "(default: All)")
    args = ap.parse_args(argv)
    for item in args.var:
        name, sep, value = item.partition("=")
        if not sep or name not in VARS:
            ap.error(f"--var takes NAME=REGEX with NAME one of {', '.join(VARS)}, got {item!r}")
        VARS[name] = value
    dash = json.loads(args.dashboard.read_text(encoding="utf-8"))
    start, end = args.start, args.end
    if start is None or end is None:
        first, last = data_span(args.prometheus, args.lookback)
        start = first if start is None else start
        end = last if end is None else end
    step = max(15, round((end - start) / 240))
    html, report = [], []
    bottom = 0
    for panel in dash["panels"]:
        g = panel["gridPos"]
        left, top = g["x"] * COL_PX, g["y"] * ROW_PX
        width, height = g["w"] * COL_PX - GAP_PX, g["h"] * ROW_PX - GAP_PX
        inner_w, inner_h = width - 10, height - 10
        if panel["type"] == "timeseries":
            body, queries, n = render_timeseries(panel, args.prometheus, start, end, step,
                                                 args.rate_interval, inner_w, inner_h)
        else:
            body, queries, n = render_instant(panel, args.prometheus, end,
                                              args.rate_interval, inner_w, inner_h)
        tip = escape("\n".join(queries), quote=True)
        html.append(f'<div class="panel" title="{tip}" style="left:{left}px;top:{top}px;'
                    f'width:{width}px;height:{height}px">{body}</div>')
        report.append((panel["title"], panel["type"], n, queries))
        bottom = max(bottom, top + height)
    chosen = " · ".join(f"${n} = {'All' if v == '.*' else v}" for n, v in VARS.items())
    span = (f"{datetime.fromtimestamp(start, timezone.utc):%Y-%m-%d %H:%M:%S} – "
            f"{datetime.fromtimestamp(end, timezone.utc):%H:%M:%S} UTC")
    page = (f'<!doctype html><html><head><meta charset="utf-8"><title>{escape(dash["title"])}'
            f'</title><style>{CSS}</style></head><body><header><h1>{escape(dash["title"])}</h1>'
            f'{span} · {escape(chosen)} · $__rate_interval = '
            f'{escape(args.rate_interval)} · step {step}s · {escape(args.prometheus)}'
            f'{"<br>" + escape(args.note) if args.note else ""}</header>'
            f'<div class="grid" style="height:{bottom + 8}px">{"".join(html)}</div>'
            f'</body></html>')
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "dashboard.html"
    path.write_text(page, encoding="utf-8")
    for title, kind, n, _ in report:
        print(f"{n:4d} series  {kind:10s} {title}" + ("   <- no data" if n == 0 else ""))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
