"""The cost table's link side: every cut's transfer per wire kind and host pair, its messages' CPU time, the step's
sync round trips, the replicas' gradient reduction per byte, and which inter-host links planner.compression=auto
compresses (build_cost_table in planner/model/cost.py assembles the table from these)."""

from __future__ import annotations

from dataclasses import dataclass

from hetero.graph import LayerGraph
from hetero.planner.model.cost import AUTO_SCHEME, REDUCE_PROBE_BYTES, SYNC_BYTES
from hetero.planner.model.cost_model import (
    WIRE_BYTES_PER_VALUE,
    CostModel,
    wire_values_per_token,
)
from hetero.specs import ClusterSpec


@dataclass
class LinkCosts:
    """A CostTable's link, message, sync and reduction arrays (see its fields)."""

    link_s: list[list[list[list[float]]]]
    message_send_s: list[list[list[float]]]
    message_recv_s: list[list[list[float]]]
    sync_round_trip_s: list[list[float]]
    reduce_s_per_byte: list[list[float]]
    link_compress: list[list[list[list[bool]]]]
    link_plain_s: list[list[list[list[float]]]]  # [node][kind][host a][host b] uncompressed (with ``squeezed``)
    link_squeezed_s: list[list[list[list[float]]]]  # the same, AUTO_SCHEME hand-offs priced as auto prices them


def link_costs(cluster: ClusterSpec, cost_model: CostModel, hosts: list[str],
                kind_bytes: list[list[float]], codec: list[list[tuple[float, float]]] | None = None,
                squeeze: tuple[list[float], list[list[tuple[float, float]]]] | None = None,
                auto: bool = False) -> LinkCosts:
    """Every cut's transfer per wire kind and host pair, its messages' CPU cost per device (``codec``: plus the
    [node][device] (encode, decode) seconds of compressed hand-offs), the step's sync round trips and the replicas'
    gradient reduction per byte. ``squeeze``: the compressed bytes per node and the [node][host] (encode, decode)
    seconds of its slowest device, which price every link compressed beside plain (``link_squeezed_s``); ``auto``: a
    link between hosts takes the compressed hand-off where that is faster."""
    devices, n_nodes, n_kinds = cluster.devices, len(kind_bytes), len(kind_bytes[0])
    link = [[[[float(cost_model.transfer_time_s(cluster, a, b, kind_bytes[i][k])) for b in hosts] for a in hosts]
             for k in range(n_kinds)] for i in range(n_nodes)]
    plain = [[[list(row) for row in rows] for rows in per_node] for per_node in link] if squeeze is not None else []
    squeezed = _squeezed(cluster, cost_model, hosts, link, squeeze) if squeeze is not None else []
    choice = _auto_links(link, squeezed) if auto and squeezed else []
    sends: list[list[list[float]]] = []
    recvs: list[list[list[float]]] = []
    for i in range(n_nodes):
        per_kind = [[cost_model.message_s(d, kind_bytes[i][k]) for d in devices] for k in range(n_kinds)]
        enc = [c[0] for c in codec[i]] if codec else [0.0] * len(devices)
        dec = [c[1] for c in codec[i]] if codec else [0.0] * len(devices)
        sends.append([[float(s) + enc[j] for j, (s, _) in enumerate(row)] for row in per_kind])
        recvs.append([[float(r) + dec[j] for j, (_, r) in enumerate(row)] for row in per_kind])
    sync = [[2.0 * float(cost_model.transfer_time_s(cluster, a, b, SYNC_BYTES)) for b in hosts] for a in hosts]
    # Replicas' gradient reduction: up to the coordinator and the sum back down, each a transfer plus a
    # send and a receive (the slowest device of the sending host stands for the stage, and for the
    # coordinator's side too), per byte at a large message so the fixed costs nearly vanish.
    cpu_per_byte = [max((sum(cost_model.message_s(d, REDUCE_PROBE_BYTES)) for d in devices if d.host == h),
                        default=0.0) / REDUCE_PROBE_BYTES for h in hosts]
    reduce = [[2.0 * float(cost_model.transfer_time_s(cluster, a, b, REDUCE_PROBE_BYTES)) / REDUCE_PROBE_BYTES
               + 2.0 * cpu_per_byte[i] for b in hosts] for i, a in enumerate(hosts)]
    return LinkCosts(link, sends, recvs, sync, reduce, choice, plain, squeezed)


def _squeezed(cluster: ClusterSpec, cost_model: CostModel, hosts: list[str], link: list[list[list[list[float]]]],
              squeeze: tuple[list[float], list[list[tuple[float, float]]]]) -> list[list[list[list[float]]]]:
    """Each link between two hosts with AUTO_SCHEME hand-offs: the compressed bytes' transfer plus the encode (the
    sending host's slowest device) and decode (the receiving host's); a link inside a host, and a node whose cut
    carries nothing, as plain."""
    comp_bytes, host_codec = squeeze
    out = []
    for i, per_node in enumerate(link):
        squeezed = [[float(cost_model.transfer_time_s(cluster, a, b, comp_bytes[i])) + host_codec[i][ia][0]
                     + host_codec[i][ib][1] for ib, b in enumerate(hosts)] for ia, a in enumerate(hosts)]
        out.append([[[squeezed[ia][ib] if ia != ib and comp_bytes[i] > 0 else plain[ia][ib] for ib in range(len(hosts))]
                     for ia in range(len(hosts))] for plain in per_node])
    return out


def _auto_links(link: list[list[list[list[float]]]], squeezed: list[list[list[list[float]]]]
                ) -> list[list[list[list[bool]]]]:
    """planner.compression=auto: each link between two hosts compressed where its ``squeezed`` hand-off beats the
    plain transfer; ``link`` is updated in place, and the choice returned as [node][kind][host a][host b]."""
    choice: list[list[list[list[bool]]]] = []
    for per_node, per_node_squeezed in zip(link, squeezed, strict=True):
        choice.append([])
        for rows, squeezed_rows in zip(per_node, per_node_squeezed, strict=True):
            choice[-1].append([[s < r for r, s in zip(row, srow, strict=True)] for row, srow in zip(rows, squeezed_rows, strict=True)])
            for ia, row in enumerate(rows):
                for ib, r in enumerate(row):
                    row[ib] = min(r, squeezed_rows[ia][ib])
    return choice


def auto_inputs(graph: LayerGraph, cluster: ClusterSpec, tokens: int, cost_model: CostModel
                ) -> tuple[list[float], list[list[tuple[float, float]]]]:
    """What planner.compression=auto weighs per node: the compressed hand-off's bytes, and per host the (encode,
    decode) seconds of its slowest device."""
    comp, per_host = [], []
    for i in range(len(graph.nodes)):
        values = wire_values_per_token(graph, i) * tokens
        comp.append(values * WIRE_BYTES_PER_VALUE[AUTO_SCHEME])
        costs = [[cost_model.codec_s(d, AUTO_SCHEME, values) for d in host.devices] for host in cluster.hosts]
        per_host.append([(max((c[0] for c in cs), default=0.0), max((c[1] for c in cs), default=0.0)) for cs in costs])
    return comp, per_host
