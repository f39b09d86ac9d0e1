"""Hosts the solvers cannot tell apart: four identical boxes on one switch are one host four times over.

Swapping two hosts a and b (each device of a for a device of b alike, cost.device_key) leaves a cost table as
it is when both hold the same devices, every link and reduction cost between hosts reads the same with a and b
swapped, and so do their cores and RAM. Any plan then has a twin, as fast, with a and b's devices swapped. The
replica search (planner/replica/replicas.py) uses it for the coordinator: the host of the gradient sum need only be
tried once per class of interchangeable hosts.
"""

from __future__ import annotations

from hetero.planner.model.cost import CostTable, device_key


def _host_matrices(table: CostTable) -> list[list[list]]:  # type: ignore[type-arg]
    """Every [host][host] array of the table."""
    per_node = [table.link_s, table.link_compress, table.link_plain_s, table.link_squeezed_s]
    return ([m for rows in per_node for kinds in rows for m in kinds]
            + [m for m in (table.sync_round_trip_s, table.reduce_s_per_byte) if m])


def _devices(table: CostTable) -> dict[int, list[tuple]]:  # type: ignore[type-arg]
    """Per host, its devices' keys (cost.device_key), in one order."""
    keys: dict[int, list[tuple]] = {}  # type: ignore[type-arg]
    for d in range(table.num_devices):
        keys.setdefault(table.host_of[d], []).append(device_key(table, d))
    return {h: sorted(k, key=repr) for h, k in keys.items()}


def interchangeable(table: CostTable, a: int, b: int,
                    devices: dict[int, list[tuple]] | None = None) -> bool:  # type: ignore[type-arg]
    """Whether swapping hosts ``a`` and ``b`` leaves ``table`` as it is (``devices``: _devices(table), if known)."""
    if a == b:
        return True
    devices = _devices(table) if devices is None else devices
    if devices.get(a, []) != devices.get(b, []):
        return False
    for vector in (table.host_cores, table.host_usable_cores, table.host_ram_bytes):
        if len(vector) > max(a, b) and vector[a] != vector[b]:
            return False
    for m in _host_matrices(table):
        hosts = len(m)
        if max(a, b) >= hosts:
            continue
        swap = list(range(hosts))
        swap[a], swap[b] = b, a
        if any(m[x][y] != m[swap[x]][swap[y]] for x in range(hosts) for y in range(hosts)):
            return False
    return True


def representatives(table: CostTable, hosts: list[int]) -> list[int]:
    """One host of ``hosts`` per class of interchangeable ones (the first of each, in order)."""
    kept: list[int] = []
    devices = _devices(table)
    for h in hosts:
        if not any(interchangeable(table, k, h, devices) for k in kept):
            kept.append(h)
    return kept
