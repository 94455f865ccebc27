"""The report's HTML shell and stylesheet: the data blob and the script are inlined by `html`, so
the file needs nothing else (no server, no network, no CDN)."""

from __future__ import annotations

from html import escape

CSS = """
:root { --fg:#1d2330; --muted:#6b7280; --line:#d9dde5; --bg:#fff; --soft:#f5f6f8; --warn:#b45309; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg);
  background: var(--bg); margin: 0; }
header { padding: 14px 24px; border-bottom: 1px solid var(--line); background: var(--soft); }
header h1 { font-size: 20px; margin: 0 0 4px; }
header .runs, header .notes { color: var(--muted); font-size: 12px; }
nav { position: sticky; top: 0; background: var(--bg); border-bottom: 1px solid var(--line);
  padding: 6px 24px; z-index: 2; }
nav a { margin-right: 14px; color: #2563eb; text-decoration: none; font-size: 13px; }
section { padding: 10px 24px 18px; border-bottom: 1px solid var(--line); }
section h2 { font-size: 17px; margin: 8px 0 10px; }
.empty { color: var(--muted); font-style: italic; }
.error { color: #991b1b; background: #fef2f2; border: 1px solid #fecaca; padding: 6px 10px; }
.warn { color: var(--warn); background: #fffbeb; border: 1px solid #fde68a; padding: 6px 10px;
  margin-bottom: 8px; font-weight: 600; }
.note { color: var(--muted); font-size: 12px; margin: 4px 0; }
table { border-collapse: collapse; font-size: 12px; }
th, td { border: 1px solid var(--line); padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: var(--soft); }
pre { background: var(--soft); padding: 8px; overflow: auto; max-height: 420px; font-size: 12px; }
.charts { display: flex; flex-wrap: wrap; gap: 14px; }
.chart { border: 1px solid var(--line); padding: 6px; width: 440px; }
.chart h3 { font-size: 13px; margin: 0 0 2px; }
.chart svg text { font-size: 10px; fill: var(--muted); }
.legend { font-size: 11px; display: flex; flex-wrap: wrap; gap: 4px 10px; }
.legend i { display: inline-block; width: 14px; height: 3px; margin-right: 4px; vertical-align: middle; }
.filters { display: flex; flex-wrap: wrap; gap: 8px; align-items: center; margin-bottom: 8px; }
.filters label { font-size: 12px; color: var(--muted); }
.filters input[type=number] { width: 72px; }
.browser { display: grid; grid-template-columns: minmax(360px, 38%) 1fr; gap: 14px; }
.eplist { max-height: 640px; overflow: auto; border: 1px solid var(--line); }
.eplist table { width: 100%; border: 0; }
.eplist tr { cursor: pointer; }
.eplist tr.sel td { background: #dbeafe; }
.eplist tr:hover td { background: #eff6ff; }
.episode { border: 1px solid var(--line); padding: 8px; min-width: 0; }
.turn { border-top: 1px dashed var(--line); padding: 6px 0; }
.turnhead { font-size: 12px; color: var(--muted); margin-bottom: 3px; }
.toks { font: 12px/1.7 ui-monospace, SFMono-Regular, Menlo, monospace; white-space: pre-wrap;
  word-break: break-all; }
.tok { border-radius: 2px; unicode-bidi: isolate; }  /* a right-to-left token reorders only itself */
.cut { color: var(--warn); font-style: italic; }
.cut-note code { font-weight: 400; word-break: break-all; }
.tok.masked { color: #9ca3af; background: repeating-linear-gradient(135deg, #f3f4f6 0 4px, #e5e7eb 4px 6px); }
.tok.untrained { border-bottom: 1px dotted #9ca3af; }
.scale { display: inline-block; width: 160px; height: 10px; vertical-align: middle;
  background: linear-gradient(90deg, rgb(178,24,43), #fff, rgb(33,102,172)); border: 1px solid var(--line); }
.diff { display: grid; grid-template-columns: 1fr 1fr; gap: 0 14px; }
.diff > div { min-width: 0; }
.diff .label { font-weight: 600; font-size: 12px; padding: 4px 0; }
.first-diff { background: #fff7ed; box-shadow: inset 3px 0 0 #f97316; }
.badge { display: inline-block; font-size: 11px; padding: 0 6px; border-radius: 8px; background: #e5e7eb; }
.badge.ok { background: #dcfce7; } .badge.bad { background: #fee2e2; } .badge.mark { background: #fed7aa; }
"""


def html(title: str, data_json: str, script: str) -> str:
    """The whole page. `data_json` must already have every "<" escaped (build.render does it)."""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>steprl report: {escape(title)}</title>
<style>{CSS}</style>
</head>
<body>
<header id="top"></header>
<nav id="nav"></nav>
<main id="sections"></main>
<script type="application/json" id="report-data">{data_json}</script>
<script>{script}</script>
</body>
</html>
"""
