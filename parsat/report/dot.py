"""A plan's PCG as graphviz DOT text (`parsat show`): compute nodes as boxes, parallel operators as ellipses.

Names come from the plan file, so every string taken from it passes
`dot_text` before it reaches DOT.
"""

from __future__ import annotations

def dot_text(value: object) -> str:
    """A plan's text as the inside of a DOT double-quoted string: it can end neither the string nor the line.

    Names come from the plan file; a `"` would end the label and let the
    rest of the name add attributes (an SVG link to `javascript:`), a `\\`
    would start a DOT escape. Both are escaped, control characters dropped.
    """
    text = "".join(c for c in str(value) if c.isprintable())
    return text.replace("\\", "\\\\").replace('"', '\\"')


def plan_dot(data: dict) -> str:
    """The PCG as graphviz DOT: compute nodes as boxes, parallel operators as ellipses with their collective.

    Every string taken from the plan passes `dot_text`."""
    lines = ["digraph pcg {", '  rankdir=TB; node [fontname="Helvetica", fontsize=10];']
    for node in data["nodes"]:
        spread = node["spread"]
        layout = []
        if any(d != 1 for d in spread["shard"]):
            layout.append("shard " + "x".join(str(d) for d in spread["shard"]))
        if spread.get("copy", 1) != 1:
            layout.append(f"copy {spread['copy']}")
        if spread.get("sum", 1) != 1:
            layout.append(f"sum {spread['sum']}")
        where = ", ".join(layout) or "whole"
        shape = "x".join(str(d) for d in node["shape"])
        if node["kind"] == "leaf":
            label, style = f"{dot_text(node['op'])}\\n[{shape}]", 'shape=note, style=filled, fillcolor="#eeeeee"'
        elif node["kind"] == "parallel":
            attrs = ", ".join(f"{dot_text(k)}={v}" for k, v in node["attrs"].items())
            coll = "\\n".join(dot_text(c.split(" (")[0]) for c in node["cost"]["collectives"])
            label = f"{dot_text(node['op'])}({attrs})\\n{where}" + (f"\\n{coll}" if coll else "")
            style = 'shape=ellipse, style=filled, fillcolor="#ffe9b3"'
        else:
            label = f"{dot_text(node['op'])} #{node['id']}\\n[{shape}] {where}"
            style = 'shape=box, style=filled, fillcolor="#d8e8ff"'
        lines.append(f'  n{node["id"]} [label="{label}", {style}];')
        for source in node["inputs"]:
            lines.append(f"  n{source} -> n{node['id']};")
    lines.append("}")
    return "\n".join(lines) + "\n"
