"""LayerGraph: the model as a chain of pipeline-cuttable units, with costs per token. Torch-free."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from hetero.serde import from_dict, to_dict

NodeKind = Literal["embedding", "decoder", "norm", "head"]

LAYER_GRAPH_VERSION = 1


@dataclass(frozen=True)
class TensorSpec:
    """A tensor that crosses a cut. ``shape`` uses "batch" and "seq" for the symbolic dimensions."""

    name: str
    shape: list[int | str]
    dtype: str  # dtype of the traced graph; the wire dtype is the sending stage's compute dtype
    bytes_per_token: float  # at ``dtype``
    recomputed: bool = False  # True: cheap to rebuild on the receiving side (rotary cos/sin, mask)


@dataclass(frozen=True)
class LayerNode:
    name: str  # "embed", "layers.0", ..., "norm", "head"
    kind: NodeKind
    param_names: list[str]  # HF state-dict keys this node loads (e.g. "model.layers.0.mlp.up_proj.weight")
    num_params: int
    linear_params: int  # of num_params, those inside decoder nn.Linear weights (what nf4/int8 quantize)
    param_bytes: float  # frozen base weights under the model's dtype and quantization
    lora_params: int  # trainable LoRA parameters added to this node
    fwd_flops_per_token: float  # at the model's seq_len (attention's quadratic part averaged in)
    bwd_flops_per_token: float  # LoRA training: input grads (~1x fwd) + LoRA weight grads
    activation_bytes_per_token: float  # saved for backward, per micro-batch token, at compute dtype
    # Decoder layers: what the layer keeps per token when it recomputes its forward during backward
    # (its input). None: the node cannot recompute (graphs from before recomputation, non-decoders).
    recompute_bytes_per_token: float | None = None
    expert_params: int = 0  # of linear_params, mixture-of-experts weights (every expert; compute counts top-k)
    layer_type: str = ""  # decoder layers: the attention kind ("full_attention", "sliding_attention")
    # A mixture of experts: forward memory traffic per token of routing outside the matmuls, at the graph's dtype
    # (gather, weight, reorder, sum; compiler/costs.py MoE.dispatch_bytes). 0: a dense layer, or a graph from before.
    dispatch_bytes_per_token: float = 0.0


@dataclass(frozen=True)
class CutEdge:
    """The tensors that cross the cut between node ``after`` and the next node."""

    after: str
    tensors: list[TensorSpec]

    @property
    def bytes_per_token(self) -> float:
        return sum(t.bytes_per_token for t in self.tensors if not t.recomputed)


@dataclass(frozen=True)
class LayerGraph:
    model_name: str
    model_type: str
    seq_len: int
    dtype: str  # the dtype costs were computed in (bytes scale with the stage's compute dtype later)
    quantization: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    nodes: list[LayerNode]
    edges: list[CutEdge]  # len(nodes) - 1, edges[i] follows nodes[i]
    version: int = LAYER_GRAPH_VERSION
    notes: list[str] = field(default_factory=list)

    def node_index(self, name: str) -> int:
        for i, n in enumerate(self.nodes):
            if n.name == name:
                return i
        raise KeyError(name)

    def decoder_indices(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.kind == "decoder"]

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=1)

    @classmethod
    def from_dict(cls, data: dict) -> LayerGraph:
        return from_dict(cls, data, "layer_graph")
