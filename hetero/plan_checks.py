"""What a plan's types cannot say, checked when plan.json is loaded: stages that tile the graph in order on the
fleet's devices, runnable programs, stage names with keys, replicas that add up, finite non-negative costs."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hetero.errors import PlanError
from hetero.program import Op, parse_program
from hetero.serde import short_repr, to_dict
from hetero.specs import BYTES_PER_DTYPE, MAX_COUNT, QUANT_BYTES_PER_PARAM, check_ranges, check_ssh

if TYPE_CHECKING:
    from hetero.plan import Plan

_RECOMPILE = "recompile with `hetero compile`"


def has_security(data: Any) -> bool:
    """Whether a plan's JSON has its security section (with a mode)."""
    return isinstance(data, dict) and isinstance(data.get("security"), dict) and "mode" in data["security"]


def check_plan(plan: Plan, where: str = "plan.json") -> None:
    """What the types cannot say: stages that tile the graph in order on the fleet's devices, runnable
    programs, and finite, non-negative costs (a runtime or a Gantt built on NaN fails far from the cause)."""

    def bad(what: str) -> PlanError:
        return PlanError(f"{where}: {what}; {_RECOMPILE}")

    try:
        check_ranges(plan.model, plan.train, plan.planner, PlanError)
    except PlanError as exc:
        raise bad(str(exc)) from None
    _check_architecture(plan.model.architecture, bad)
    data = to_dict(plan)
    for section in ("model", "cluster", "graph", "stages", "prediction", "baselines", "train", "planner", "data_stats"):
        found = _non_finite(data[section], section, skip=("model.architecture",))
        if found:
            raise bad(f"{found} is not a finite number")
    nodes = plan.graph.nodes
    if not nodes or len(plan.graph.edges) != len(nodes) - 1:
        raise bad(f"graph has {len(nodes)} nodes and {len(plan.graph.edges)} cuts between them")
    for i, node in enumerate(nodes):  # counts the wire's size limits multiply: exact as floats, like every counter
        for key in ("num_params", "linear_params", "lora_params", "expert_params"):
            if not 0 <= getattr(node, key) <= MAX_COUNT:
                raise bad(f"graph.nodes[{i}].{key} is {short_repr(getattr(node, key))}, outside 0..{MAX_COUNT}")
    for i, h in enumerate(plan.cluster.hosts):
        if h.ssh is not None:  # may be added by hand (outside the hash): the fleet file's rules
            check_ssh(h.ssh, f"{where}: cluster.hosts[{i}].ssh", PlanError)
    if not plan.stages:
        raise bad("no stages")
    _check_replicas(plan, bad)
    for k in range(len(plan.stages)):
        _check_stage_place(plan, k, bad)
        _check_stage_run(plan, k, bad)
    _check_chunks(plan, bad)
    _check_stage_names(plan, bad)


def _check_chunks(plan: Plan, bad: Callable[[str], PlanError]) -> None:
    """An interleaved pipeline: every device holds as many chunks, its program names them all, and chunk c of
    stage k of p (virtual stage c x p + k) holds the nodes after virtual stage c x p + k - 1's, up to the last."""
    v = 1 + len(plan.stages[0].chunks)
    if all(not s.chunks for s in plan.stages):
        return
    if plan.replicas:
        raise bad("stages hold chunks (an interleaved schedule) in a plan of replicas; an interleaved plan is one "
                  "pipeline")
    nodes, p = plan.graph.nodes, len(plan.stages)
    following = 0
    for j in range(p * v):
        k, c = j % p, j // p
        s, at = plan.stages[k], f"stages[{k}]"
        if len(s.chunks) != v - 1:
            raise bad(f"{at} holds {1 + len(s.chunks)} chunks and stages[0] {v}: every device of an interleaved "
                      "pipeline holds as many")
        first, last = s.spans()[c]
        if first != following or not first <= last < len(nodes):
            raise bad(f"{at}'s chunk {c} covers nodes {first}..{last}; virtual stage {j} must start at node "
                      f"{following}")
        following = last + 1
        if c and s.chunks[c - 1].node_names != [n.name for n in nodes[first:last + 1]]:
            raise bad(f"{at}.chunks[{c - 1}].node_names do not match graph nodes {first}..{last}")
        if c and (not set(s.chunks[c - 1].recompute_layers) <= set(s.chunks[c - 1].node_names)
                  or min(s.chunks[c - 1].fwd_time_s, s.chunks[c - 1].bwd_time_s, s.chunks[c - 1].send_time_s) < 0):
            raise bad(f"{at}.chunks[{c - 1}] recomputes layers outside it or has a negative time")
        if s.stream_layers:
            raise bad(f"{at} streams weights: interleaved chunks do not yet")
        if sorted({a.chunk for a in s.actions() if a.op != "STEP"}) != list(range(v)):
            raise bad(f"{at}.program does not run its {v} chunks")
    if following != len(nodes):
        raise bad(f"the interleaved pipeline covers nodes 0..{following - 1} of 0..{len(nodes) - 1}")


def _check_stage_names(plan: Plan, bad: Callable[[str], PlanError]) -> None:
    """Every stage's process name is stage<N>, used once, and (with keys) one the plan holds keys for."""
    names = plan.stage_ids()
    for k, name in enumerate(names):
        if not re.fullmatch(r"stage[0-9]{1,6}", name):
            raise bad(f"stages[{k}].name {short_repr(name)} is not stage<N>")
        if names.index(name) != k:
            raise bad(f"stages[{names.index(name)}] and stages[{k}] both run as {name}")
        known = plan.security.public_keys if plan.security.mode == "curve" else plan.security.token_verifiers
        if plan.security.mode != "none" and known and name not in known:
            raise bad(f"stages[{k}] runs as {name}, which has no key in the plan's security section: "
                      "run `hetero keys plan.json`")


def _check_stage_place(plan: Plan, k: int, bad: Callable[[str], PlanError]) -> None:
    """Stage k runs on a device of the fleet and holds the graph nodes after its predecessor's, by name."""
    s, nodes, at = plan.stages[k], plan.graph.nodes, f"stages[{k}]"
    if s.index != k:
        raise bad(f"{at}.index is {s.index}")
    host, device = {d.name: (h.name, d) for h in plan.cluster.hosts for d in h.devices}.get(s.device, (None, None))
    if device is None or host != s.host or (device.type, device.backend) != (s.device_type, s.backend):
        raise bad(f"{at} runs on {s.host}/{s.device} ({s.device_type}, {s.backend}), not a device of the fleet")
    prev = plan.prev_stage(k)
    next_node = 0 if prev is None else plan.stages[prev].last_node + 1
    if s.first_node != next_node or not s.first_node <= s.last_node < len(nodes):
        raise bad(f"{at} covers nodes {s.first_node}..{s.last_node}; the stages of a pipeline must cover nodes "
                  f"0..{len(nodes) - 1} in order")
    if plan.next_stage(k) is None and s.last_node != len(nodes) - 1 and not s.chunks:
        raise bad(f"the pipeline ending with {at} covers nodes 0..{s.last_node} of 0..{len(nodes) - 1}")
    if s.node_names != [n.name for n in nodes[s.first_node : s.last_node + 1]]:
        raise bad(f"{at}.node_names do not match graph nodes {s.first_node}..{s.last_node}")
    if not set(s.recompute_layers) <= set(s.node_names):
        raise bad(f"{at}.recompute_layers names layers outside the stage")
    if not set(s.stream_layers) <= set(s.node_names):
        raise bad(f"{at}.stream_layers names layers outside the stage")


def _check_stage_run(plan: Plan, k: int, bad: Callable[[str], PlanError]) -> None:
    """Stage k's dtype, endpoint, costs, threads and program are ones a runtime can run."""
    s, at = plan.stages[k], f"stages[{k}]"
    if s.dtype not in BYTES_PER_DTYPE or s.quantization not in ("none", *QUANT_BYTES_PER_PARAM):
        raise bad(f"{at} computes in {s.dtype!r} with quantization {s.quantization!r}")
    scheme, _, port = s.endpoint.rpartition(":")
    if not scheme.startswith("tcp://") or not port.isdigit() or not 0 < int(port) < 65536:
        raise bad(f"{at}.endpoint {s.endpoint!r} is not tcp://<address>:<port>")
    costs = [s.fwd_time_s, s.bwd_time_s, s.send_time_s, s.recompute_time_s, s.step_sync_s, s.stream_time_s,
             s.streamed_bytes_per_step, s.frozen_resident_cap_bytes,
             *s.overhead_s.values(), *(v for v in vars(s.memory).values() if not isinstance(v, list)),
             *s.memory.chunk_gb_per_mb]
    if min(costs) < 0:
        raise bad(f"{at} has a negative time or memory")
    if s.threads is not None and s.threads < 1:
        raise bad(f"{at}.threads is {s.threads}")
    if s.compress_out not in ("none", "int8", "int4"):
        raise bad(f"{at}.compress_out {s.compress_out!r}: expected none, int8 or int4")
    if s.compress_out != "none" and plan.next_stage(k) is None and not s.chunks:  # chunks: the last hands on to the first
        raise bad(f"{at}.compress_out is {s.compress_out!r}, but the stage is its pipeline's last")
    try:
        actions = parse_program(s.program)
    except ValueError as exc:
        raise bad(f"{at}.program: {exc}") from None
    if any(a.chunk > len(s.chunks) for a in actions):
        raise bad(f"{at}.program names chunk {max(a.chunk for a in actions)}, but the stage holds "
                  f"{1 + len(s.chunks)}")
    m = plan.micro_batches_of(k)
    where = "train.num_micro_batches" if not plan.replicas else "its replica's num_micro_batches"
    if any(a.mb >= m for a in actions):
        raise bad(f"{at}.program names a micro-batch past {where}={m}")
    for chunk in range(1 + len(s.chunks)):  # a count edited by hand: the program would train on part of the step
        for op in (Op.F, Op.B):
            done = sorted(a.mb for a in actions if a.op == op and a.chunk == chunk)
            if done != list(range(m)):
                raise bad(f"{at}.program runs {op.value} on {len(done)} micro-batch(es) of chunk {chunk}, not each of "
                          f"{where}={m} once")


# The architecture's sizes every stage builds its layers from: whole numbers (a hand-edited "64" is a traceback deep
# in transformers, in every stage), and its scalars numbers.
_ARCH_COUNTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_key_value_heads",
                "intermediate_size", "head_dim", "max_position_embeddings", "num_experts", "num_local_experts",
                "num_experts_per_tok", "moe_intermediate_size")
_ARCH_NUMBERS = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "initializer_range")


def _check_architecture(arch: dict[str, Any], bad: Callable[[str], PlanError]) -> None:
    for key in _ARCH_COUNTS:
        value = arch.get(key)
        if value is None and key in arch and key in _ARCH_COUNTS[:4]:  # the four every family sets
            raise bad(f"model.architecture.{key} is null: expected a whole number")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT):
            raise bad(f"model.architecture.{key} is {short_repr(value)}: expected a whole number in 0..{MAX_COUNT}")
    for key in _ARCH_NUMBERS:
        value = arch.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not math.isfinite(value)):
            raise bad(f"model.architecture.{key} is {short_repr(value)}: expected a finite number")


def _check_replicas(plan: Plan, bad: Callable[[str], PlanError]) -> None:
    """Replicas partition the stages in order (replica r's follow replica r-1's), on distinct devices,
    and their shares partition the step's micro-batches in order."""
    if not plan.replicas:
        return
    expect_stage, expect_mb = 0, 0
    for r, rep in enumerate(plan.replicas):
        at = f"replicas[{r}]"
        if not rep.stages or rep.stages != list(range(expect_stage, expect_stage + len(rep.stages))):
            raise bad(f"{at}.stages is {rep.stages}; expected stages {expect_stage}.. in order")
        if rep.num_micro_batches < 1 or rep.first_micro_batch != expect_mb:
            raise bad(f"{at} takes micro-batches {rep.first_micro_batch}..+{rep.num_micro_batches}; expected "
                      f"at least one from {expect_mb}")
        if not math.isfinite(rep.step_time_s) or rep.step_time_s < 0:
            raise bad(f"{at}.step_time_s is {rep.step_time_s}")
        expect_stage += len(rep.stages)
        expect_mb += rep.num_micro_batches
    if expect_stage != len(plan.stages):
        raise bad(f"the replicas hold {expect_stage} of the plan's {len(plan.stages)} stages")
    if expect_mb != plan.train.num_micro_batches:
        raise bad(f"the replicas' micro-batches sum to {expect_mb}, train.num_micro_batches is "
                  f"{plan.train.num_micro_batches}")
    used = [s.device for s in plan.stages]
    twice = sorted({d for d in used if used.count(d) > 1})
    if twice:
        raise bad(f"device {twice[0]} runs two stages")


def _non_finite(value: Any, where: str, skip: tuple[str, ...]) -> str | None:
    """The path of the first NaN or infinity in a tree of dicts and lists, or None (no recursion)."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if at in skip:
            continue
        if isinstance(item, float) and not math.isfinite(item):
            return at
        if isinstance(item, dict):
            stack.extend((v, f"{at}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))
    return None
