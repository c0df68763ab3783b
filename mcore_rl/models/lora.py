"""Low-rank adapters on Megatron's tensor-parallel linears (LoRA, as HF peft computes it).

An adapted linear is Megatron's own ColumnParallelLinear or RowParallelLinear with two more
parameters, `lora_a` [r, in] and `lora_b` [out, r], and output W x + (alpha / r) B A drop(x).
They are sharded like the linear, so no rank ever holds a weight-sized adapter product:

- column-parallel (linear_qkv, linear_fc1): A whole on every TP rank, B split on its output
  rows exactly as the weight is (fused QKV rows, [gate; up] halves). A's output is marked with
  Megatron's copy-to-TP-region, whose backward all-reduces, so A's gradient is complete and
  identical on every TP rank (no Megatron hook needed for it);
- row-parallel (linear_proj, linear_fc2): A split on its input columns like the weight, B
  whole; A's partial products are all-reduced before B (and scattered back to the sequence
  shards under sequence parallelism).

The model's other parameters are frozen (models/build.py), so Megatron's DDP and optimizer
(distributed or not) see the adapters only. Adapter parameters are named `<linear>.lora_a` / `.lora_b`
(param_layout/sharding.py knows their split). A starts as peft's (Kaiming-uniform, bound
1/sqrt(in)) drawn from a generator seeded by the run's seed and the adapter's global name, so
every layout starts from the same adapters; B starts at zero.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math

import torch
import torch.nn.functional as F

from ..config.lora import LoraConfig
from ..config.model import ModelConfig
from ..param_layout import sharding
from ..runtime.model_rank import ModelRank
from .spec_parts import mlp_submodules, submodules_of
from .weights import local_parameters


def _parallel_linears():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def _adapter_parameter(rows: int, columns: int, like: torch.Tensor) -> torch.nn.Parameter:
    """A zero [rows, columns] parameter on `like`'s device, in its dtype."""
    return torch.nn.Parameter(torch.zeros(rows, columns, dtype=like.dtype, device=like.device))


class _Adapted:
    """What both adapted linears share: the settings, the switch, the merge and the
    checkpoint description."""

    SPLIT: tuple[str, int]
    """The adapter matrix split across TP ranks and its split dimension (the other is whole)."""

    BASE_AXES: dict[str, int]
    """The linear's own tensors' split dimensions (Megatron's)."""

    def _add_adapter(self, lora: LoraConfig, a_shape: tuple, b_shape: tuple) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.lora_scaling = lora.scaling
        self.adapter_enabled = True
        self.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else None
        self.lora_a = _adapter_parameter(*a_shape, self.weight)
        self.lora_b = _adapter_parameter(*b_shape, self.weight)
        split, dim = self.SPLIT
        set_tensor_model_parallel_attributes(getattr(self, split), True, dim, 1)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_dropout(x) if self.lora_dropout is not None else x

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of W + (alpha / r) B A, in the weight's dtype (sums in fp32)."""
        update = self.lora_b.float() @ self.lora_a.float()
        return (self.weight.float() + self.lora_scaling * update).to(self.weight.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's, with the split adapter matrix described as split (its default would
        store it as a replica, keeping one TP rank's part only)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        split, dim = self.SPLIT
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {**self.BASE_AXES, split: dim},
            sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


@functools.cache
def _column_class():
    ColumnParallelLinear, _ = _parallel_linears()

    class LoraColumnParallelLinear(_Adapted, ColumnParallelLinear):
        """ColumnParallelLinear + an adapter: A whole, B split on output rows."""

        SPLIT, BASE_AXES = ("lora_b", 0), {"weight": 0, "bias": 0}

        def __init__(self, input_size: int, output_size: int, *, lora: LoraConfig, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            if self.gather_output:
                raise ValueError("adapters on a column-parallel linear that gathers its output "
                                 "are not supported")
            self._add_adapter(lora, (lora.rank, input_size),
                              (self.output_size_per_partition, lora.rank))

        def forward(self, input_, weight=None, runtime_gather_output=None):
            output, bias = super().forward(input_, weight, runtime_gather_output)
            if not self.adapter_enabled:
                return output, bias
            from megatron.core.tensor_parallel import mappings

            x = input_
            if self.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(
                    x, tensor_parallel_output_grad=False, group=self.tp_group)
            # The default generator, seeded alike on every TP rank: A's replicated input gets
            # the same mask everywhere.
            inner = F.linear(self._dropped(x), self.lora_a)
            inner = mappings.copy_to_tensor_model_parallel_region(inner, group=self.tp_group)
            return output + self.lora_scaling * F.linear(inner, self.lora_b), bias

    return LoraColumnParallelLinear


@functools.cache
def _row_class():
    _, RowParallelLinear = _parallel_linears()

    class LoraRowParallelLinear(_Adapted, RowParallelLinear):
        """RowParallelLinear + an adapter: A split on input columns, B whole."""

        SPLIT, BASE_AXES = ("lora_a", 1), {"weight": 1}

        def __init__(self, input_size: int, output_size: int, *, lora: LoraConfig, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            if not self.input_is_parallel:
                raise ValueError("adapters on a row-parallel linear whose input is not split "
                                 "are not supported")
            self._add_adapter(lora, (lora.rank, self.input_size_per_partition),
                              (output_size, lora.rank))

        def forward(self, input_):
            output, bias = super().forward(input_)
            if not self.adapter_enabled:
                return output, bias
            from megatron.core import tensor_parallel
            from megatron.core.tensor_parallel import mappings

            dropped = input_
            if self.lora_dropout is not None:
                with tensor_parallel.get_cuda_rng_tracker().fork():  # masks differ per shard
                    dropped = self.lora_dropout(input_)
            inner = mappings.reduce_from_tensor_model_parallel_region(
                F.linear(dropped, self.lora_a), group=self.tp_group)
            delta = self.lora_scaling * F.linear(inner, self.lora_b)
            if self.sequence_parallel:
                delta = mappings.scatter_to_sequence_parallel_region(delta, group=self.tp_group)
            return output + delta, bias

    return LoraRowParallelLinear


def with_adapters(layer_spec, lora: LoraConfig):
    """The local-spec layer spec `layer_spec` with adapters on lora's target linears. In a
    Mixture-of-Experts layer the MLP targets (linear_fc1, linear_fc2) adapt the shared expert,
    where there is one; the routed experts stay frozen: per-expert adapters are not built (they
    would be sharded like their expert over EP and ETP), and HF peft's target modules (gate_proj,
    up_proj, down_proj) do not reach transformers' fused experts either."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    attention = layer_spec.submodules.self_attention.submodules
    mlp = mlp_submodules(layer_spec)
    if hasattr(mlp, "router"):  # an MoE layer: its shared expert's MLP, if any
        shared = getattr(mlp, "shared_experts", None)
        mlp = submodules_of(shared) if shared is not None else None
    holders = {"linear_qkv": (attention, _column_class), "linear_proj": (attention, _row_class),
               "linear_fc1": (mlp, _column_class), "linear_fc2": (mlp, _row_class)}
    for target in lora.megatron_targets():
        holder, make_class = holders[target]
        if holder is not None:
            setattr(holder, target, ModuleSpec(module=make_class(), params={"lora": lora}))
    return layer_spec


def adapted_linears(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The stage's adapted linears by their (local) module names."""
    return {name: child for name, child in module.named_modules() if isinstance(child, _Adapted)}


def has_adapters(module: torch.nn.Module) -> bool:
    """Whether the stage's linears carry adapters."""
    return bool(adapted_linears(module))


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module):
    """Run `module` as its frozen base: every adapter off inside the block (peft's
    disable_adapter)."""
    linears = adapted_linears(module).values()
    for linear in linears:
        linear.adapter_enabled = False
    try:
        yield
    finally:
        for linear in linears:
            linear.adapter_enabled = True


def served_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This stage's parameters as the served (and exported) model has them, under canonical
    local names: each adapted weight as its merged shard, the adapter matrices left out.
    Without adapters: `local_parameters(module)`."""
    parameters = local_parameters(module)
    linears = adapted_linears(module)
    if not linears:
        return parameters
    served = {}
    for name, tensor in parameters.items():
        if sharding.adapter_of(name) is not None:
            continue
        linear = linears.get(name.removesuffix(".weight"))
        served[name] = linear.merged_weight() if linear is not None else tensor
    return served


@torch.no_grad()
def initialize_adapters(module: torch.nn.Module, model: ModelConfig, seed: int,
                        here: ModelRank) -> None:
    """peft's starting adapters on every layout: A ~ U(-1/sqrt(in), 1/sqrt(in)) drawn whole
    from a generator seeded by `seed` and A's global name, then cut to the shard of the stage
    at `here`; B = 0."""
    tp_size, tp_rank, pp_size, pp_rank = here.tp_size, here.tp_rank, here.pp_size, here.pp_rank
    for name, linear in adapted_linears(module).items():
        a_name = sharding.to_global_name(f"{name}.lora_a", pp_rank, model, pp_size)
        in_features = linear.lora_a.shape[1] * (tp_size if linear.SPLIT[0] == "lora_a" else 1)
        full = initial_lora_a(a_name, linear.lora_a.shape[0], in_features, seed)
        linear.lora_a.copy_(sharding.split_adapter(a_name, full, tp_size, tp_rank))
        linear.lora_b.zero_()


def initial_lora_a(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """The full starting A of adapter matrix `name` (global name): peft's Kaiming-uniform
    (a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)), from a generator seeded by `seed` and the name."""
    generator = torch.Generator().manual_seed(_name_seed(seed, name))
    bound = 1 / math.sqrt(in_features)
    # Drawn in host memory on purpose (the caller copies the shard to the device): the same
    # numbers on every device and layout.
    return torch.empty(rank, in_features, device="cpu").uniform_(-bound, bound, generator=generator)


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def adapter_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This stage's adapter matrices under canonical local names."""
    return {name: param for name, param in local_parameters(module).items()
            if sharding.adapter_of(name) is not None}


def gather_full_adapters(local: dict[str, torch.Tensor], model: ModelConfig, here: ModelRank
                         ) -> dict[str, torch.Tensor] | None:
    """Collective: every rank's adapter shards (`local`: canonical local names, e.g. the
    parameters or their gradients) merged into full tensors under global names, on rank 0
    (None elsewhere). Adapters are small next to the model, so they travel as objects; only the
    first data-parallel replica sends them."""
    import torch.distributed as dist

    mine = {}
    if here.replica_rank == 0:  # replicas send nothing
        mine = {sharding.to_global_name(name, here.pp_rank, model, here.pp_size):
                tensor.detach().to("cpu", copy=True) for name, tensor in local.items()}
    everything = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((here.tp_rank, mine), everything, dst=0)
    if everything is None:
        return None
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for tp_rank, tensors in everything:
        for name, tensor in tensors.items():
            shards.setdefault(name, {})[tp_rank] = tensor
    return {name: sharding.merge_adapter(name, [by_rank[r] for r in sorted(by_rank)])
            for name, by_rank in sorted(shards.items())}
