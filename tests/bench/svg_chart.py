"""A small line chart as SVG text, for the performance report (no plotting
library needed).

    line_chart("title", "x label", "y label", {"series": {x: y, ...}}, log_x=True)
"""

import math

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
WIDTH, HEIGHT = 760, 440
LEFT, RIGHT, TOP, BOTTOM = 70, 190, 40, 55


def _nice_max(value):
    if value <= 0:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if step * magnitude >= value:
            return step * magnitude
    return 10 * magnitude


def line_chart(title, x_label, y_label, series, log_x=False):
    xs = sorted({x for points in series.values() for x in points})
    y_max = _nice_max(max((y for points in series.values() for y in points.values()), default=1))
    fx = (lambda x: math.log2(x)) if log_x else float
    x_lo, x_hi = fx(xs[0]), fx(xs[-1])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x):
        return LEFT + (fx(x) - x_lo) / ((x_hi - x_lo) or 1) * plot_w

    def py(y):
        return TOP + plot_h - y / y_max * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>']
    for i in range(6):  # horizontal grid and y ticks
        y = y_max * i / 5
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{py(y):.1f}" y2="{py(y):.1f}" '
                   f'stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">{x:g}</text>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + plot_h}" stroke="#333"/>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{TOP + plot_h}" '
               f'y2="{TOP + plot_h}" stroke="#333"/>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">'
               f'{x_label}</text>')
    out.append(f'<text transform="translate(18 {TOP + plot_h / 2}) rotate(-90)" '
               f'text-anchor="middle">{y_label}</text>')
    # A reference series ("... matmul fp32") is dashed, in the colour of the
    # series it bounds (the one ending in the same word).
    colors = {}
    for name in series:
        if "matmul" not in name:
            colors[name] = COLORS[len(colors) % len(COLORS)]
    for name in series:
        if "matmul" in name:
            twin = [n for n in colors if n.split()[-1] == name.split()[-1]]
            colors[name] = colors[twin[0]] if twin else COLORS[len(colors) % len(COLORS)]
    for i, (name, points) in enumerate(series.items()):
        if not points:
            continue
        color = colors[name]
        dash = ' stroke-dasharray="6 4"' if "matmul" in name else ""
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(points.items()))
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')
        for x, y in points.items():
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>')
        ly = TOP + 10 + 20 * i
        out.append(f'<line x1="{WIDTH - RIGHT + 15}" x2="{WIDTH - RIGHT + 40}" y1="{ly}" '
                   f'y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{WIDTH - RIGHT + 46}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
