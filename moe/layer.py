"""MoELayer: router + dispatcher + grouped experts (+ shared experts), a drop-in FFN replacement.

Balancing losses reach the gradient through autograd (attached to the output, scaled like the main
loss through `loss_scale_hooks`), their values land in `layer.last_stats`; `update_router_biases` and
`collect_moe_stats` serve the training loop.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from zero.dist import comm
from zero.dist.topology import group_rank, group_size
from zero.parallel.tensor import TensorSplit, substitute_parameters, sum_grad
from zero.plan import AttachedLossScale, attach_loss

from .dispatch import (
    AllToAllDispatcher,
    ExpertTensorParallelDispatcher,
    LocalDispatcher,
    TokenDispatcher,
    assign_slots,
    check_expert_parallel,
    assign_slots_static,
    expert_capacity,
)
from .experts import GroupedExperts, SharedExperts
from .router import TopKRouter, load_balancing_loss, router_z_loss, update_expert_bias

LOCAL_PATHS = ("auto", "host", "device")


class MoELayer(nn.Module):
    """Token-choice top-k Mixture-of-Experts feed-forward layer.

    x [..., dim] -> y [..., dim]. Dropless unless `capacity_factor` is set (then each expert keeps
    ceil(capacity_factor * tokens * top_k / E) highest-scoring slots per rank's tokens and dropped
    slots contribute zero, leaving the residual path). With `ep_group` of size P each rank holds
    E / P experts and tokens travel by all-to-all.

    Keyword options: activation ("swiglu" | "gelu"); renormalize (gate weights renormalised over the
    chosen k; default: softmax with top_k > 1, and always for sigmoid); jitter_eps (training-only
    multiplicative input noise for the router); num_groups / topk_groups (group-limited routing);
    bias_update_rate (aux-loss-free balancing; 0 disables; apply with `update_router_biases` after
    each optimizer step); seq_aux (aux loss per sequence, needs x [b, s, dim]); stats_group (group
    whose ranks hold other shards of the same sequences, e.g. sequence parallel: the aux/z statistics
    are summed over it); init_std; local_path ("auto" | "host" | "device", see below).

    `local_path` chooses how this rank routes, permutes and runs its experts. "host" (the CPU path): an
    exact-size assignment and, on one rank, the fused gather-MLP-scatter in expert chunks, which reads the
    segment sizes on the host. "device": a static assignment (every tensor sized before routing), the permuted
    rows through `torch._grouped_mm` with device-side offsets, and the gate-weighted combine: no
    `.item()`, `.tolist()` or `.cpu()` between router and output on one rank, and only the all-to-all
    split sizes under expert parallelism (NotImplementedError where torch._grouped_mm cannot serve the
    device and dtype). "auto" (default): "device" on CUDA where torch._grouped_mm serves it, else "host".
    Both give the same outputs, gradients and statistics.

    `last_stats` (detached tensors, no host sync): tokens_per_expert [E] (this rank's token-slots per
    expert before drops; not reduced over any group), tokens_per_local_expert (slots this rank's
    experts computed, i.e. from the whole ep group), load_max / load_min (fractions of this rank's
    slots), dropped (fraction of slots dropped), aux_loss, z_loss (unscaled values).
    """

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int = 2,
                 capacity_factor: float | None = None, router: str = "softmax", aux_loss_coef: float = 1e-2,
                 z_loss_coef: float = 1e-3, num_shared_experts: int = 0, ep_group: ProcessGroup | None = None,
                 *, activation: str = "swiglu", renormalize: bool | None = None, jitter_eps: float = 0.0,
                 num_groups: int | None = None, topk_groups: int | None = None, bias_update_rate: float = 0.0,
                 seq_aux: bool = False, stats_group: ProcessGroup | None = None,
                 init_std: float = 0.02, local_path: str = "auto") -> None:
        super().__init__()
        if local_path not in LOCAL_PATHS:
            raise ValueError(f"local_path={local_path!r} is not one of {LOCAL_PATHS} (auto: device on CUDA)")
        if dim < 1 or ffn_dim < 1:
            raise ValueError(f"dim={dim} and ffn_dim={ffn_dim} must be positive")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None for dropless routing)")
        for name, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef),
                            ("bias_update_rate", bias_update_rate)):
            if value < 0:
                raise ValueError(f"{name}={value} must be >= 0 (0 disables it)")
        if num_shared_experts < 0:
            raise ValueError(f"num_shared_experts={num_shared_experts} must be >= 0")
        ep_size = group_size(ep_group)
        check_expert_parallel(num_experts, ep_size)
        self.router = TopKRouter(dim, num_experts, top_k, score_func=router, renormalize=renormalize,
                                 jitter_eps=jitter_eps, num_groups=num_groups, topk_groups=topk_groups,
                                 init_std=init_std)
        num_local = num_experts // ep_size
        ep_rank = group_rank(ep_group)
        self.experts = GroupedExperts(dim, ffn_dim, num_experts, activation,
                                      expert_range=(ep_rank * num_local, (ep_rank + 1) * num_local),
                                      init_std=init_std)
        self.shared_experts = (SharedExperts(dim, num_shared_experts * ffn_dim, activation, init_std)
                               if num_shared_experts else None)
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.bias_update_rate, self.seq_aux = bias_update_rate, seq_aux
        self.stats_group = stats_group
        self.local_path = local_path
        self.ep_group: ProcessGroup | None = None
        self.tp_group: ProcessGroup | None = None  # expert tensor parallel (see set_tensor_parallel)
        self.dispatcher: TokenDispatcher = LocalDispatcher(num_experts)
        if ep_size > 1:
            self.set_expert_parallel(AllToAllDispatcher(ep_group, num_experts), ep_group)
        #: Multiplies the balancing-loss gradient in backward; the engine sets it to the factor it
        #: multiplies the main loss by (fp16 loss scale / accumulation steps): see `loss_scale_hooks`.
        self.balancing_loss_scale = AttachedLossScale()
        # Slots routed per expert since the last bias update (this rank's tokens, all experts).
        self.register_buffer("load_since_update", torch.zeros(num_experts), persistent=False)
        self.last_stats: dict[str, torch.Tensor] = {}

    def set_expert_parallel(self, dispatcher: TokenDispatcher, ep_group: ProcessGroup | None) -> None:
        """Route through `dispatcher` to the experts spread over `ep_group` (this module keeps its own)."""
        if dispatcher.num_local != self.experts.num_experts:
            raise ValueError(f"the dispatcher serves {dispatcher.num_local} local experts but this layer holds "
                             f"{self.experts.num_experts}; keep the matching slice of experts first")
        if self.tp_group is not None:  # expert tensor parallelism stays around the new dispatcher
            dispatcher = ExpertTensorParallelDispatcher(dispatcher, self.tp_group)
        self.dispatcher = dispatcher
        self.ep_group = ep_group if group_size(ep_group) > 1 else None

    def set_tensor_parallel(self, tp_group: ProcessGroup | None) -> dict[nn.Parameter, int]:
        """Expert tensor parallelism over `tp_group`: every routed and shared expert keeps its slice of the
        hidden units, so each rank computes a partial sum of the layer's output.

        The layer then takes the full sequence (all-gathered by the norm before it, identical on every tp
        rank) and routes it identically everywhere; its dispatcher's combine sums the partial outputs over
        tp and scatters them back to sequence shards (`ExpertTensorParallelDispatcher`).
        The router weight is replicated: its gradient (partial, through each rank's partial expert
        outputs) is summed over tp, and the balancing losses, computed identically on every tp rank,
        are weighted 1/tp so their gradient counts once. Returns how each parameter is split over tp."""
        tp, rank = group_size(tp_group), group_rank(tp_group)
        if tp == 1:
            return {}
        if self.tp_group is not None:
            raise ValueError("this MoELayer is already tensor-parallel")
        hidden = self.experts.ffn_dim
        if hidden % tp:
            raise ValueError(f"expert tensor parallelism splits each expert's hidden units: the expert ffn_dim "
                             f"{hidden} must be divisible by tp={tp}")
        size = hidden // tp
        self.experts.keep_hidden(rank * size, (rank + 1) * size)
        if self.shared_experts is not None:
            shared = self.shared_experts.w_out.weight.shape[1]
            self.shared_experts.keep_hidden(rank * shared // tp, (rank + 1) * shared // tp)
        substitute_parameters(self.router, {"weight": lambda w: sum_grad(w, tp_group)})
        self.tp_group = tp_group
        self.dispatcher = ExpertTensorParallelDispatcher(self.dispatcher, tp_group)
        swiglu = self.experts.activation == "swiglu"
        splits = {"router.weight": TensorSplit(None, replicas=tp),
                  "experts.w_in": TensorSplit(2, halves=swiglu), "experts.w_out": TensorSplit(1)}
        if self.shared_experts is not None:
            splits.update({"shared_experts.w_in.weight": TensorSplit(0, halves=swiglu),
                           "shared_experts.w_out.weight": TensorSplit(1)})
        return splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoELayer expects x [..., {self.dim}], got {tuple(x.shape)}")
        if self.seq_aux and x.dim() != 3:
            raise ValueError(f"seq_aux=True needs x [batch, seq, dim], got {tuple(x.shape)}")
        x_flat = x.reshape(-1, self.dim)  # [..., dim] -> [N, dim]
        n = x_flat.shape[0]
        routing = self.router(x_flat)
        aux = load_balancing_loss(routing.probs, routing.indices, x.shape[0] if self.seq_aux else 1,
                                  self.stats_group)
        z = router_z_loss(routing.logits, self.stats_group)

        capacity = (None if self.capacity_factor is None
                    else expert_capacity(n, self.top_k, self.num_experts, self.capacity_factor))
        assign = assign_slots_static if self.uses_device_path(x) else assign_slots
        assignment = assign(routing.indices, routing.weights, self.num_experts, capacity)
        # y [..., dim]; with expert tensor parallelism, this rank's sequence shard of the summed output
        y, local_counts = self.dispatcher.run(x, assignment, routing.weights, self.experts, self.shared_experts)

        if self.training and self.bias_update_rate > 0:
            self.load_since_update += assignment.routed_per_expert.to(self.load_since_update.dtype)
        loss = self.aux_loss_coef * aux + self.z_loss_coef * z
        tp = group_size(self.tp_group)
        if tp > 1:
            loss = loss / tp  # computed identically on every tp rank: its gradient must count once
        if (self.training and torch.is_grad_enabled() and loss.requires_grad
                and (self.aux_loss_coef or self.z_loss_coef)):
            y = attach_loss(y, loss, self.balancing_loss_scale)
        routed = assignment.routed_per_expert.detach()
        slots = max(assignment.num_slots, 1)
        self.last_stats = {
            "tokens_per_expert": routed,  # this rank's token-slots per expert (all E), before drops
            "tokens_per_local_expert": local_counts.detach(),  # slots my experts computed (whole ep group)
            "load_max": routed.max() / slots,
            "load_min": routed.min() / slots,
            "dropped": assignment.num_dropped / slots,
            "aux_loss": aux.detach(),
            "z_loss": z.detach(),
        }
        return y


    def uses_device_path(self, x: torch.Tensor) -> bool:
        """Whether a forward on `x` takes the device path (see `local_path`)."""
        if self.local_path == "host" or (self.local_path == "auto" and x.device.type != "cuda"):
            return False
        if self.local_path == "device":
            self.experts.check_sync_free(x.device, x.dtype)
            return True
        return self.experts.supports_sync_free(x.device, x.dtype)


def moe_layers(module: nn.Module) -> list[MoELayer]:
    """Every MoELayer inside `module`, in module order (that order numbers them in the stats)."""
    return [m for m in module.modules() if isinstance(m, MoELayer)]


@torch.no_grad()
def update_router_biases(module: nn.Module, group: ProcessGroup | None = None) -> None:
    """Aux-loss-free balancing: nudge every MoELayer's expert bias by its loads since the last call.

    Call after each optimizer step. Loads are summed over `group` first, which must span every rank
    holding a replica of the routers with different tokens (e.g. the dp x sp group; expert-parallel
    ranks are part of dp), so all replicas apply the identical update. With group=None each layer
    reduces over its own `stats_group` (None: this rank's loads only).
    """
    layers = [m for m in moe_layers(module) if m.bias_update_rate > 0]
    if not layers:
        return
    if group is not None:
        loads = torch.stack([m.load_since_update for m in layers])  # one collective for all layers
        comm.all_reduce(loads, group)
    else:
        loads = []
        for m in layers:
            load = m.load_since_update.clone()
            comm.all_reduce(load, m.stats_group)
            loads.append(load)
    for m, load in zip(layers, loads):
        update_expert_bias(m.router, load, m.bias_update_rate)
        m.load_since_update.zero_()


def loss_scale_hooks(module: nn.Module) -> list[AttachedLossScale]:
    """The balancing-loss scales of every MoELayer, for `zero.initialize(..., loss_scale_hooks=...)`.

    The engine then gives them, before every backward, the factor it multiplies the main loss by
    (fp16 loss scale / accumulation steps), so the balancing losses keep their weight at any dtype.
    """
    return [m.balancing_loss_scale for m in moe_layers(module)]


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """Set the balancing-loss gradient factor of every MoELayer by hand, for training loops without
    our engine: pass the factor the main loss is multiplied by (e.g. 1 / grad-accumulation steps)."""
    for hook in loss_scale_hooks(module):
        hook(scale)


def collect_moe_stats(module: nn.Module, start: int = 0) -> dict[str, float | list[float]]:
    """Per-layer metrics of the last forward: `moe/layer{i}/{aux_loss,z_loss,load_max,load_min,dropped}`
    as floats and `moe/layer{i}/tokens_per_expert` as a list (this rank's tokens, all experts). Layers
    are numbered from `start` (e.g. the MoE layers before a pipeline stage)."""
    out: dict[str, float | list[float]] = {}
    for i, m in enumerate(moe_layers(module), start=start):
        s = m.last_stats
        if not s:
            continue
        keys = ("aux_loss", "z_loss", "load_max", "load_min", "dropped")
        scalars = torch.stack([s[k].float() for k in keys])  # one host sync per layer
        for key, value in zip(keys, scalars.tolist()):
            out[f"moe/layer{i}/{key}"] = value
        out[f"moe/layer{i}/tokens_per_expert"] = s["tokens_per_expert"].tolist()
    return out
