"""The experts vLLM's MoE routers send each token to, captured inside vLLM's worker.

Why this module exists
----------------------
Routing replay (rollout.routing_replay=r3) and the router agreement metric need, for every
token an engine sampled, the experts each MoE layer sent it to. vLLM 0.32 reports them only
under its V2 model runner, which needs Triton (not on CPUs, where CI runs), so the capture is
ours: a callback on every router keeps each engine step's top-k expert ids, and the model
runner's batch says which request and position each row is (`RouteCapture`). It reads runner
internals, so it pins the V1 runner (vllm_start.ROUTE_CAPTURE_RUNNER) and checks at start that
the runner has what it reads (`capture_routes`), never mid-step. The functions taking a
``worker`` run inside vLLM's worker, through `LLM.collective_rpc`.
"""

from __future__ import annotations

from functools import partial

import torch

from .vllm_start import SUPPORTED_VLLM


class RouteCapture:
    """The experts vLLM's MoE routers send each token to, kept per engine step (a router's
    capture callback, `BaseRouter.set_capture_fn`, gets the step's top-k expert ids; the
    model runner's batch says which request and position each row is) and handed out by the
    tokens a request fed: prompt + response[:-1] -> routes [tokens, MoE layers, k]."""

    def __init__(self, runner, moe_layers: list[int]):
        self.runner = runner
        self.slots = {layer: slot for slot, layer in enumerate(moe_layers)}
        self.steps: list[tuple] = []
        """(request ids, row starts, token ids, positions, {slot: top-k ids}) per step."""

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Keep the step's rows as they are (copies, on the engine's device: no synchronisation
        while it runs); `take` brings them to the host."""
        slot = self.slots[layer]
        if slot == 0:  # the step's first MoE layer: its batch
            batch, runner = self.runner.input_batch, self.runner
            starts = runner.query_start_loc.np[:batch.num_reqs + 1].copy()
            rows = int(starts[-1])
            self.steps.append((list(batch.req_ids), starts, runner.input_ids.cpu[:rows].clone(),
                               runner.positions[:rows].clone(), {}))
        rows = int(self.steps[-1][1][-1])
        self.steps[-1][4][slot] = topk_ids[:rows].to(torch.int16, copy=True)

    def take(self) -> dict[tuple, torch.Tensor]:
        """Routes of every request whose every token was seen, by its fed tokens; forgets all."""
        ordered = (in_order(seen) for seen in self.take_by_request().values())
        return {tokens: routes for tokens, routes in filter(None, ordered)}

    def take_by_request(self) -> dict[str, dict[int, tuple[int, torch.Tensor]]]:
        """The kept steps' routes by request id and position: (fed token, route); forgets
        them."""
        by_request: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
        for request_ids, starts, tokens, positions, by_slot in self.steps:
            routes = torch.stack([by_slot[slot] for slot in range(len(self.slots))], dim=1).cpu()
            tokens, positions = tokens.tolist(), positions.tolist()
            for index, request in enumerate(request_ids):
                seen = by_request.setdefault(request, {})
                for row in range(starts[index], starts[index + 1]):
                    seen[positions[row]] = (tokens[row], routes[row])
        self.steps = []
        return by_request


def external_request_id(internal: str) -> str:
    """The id a request was added with, from the id vLLM's model runner knows it by (vLLM
    appends "-" and 8 random characters: `InputProcessor.assign_request_id`)."""
    return internal[:-9] if len(internal) > 9 and internal[-9] == "-" else internal


def in_order(seen: dict[int, tuple[int, torch.Tensor]]) -> tuple[tuple, torch.Tensor] | None:
    """(fed tokens, routes [tokens, MoE layers, k]) of one request whose every position was
    seen (from 0); None when some were not (or none)."""
    if not seen or len(seen) != max(seen) + 1:
        return None
    ordered = [seen[position] for position in range(len(seen))]
    return tuple(token for token, _ in ordered), torch.stack([route for _, route in ordered])


def capture_routes(worker, moe_layers: list[int]) -> list[str]:
    """Hook a `RouteCapture` to every MoE router of the worker's model; what stops it (a
    model runner without what the capture reads) instead, at start, never mid-step."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runner = worker.model_runner
    missing = [name for name in _CAPTURE_NEEDS if not hasattr(runner, name)]
    if missing:
        return [f"vLLM's model runner {type(runner).__module__}.{type(runner).__name__} has no "
                f"{', '.join(missing)}, which the route capture reads (written for the V1 "
                f"runner, vllm {SUPPORTED_VLLM}): start it with VLLM_USE_V2_MODEL_RUNNER=0 "
                "and nothing that forces V2 (watermarking, HiSparse attention), or set "
                "rollout.routing_replay=none and rollout.router_agreement=false"]
    capture = RouteCapture(runner, moe_layers)
    worker.mcore_rl_routes = capture
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, MoERunner):
            module.router.set_capture_fn(partial(capture.capture, module.layer_id))
    return []


def taken_routes(worker) -> dict[tuple, torch.Tensor]:
    return worker.mcore_rl_routes.take()


def taken_routes_by_request(worker) -> dict[str, dict[int, tuple[int, torch.Tensor]]]:
    return worker.mcore_rl_routes.take_by_request()



_CAPTURE_NEEDS = ("input_batch", "query_start_loc", "input_ids", "positions")
"""What `RouteCapture.capture` reads from the model runner at each step."""


def route_capture_note(cuda_graphs: bool, prefix_caching: bool) -> str:
    """What capturing routes costs, said once at start: settings the engine cannot honour
    while every token's experts are reported, and the pinned runner."""
    dropped = [setting for setting, wanted in (
        ("rollout.cuda_graphs (the routers report to Python hooks, which a graph skips)",
         cuda_graphs and torch.cuda.is_available()),
        ("rollout.prefix_caching (a cached prefix's tokens are not computed again, so they "
         "would have no routes)", prefix_caching)) if wanted]
    return ("vLLM reports every token's experts (rollout.routing_replay=r3 or "
            "rollout.router_agreement): its V1 model runner is pinned "
            "(VLLM_USE_V2_MODEL_RUNNER=0), async scheduling is off"
            + "".join(f"; off: {setting}" for setting in dropped))
