"""The verdict's sentences about the plan as a whole: its prediction against the baselines, what its proof does not
cover, where its costs come from, the devices it leaves out, and the caveats of mixture-of-experts and encrypted
hand-offs. planner/compose.py puts them in order; each part of the planner adds its own lines beside them."""

from __future__ import annotations

from hetero.families import family
from hetero.graph import LayerGraph
from hetero.plan import Baseline, Plan, Prediction, SolverReport, StagePlan
from hetero.planner.model.cost_model import CostModel, RooflineCostModel
from hetero.planner.model.profile_cost import ProfileCostModel
from hetero.specs import ClusterSpec, ModelSpec, PlannerOptions


def rate_words(prediction: Prediction) -> str:
    """``1,234 trained tokens/s of 5,678 computed`` where the data was measured, else the computed rate, said so."""
    if prediction.trained_tokens_per_s is not None:
        return (f"{prediction.trained_tokens_per_s:,.0f} trained tokens/s of {prediction.tokens_per_s:,.0f} computed, "
                f"at the {prediction.label_fraction:.0%} label share measured on the training data")
    return f"{prediction.tokens_per_s:,.0f} computed tokens/s, padding included: no data statistics"

def verdict_lines(prediction: Prediction, stages: list[StagePlan], base: list[Baseline], solver: SolverReport) -> list[str]:
    """Sentences a person reads: the prediction, the comparison, and when one device is enough."""
    step = prediction.step_time_s
    names = ", ".join(f"{s.device_type} ({s.device})" for s in stages)
    out = [f"Predicted {step:.3g} s/step ({rate_words(prediction)}) on {len(stages)} stage(s): "
           f"{names}; bubble {prediction.bubble_fraction:.0%}."]
    out += [f"Stage {s.index} ({s.device}): {s.stream_summary()}, {s.stream_layers[0]}..{s.stream_layers[-1]}, "
            f"{s.memory.host_gb:.1f} GB of {s.host}'s RAM." for s in stages if s.stream_layers]
    for b in base:
        if not b.feasible or b.prediction is None:
            out.append(f"{b.name}: not possible ({b.reason}).")
            continue
        other = b.prediction.step_time_s
        out.append(f"{other / step:.2f}x the throughput of {b.name.replace('_', ' ')} "
                   f"({b.description}: {other:.3g} s/step).")
    single = next((b for b in base if b.name == "best_single_device" and b.prediction), None)
    if single is not None and single.prediction is not None and len(stages) > 1:
        other = single.prediction.step_time_s
        if other <= step * 1.02:  # within 2%: the pipeline's extra machinery buys nothing
            out.append(f"A single {single.description.split(' (')[0]} is as fast ({other:.3g} s/step vs "
                       f"{step:.3g} s): use it alone.")
    if len(stages) == 1:
        faster = sorted((b.prediction.step_time_s, b.name.replace("_", " ")) for b in base
                        if b.feasible and b.prediction is not None and b.prediction.step_time_s < step / 1.02)
        if not faster:
            out.append(f"The whole model fits and runs fastest on one device ({stages[0].device}): no pipeline "
                       "needed.")
        else:  # a stage count or split that was asked for keeps it on one device
            out.append(f"The plan runs on one device ({stages[0].device}), but {faster[0][1]} over the fleet would "
                       f"be {step / faster[0][0]:.2f}x as fast ({faster[0][0]:.3g} s/step): leave planner.num_stages "
                       "and planner.split unset to let the planner use it.")
    if not solver.proven_optimal and solver.solver != "manual":
        out.append(unproven_line(solver))
    return out

# Where the placement is proven and another part is not, the verdict says both: this line says which holds.
UNPROVEN = "Not proven optimal as a whole (any proof above covers its own part only)."

def unproven_line(solver: SolverReport) -> str:
    """What the plan's proof does not cover: each unsettled part, why, and the best lower bound."""
    if not solver.unsettled:
        gap = f" (gap {solver.gap:.1%})" if solver.gap is not None else ""
        return f"The solver stopped before proving optimality{gap}: {solver.message}."
    by_why: dict[str, list[str]] = {}
    for part, why in solver.unsettled.items():
        by_why.setdefault(why, []).append(part)
    parts = "; ".join(f"{', '.join(names)}: {why}" for why, names in by_why.items())
    bound = (f" The best lower bound on any plan's step is {solver.lower_bound_s:.4g} s/step (the solvers' step "
             "model)." if solver.lower_bound_s is not None else "")
    return (f"{UNPROVEN} Not settled: {parts}.{bound} Raise planner.time_limit_s to settle it.")

def cost_provenance(cost_model: CostModel) -> tuple[dict[str, str], list[str]]:
    """Where a measured profile's numbers went (plan.cost_sources) and the verdict's line on it; none from
    datasheets alone."""
    if not isinstance(cost_model, ProfileCostModel):
        if not isinstance(cost_model, RooflineCostModel):
            return {}, []  # a cost model of the caller's own says its own provenance
        return {}, [f"These costs come from datasheets, not measurements: every device is priced at "
                    f"{cost_model.efficiency:.0%} of its datasheet TFLOPS (planner.efficiency), whatever its vendor, "
                    "so the prediction, the comparisons and any proof above hold for that model of the fleet; "
                    "`hetero profile` measures the fleet, and `hetero compile ... profile=FILE` plans on what it "
                    "measured (docs/profiling.md)."]
    return {"profile": cost_model.path, **cost_model.sources}, cost_model.summary()

def cipher_lines(cost_model: CostModel, plan_: Plan) -> list[str]:
    """The verdict's line where the plan's hand-offs cross links priced with CurveZMQ's cipher estimate
    (security=curve; a link a profile measured under the cipher is taken as measured)."""
    roofline = cost_model.fallback if isinstance(cost_model, ProfileCostModel) else cost_model
    if not isinstance(roofline, RooflineCostModel) or not roofline.cipher_s_per_byte:
        return []
    crossed = sorted({f"{min(a, b)}<->{max(a, b)}" for a, b in hand_off_hosts(plan_)})
    if isinstance(cost_model, ProfileCostModel):
        crossed = [k for k in crossed if "CurveZMQ estimate" in cost_model.sources.get(f"link {k}", "fleet file")
                   or cost_model.sources.get(f"link {k}", "fleet file").startswith("fleet file")]
    if not crossed:
        return []
    return [f"The links the hand-offs cross ({', '.join(crossed)}) carry CurveZMQ-encrypted messages "
            "(security=curve), not measured with the cipher: each hand-off is priced with its transfer "
            f"plus the cipher's work at {1 / roofline.cipher_s_per_byte / 1e9:.2g} GB/s (measured on a 2-core CPU, "
            "bench/bench_cipher.py); `hetero profile` measures your links with the cipher, and security=none drops it "
            "on a network you trust (docs/security.md)."]

def hand_off_hosts(plan_: Plan) -> list[tuple[str, str]]:
    """The (sender, receiver) hosts of every hand-off of ``plan_``: each stage to the next of its pipeline, and under
    an interleaved schedule the last device to the first."""
    pairs = []
    for rep in plan_.pipelines:
        hosts = [plan_.stages[k].host for k in rep.stages]
        pairs += list(zip(hosts[:-1], hosts[1:], strict=True))
        if any(plan_.stages[k].chunks for k in rep.stages):
            pairs.append((hosts[-1], hosts[0]))
    return pairs

def unused_lines(fleet: ClusterSpec, stages: list[StagePlan], options: PlannerOptions) -> list[str]:
    """The fleet's training devices the plan leaves out, named (a card a person owns is not dropped without a word)."""
    used = {s.device for s in stages}
    unused = [f"{d.name} ({d.type})" for d in fleet.devices if d.name not in used]
    if not unused:
        return []
    if options.split is not None or options.devices is not None:
        why = "planner.split/devices name the devices to use"
    elif options.num_stages is not None:
        why = f"planner.num_stages={options.num_stages}"
    else:
        why = (f"no placement the search found is faster with {'it' if len(unused) == 1 else 'them'}: a stage there "
               "would slow the pipeline, or not fit")
    return [f"Not used: {', '.join(unused)} ({why})."]

def experts_lines(graph: LayerGraph, cost_model: CostModel, model: ModelSpec) -> list[str]:
    """The caveat of a mixture-of-experts plan priced from datasheets: the roofline prices the experts' matmuls at
    the matmul rate with the tokens spread evenly over the experts (bench/bench_experts.py measured a step at
    1.0x (mixtral) to 2.0x (qwen3_moe, 128 experts) the prediction with grouped experts and up to 3.3x with the eager
    loop, against 1.2-1.6x for the dense families of W6 in docs/benchmarks.md). Every MoE plan of a family whose
    checkpoints store the experts in another format says what the stages hold instead."""
    if not any(n.expert_params for n in graph.nodes):
        return []
    experts = family(model.model_type).experts
    held = ("quantizes them again to NF4 where its device takes nf4 (a second rounding of the experts)"
            if model.quantization == "nf4" else "holds them at its compute dtype")
    stored = [] if experts is None or experts.stored_format is None else [
        f"Its published checkpoints store the experts in {experts.stored_format}; each stage dequantizes them while "
        f"loading and {held}, as this plan prices them."]
    if isinstance(cost_model, ProfileCostModel):
        return stored
    return stored + datasheet_experts_lines(model)

def datasheet_experts_lines(model: ModelSpec) -> list[str]:
    if model.experts_implementation == "eager":
        return ["This model routes each token to a few experts, which run one by one "
                "(model.experts_implementation=eager); datasheet costs price them at the matmul rate and predict its "
                "steps too fast (on CPU a mixture-of-experts step took up to 3.3x the prediction, dense models "
                "1.2-1.6x): grouped experts run faster, and a profile of the fleet prices them as they run."]
    if model.quantization != "none":
        return [f"This model routes each token to a few experts, in {model.quantization}: each used expert dequantizes "
                "its weights and runs on its tokens, one after another (there is no grouped matmul for quantized "
                "experts); datasheet costs price them at the matmul rate with the tokens spread evenly over the "
                "experts and have not been checked against a measured quantized mixture-of-experts step: a profile "
                "of the fleet prices them as they run."]
    return ["This model routes each token to a few experts, run as grouped matmuls; datasheet costs price them at "
            "the matmul rate with the tokens spread evenly over the experts, which leaves out small groups, uneven "
            "routing and the routing kernels' launches (on CPU a mixture-of-experts step took 1.0-2.0x the "
            "prediction, dense models 1.2-1.6x): a profile of the fleet prices them as they run."]
