"""What the Mixture-of-Experts routers of a model do in one pass: replay given routes, and report
the routes they took.

Why this exists
---------------
The engine and the trainer compute the same router logits up to rounding, so near-ties route
some tokens to different experts in the two (arXiv 2510.11370 counts about 10% of router
decisions per forward pass in bf16), and the policy the trainer scores is not the one that
sampled. Routing replay feeds the trainer the engine's routes (r3) or the trainer's own routes
from the old-log-prob pass (r2), in every forward pass of the batch.

A batch carries routes as ``routed_experts`` [n, s, MoE layers, top-k] (the k experts of token
(row, position) in each MoE layer, in model order; -1 where no route is given: a response's
last token, which the engine never fed back, padding, and every token of a row the engine gave
no routes: an episode ended by a failed reset). Replay goes through the hook Megatron-Core's
routers consult for their top-k (``router.router_replay``, router by router, not through
``RouterReplay``'s process-wide instance list, which every model built in the process joins):
for the pass it holds the given routes, and a real token without one keeps the router's own
choice, so one route-less row does not take replay from the others.

Observing the routes taken (a forward hook on each router) gives the step's MoE metrics and,
for r2, the routes to replay: the experts each token went to, the tokens each expert received,
and the router's softmax (entropy, Switch-style load-balancing value).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from mcore_rl.config.model import ModelConfig
from mcore_rl.runtime.model_rank import ModelRank

from .weights import model_rank_of
from .context_parallel import gather_sequence, split_for_rank

NO_ROUTE = -1
"""``routed_experts`` entry of a (token, layer) with no given route."""


def moe_layers(model: ModelConfig) -> list[int]:
    """Global indices of the layers that route to experts, in model order (the route slots)."""
    return [layer for layer in range(model.num_layers) if model.moe.is_moe_layer(layer)]


def _all_but_last(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] bool: a right-padded row's real tokens without its last."""
    return (attention_mask.cumsum(dim=1) < attention_mask.sum(dim=1, keepdim=True)) & \
        attention_mask.bool()


def filler_routes(tokens: tuple[int, ...], topk: int, experts: int,
                  device=None) -> torch.Tensor:
    """Routes [*tokens, k] for tokens no output depends on (padding, a response's last token),
    which are dispatched all the same: k different experts per token, token after token round
    the experts, so that they load every expert (and EP rank) alike, not experts 0..k-1."""
    count = torch.Size(tokens).numel()
    first = torch.arange(count, device=device).reshape(tokens) * topk
    return (first[..., None] + torch.arange(topk, device=device)) % experts


def local_routers(chunk, model: ModelConfig) -> list[tuple[int, torch.nn.Module]]:
    """(route slot, router) of every MoE layer of this model chunk (this pipeline stage)."""
    from megatron.core.utils import unwrap_model

    slots = {layer: slot for slot, layer in enumerate(moe_layers(model))}
    routers = []
    for layer in unwrap_model(chunk).decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            routers.append((slots[layer.layer_number - 1], router))
    return routers


def _sequence_major(per_token: torch.Tensor, here: ModelRank, sequence_parallel: bool
                    ) -> torch.Tensor:
    """[b, s, ...] -> the router's token order [s_local * b, ...] at `here`: sequence-major,
    under context parallelism this CP rank's two chunks, and with sequence parallelism only
    this TP rank's part of those."""
    tokens = split_for_rank(per_token, 1, here.cp_rank, here.cp_size).transpose(0, 1)
    if sequence_parallel:
        tokens = tokens.chunk(here.tp_size)[here.tp_rank]
    return tokens.reshape(-1, *per_token.shape[2:])


def _whole_sequence(tokens: torch.Tensor, rows: int, here: ModelRank, sequence_parallel: bool
                    ) -> torch.Tensor:
    """This rank's [s_local * b, ...] tokens -> [b, s, ...] in sequence order, gathered over
    the TP ranks (with sequence parallelism) and the CP ranks (the inverse of
    `_sequence_major`)."""
    if sequence_parallel:
        group = here.group("tp")
        whole = tokens.new_empty((tokens.shape[0] * dist.get_world_size(group),
                                  *tokens.shape[1:]))
        dist.all_gather_into_tensor(whole, tokens.contiguous(), group=group)
        tokens = whole
    by_position = tokens.reshape(-1, rows, *tokens.shape[1:])
    if here.cp_size > 1:
        by_position = gather_sequence(by_position, here.group("cp"), sum_gradients=False)
    return by_position.transpose(0, 1)


class _GivenRoutes:
    """What a router consults for its top-k while a pass replays (in place of Megatron-Core's
    `RouterReplay`, whose replay takes every token's route from the given ones): the given
    route of each token, or the router's own top-k where `own` says so. The probabilities are
    the router's scores of the chosen experts, as Megatron's replay gathers them."""

    def __init__(self, routes: torch.Tensor, own: torch.Tensor):
        self.routes, self.own = routes, own
        """[tokens, k] in the router's token order, and [tokens] bool."""

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        _, chosen = default_compute_topk(scores, topk, num_groups=num_groups,
                                         group_topk=group_topk)
        routes = torch.where(self.own.to(scores.device)[:, None], chosen,
                             self.routes.to(scores.device))
        return scores.gather(1, routes), routes


class RoutingPass:
    """The routers of one forward(-backward) pass over a batch: replay its ``routed_experts``
    (when `replay`) and observe the routes taken (when `observe`: `metrics()` gives the pass's
    MoE metrics; with `keep_routes`, `routes()` gives the routes as a batch field, what r2
    replays). Observing adds no device synchronisation: the figures stay on the model's device
    until `metrics()`."""

    def __init__(self, model: ModelConfig, replay: bool, observe: bool,
                 keep_routes: bool = False, expect_routes: bool = False):
        self.model, self.replay, self.expect_routes = model, replay, expect_routes
        self.observe, self.keep_routes = observe or keep_routes, keep_routes
        self.topk, self.experts = model.moe.router_topk, model.moe.num_experts
        self.layers = len(moe_layers(model))
        self._taken: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(batch rows, routes [b, s, layers, k]) of each observed micro-batch (keep_routes)."""
        self._totals: torch.Tensor | None = None
        """Per layer: tokens per expert, summed router probabilities per expert, summed
        entropy, tokens; then (routes equal to the given ones, routes compared), (fed tokens'
        routes given, fed tokens' routes). Allocated on the device of the first observation."""

    def _accumulated(self, device: torch.device) -> torch.Tensor:
        if self._totals is None:
            size = 2 * self.layers * self.experts + 2 * self.layers + 4
            self._totals = torch.zeros(size, dtype=torch.float64, device=device)
        return self._totals

    def _parts(self, totals: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(load [layers, E], probs [layers, E], entropy [layers], tokens [layers],
        agreeing [2], replayed [2]) views of `totals`."""
        matrix = self.layers * self.experts
        load, probs, entropy, tokens, agreeing, replayed = totals.split(
            [matrix, matrix, self.layers, self.layers, 2, 2])
        return (load.view(self.layers, -1), probs.view(self.layers, -1), entropy, tokens,
                agreeing, replayed)

    @contextmanager
    def micro_batch(self, chunk, micro_batch: dict) -> Iterator[None]:
        """While open (around the model's forward on `micro_batch`), this chunk's routers
        replay and are observed."""
        given = micro_batch.get("routed_experts")
        mask = micro_batch["attention_mask"]
        taken = self._no_routes(*mask.shape, device=mask.device) if self.keep_routes else None
        here = model_rank_of(chunk)
        with ExitStack() as stack:
            for slot, router in local_routers(chunk, self.model):
                if self.replay:
                    stack.enter_context(self._replaying(router, here, given[:, :, slot], mask))
                if self.observe:
                    handle = router.register_forward_hook(
                        lambda module, args, output, slot=slot:
                        self._observe(module, here, args[0], output[1], slot, micro_batch,
                                      given, taken))
                    stack.callback(handle.remove)
            yield
        if taken is not None and bool(mask.any()):  # not a filler (nothing to keep); copies
            self._taken.append((micro_batch["row_ids"].cpu(), taken.cpu()))  # sync anyway

    @contextmanager
    def _replaying(self, router, here: ModelRank, routes: torch.Tensor,
                   attention_mask: torch.Tensor) -> Iterator[None]:
        """`router` routes token (row, position) to routes[row, position]. Where no route is
        given (NO_ROUTE), a real token takes the router's own choice (a row the engine gave no
        routes, e.g. an episode ended by a failed reset; a response's last token) and padding a
        filler route (`filler_routes`: positions no output depends on)."""
        sequence_parallel = router.config.sequence_parallel
        unrouted = routes[..., 0] == NO_ROUTE
        filler = filler_routes(routes.shape[:-1], self.topk, self.experts, routes.device)
        routes = torch.where(unrouted[..., None], filler, routes.long())
        given = _GivenRoutes(_sequence_major(routes, here, sequence_parallel),
                             _sequence_major(unrouted & attention_mask.bool(), here,
                                             sequence_parallel))
        megatron_replay, router.router_replay = router.router_replay, given
        try:
            yield
        finally:
            router.router_replay = megatron_replay

    @torch.no_grad()
    def _observe(self, router, here: ModelRank, hidden: torch.Tensor,
                 routing_map: torch.Tensor, slot: int, micro_batch: dict,
                 given: torch.Tensor | None, taken_by_row: torch.Tensor | None) -> None:
        """Add one router's forward to the pass's figures, over the real tokens that have a
        given route when routes are given (a replayed filler route is no router's choice);
        keep its routes in `taken_by_row` [b, s, layers, k] (under sequence and context
        parallelism the ranks' parts gathered: every rank runs each router, in the same
        order)."""
        sequence_parallel = router.config.sequence_parallel
        counted = _sequence_major(micro_batch["attention_mask"].bool(), here, sequence_parallel)
        # Dropless routing: each token's row holds exactly k experts (in no particular order).
        taken = routing_map.to(torch.int8).topk(self.topk, dim=-1).indices
        load, probs_sum, entropy_sum, tokens, agreeing, replayed = self._parts(
            self._accumulated(hidden.device))
        if self.expect_routes:  # the engine fed every real token but a row's last
            fed = _sequence_major(_all_but_last(micro_batch["attention_mask"]), here,
                                  sequence_parallel)
            if given is not None:
                replayed[0] += (fed & (_sequence_major(given[:, :, slot, 0], here,
                                                       sequence_parallel) != NO_ROUTE)).sum()
            replayed[1] += fed.sum()
        logits = router.gating(hidden).reshape(-1, self.experts)
        if given is not None:
            engine = _sequence_major(given[:, :, slot].long(), here, sequence_parallel)
            counted = counted & (engine[:, 0] != NO_ROUTE)
            # The router's own choice, also while it replays (then `taken` is the replayed
            # routes): top-k of its softmax scores, which are the logits' (no expert bias).
            own = logits.topk(self.topk, dim=-1).indices if self.replay else taken
            equal = (own[:, :, None] == engine[:, None, :]).any(dim=-1)[counted]
            agreeing[0] += equal.sum()
            agreeing[1] += counted.sum() * self.topk
        probs = torch.softmax(logits.double(), dim=-1)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)
        load[slot] += routing_map[counted].sum(dim=0)
        probs_sum[slot] += probs[counted].sum(dim=0)
        entropy_sum[slot] += entropy[counted].sum()
        tokens[slot] += counted.sum()
        if taken_by_row is not None:
            rows = micro_batch["attention_mask"].shape[0]
            taken_by_row[:, :, slot] = _whole_sequence(taken, rows, here, sequence_parallel)

    def _no_routes(self, rows: int, length: int, device=None) -> torch.Tensor:
        return torch.full((rows, length, self.layers, self.topk), NO_ROUTE, dtype=torch.int16,
                          device=device)

    def routes(self, rows: int, length: int) -> torch.Tensor:
        """The kept routes as a batch field [rows, length, layers, k] in host memory (this
        stage's layers; NO_ROUTE in the other stages' slots)."""
        result = self._no_routes(rows, length)
        for row_ids, taken in self._taken:  # micro-batches padded for CP/SP may be longer
            result[row_ids, :taken.shape[1]] = taken[:, :length]
        return result

    def metrics(self, device: torch.device) -> dict[str, float]:
        """The pass's MoE metrics, over every rank (collective; identical everywhere):
        moe/expert_load_max_mean (tokens of the busiest expert over the mean, averaged over
        layers; 1 is perfectly balanced), moe/load_balancing (Switch: E x sum_i f_i P_i, 1 when
        balanced), moe/router_entropy (nats, mean over tokens and layers) and, when routes
        were given, moe/router_agreement (the fraction of (token, layer, k) routes the routers
        chose themselves that equal the given ones: under replay too, so a replayed run still
        shows the drift replay corrects); with `expect_routes` (r3), moe/routes_replayed: the
        share of (token, MoE layer) routes of the tokens the engine fed (all real tokens but a
        row's last) that the engine gave, 1.0 when every route came from the engine."""
        # A copy (the pass's own figures stay as they are); zeros on a stage without MoE.
        totals = self._accumulated(device).to(device, copy=True)
        dist.all_reduce(totals)
        load, probs, entropy, tokens, agreeing, replayed = self._parts(totals.cpu())
        fraction = load / load.sum(dim=1, keepdim=True).clamp_min(1)
        mean_prob = probs / tokens.clamp_min(1)[:, None]
        metrics = {
            "moe/expert_load_max_mean": float((load.max(dim=1).values
                                               / load.mean(dim=1).clamp_min(1e-12)).mean()),
            "moe/load_balancing": float((self.experts * (fraction * mean_prob).sum(1)).mean()),
            "moe/router_entropy": float(entropy.sum() / tokens.sum().clamp_min(1)),
        }
        if agreeing[1] > 0:
            metrics["moe/router_agreement"] = float(agreeing[0] / agreeing[1])
        if self.expect_routes:
            metrics["moe/routes_replayed"] = float(replayed[0] / replayed[1].clamp_min(1))
        return metrics
