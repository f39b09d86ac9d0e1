"""What compressing each link's hand-offs does to the step: the verdict's per-link lines (issue 37).

Where hand-offs between hosts may go either way (planner.compression auto or none), the cost table prices every
link between hosts both plain and with AUTO_SCHEME hand-offs (planner/model/link_costs.py). For a one-pipeline plan, each
link of its pipeline that crosses hosts gets a line with the simulated step both ways, every other link as planned:
under auto it says why the link is or is not compressed, under none what auto would gain there.
"""

from __future__ import annotations

import copy

from hetero.planner.model.cost import AUTO_SCHEME, CostTable
from hetero.planner.model.objective import Evaluation, evaluate
from hetero.planner.model.predict import predict
from hetero.specs import ClusterSpec

MOST_LINES = 4  # links named one by one; the rest are counted


def link_steps(table: CostTable, ev: Evaluation, pos: int) -> tuple[float, float]:
    """The simulated step of ``ev``'s pipeline with the link after position ``pos`` uncompressed and compressed (the
    other links as the table prices them)."""
    devices, spans = ev.placement.devices, ev.placement.spans
    a, b = devices[pos], devices[pos + 1]
    node, kind, ha, hb = spans[pos][1], table.wire_kind[a], table.host_of[a], table.host_of[b]
    steps = []
    for source in (table.link_plain_s, table.link_squeezed_s):
        link_s = copy.copy(table.link_s)
        link_s[node] = copy.deepcopy(table.link_s[node])
        link_s[node][kind][ha][hb] = source[node][kind][ha][hb]
        priced = table.priced_links(link_s)
        steps.append(predict(priced, evaluate(priced, ev.placement))[0].step_time_s)
    return steps[0], steps[1]


def _why(table: CostTable, ev: Evaluation, pos: int, compression: str, faster: bool) -> str:
    """What the plan sends on the link after position ``pos``, and why, by auto's rule (compressed where the compressed
    transfer, encoding and decoding included, is shorter than the plain one); ``faster``: whether the step is too.
    An interleaved plan's chunks hand on across the same link by the same rule (planner/search/interleave.py)."""
    devices, node = ev.placement.devices, ev.placement.spans[pos][1]
    a, b, kind = table.host_of[devices[pos]], table.host_of[devices[pos + 1]], table.wire_kind[devices[pos]]
    shorter = table.link_squeezed_s[node][kind][a][b] < table.link_plain_s[node][kind][a][b]
    if not shorter:
        reason = "encoding and decoding cost more than the smaller transfer saves"
    else:
        reason = ("its transfer, encoding and decoding included, is shorter than the plain one"
                  + ("" if faster else ", though the step does not gain from it"))
    if compression == "auto":
        return f"{AUTO_SCHEME} (auto: {reason})" if shorter else f"uncompressed (auto: {reason})"
    return (f"uncompressed (planner.compression=none); planner.compression=auto would "
            f"{'compress it' if shorter else 'leave it so'}: {reason}")


def link_lines(table: CostTable, cluster: ClusterSpec, ev: Evaluation, compression: str,
               interleaved: bool = False) -> list[str]:
    """The verdict's line per link between hosts of a one-pipeline plan; none where hand-offs are not weighed."""
    if compression not in ("auto", "none") or not table.link_squeezed_s:
        return []
    devices = ev.placement.devices
    crossing = [pos for pos in range(len(devices) - 1) if table.host_of[devices[pos]] != table.host_of[devices[pos + 1]]]
    lines = []
    for pos in crossing[:MOST_LINES]:
        plain, squeezed = link_steps(table, ev, pos)
        a, b = table.devices[devices[pos]].host, table.devices[devices[pos + 1]].host
        where = (f"{'With one chunk per device, the l' if interleaved else 'L'}ink {a} -> {b} (stage {pos} to "
                 f"{pos + 1}, {cluster.link(a, b).bandwidth_gbps:g} Gbit/s)")
        change = (squeezed - plain) / plain if plain > 0 else 0.0
        both = f"{squeezed:#.3g} s/step with {AUTO_SCHEME} hand-offs, {plain:#.3g} s uncompressed ({change:+.1%})"
        lines.append(f"{where}: {both}; {_why(table, ev, pos, compression, squeezed < plain)}.")
    if len(crossing) > MOST_LINES:
        lines.append(f"... and {len(crossing) - MOST_LINES} more links between hosts.")
    return lines
