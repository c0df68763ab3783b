"""The actor: the trained policy. It scores batches (log-probs, entropy) and takes PPO steps."""

from __future__ import annotations

from functools import partial

from mcore_rl.algorithms.objectives import actor_objective
from mcore_rl.config import AlgorithmConfig
from mcore_rl.config.model import ModelConfig
from mcore_rl.config.rl import ImportanceCorrection
from mcore_rl.models.moe_routing import RoutingPass
from mcore_rl.models.lora import served_parameters
from mcore_rl.runtime.devices import collective_device
from mcore_rl.runtime.log import print0
from mcore_rl.training import TrainableModel, compute_outputs, train_step

ACTOR_INPUTS = ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "advantages",
                "ref_logprobs", "engine_logprobs")


class Actor:
    """A Megatron policy with its optimizer."""

    def __init__(self, trainable: TrainableModel, vocab_size: int, micro_batch_size: int,
                 algorithm: AlgorithmConfig, temperature: float,
                 correction: ImportanceCorrection, max_tokens: int = 0,
                 model: ModelConfig | None = None, routing_replay: str = "none"):
        """temperature: the rollout temperature (log-probs are of logits / temperature, like the
        engine's); correction: the off-policy correction of the loss; max_tokens > 0: token-budget
        micro-batches instead of `micro_batch_size` rows; model: the policy's config (a
        Mixture-of-Experts model's routers are observed and replay routes, as routing_replay
        says: rollout.routing_replay)."""
        self.trainable = trainable
        self.vocab_size = vocab_size
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens
        self.algorithm = algorithm
        self.temperature = temperature if temperature > 0 else 1.0
        self.correction = correction
        self.moe_model = model if model is not None and model.moe.enabled else None
        self.routing_replay = routing_replay

    @property
    def module(self):
        """This rank's GPTModel stage (unwrapped from DDP), e.g. for the Megatron engine."""
        return self.trainable.chunks[0].module

    def parameters_for_sync(self) -> dict:
        """Local parameters under canonical names as the engine serves them (adapters merged
        into their weights), what the resharder reads."""
        return served_parameters(self.module)

    def logprobs(self, batch: dict) -> dict:
        """{'logprobs', 'entropy'} [n, s] of the batch's tokens under the current policy. A
        Mixture-of-Experts policy also gives 'moe_metrics' (identical on every rank) and, under
        r2, 'routed_experts': the routes its routers took (under r3 they replay the engine's; a
        batch without them is warned of and shows as moe/routes_replayed 0)."""
        routing = None
        if self.moe_model is not None:
            r3 = self.routing_replay == "r3"
            if r3 and "routed_experts" not in batch:
                print0("WARNING: rollout.routing_replay=r3, but the engine gave no routes for "
                       "this batch: the trainer's routers route it themselves "
                       "(moe/routes_replayed 0)")
            routing = RoutingPass(self.moe_model, r3 and "routed_experts" in batch, observe=True,
                                  keep_routes=self.routing_replay == "r2", expect_routes=r3)
        outputs = compute_outputs(self.trainable.chunks, scoring_inputs(batch, routing),
                                  self.micro_batch_size, "lm", self.vocab_size, self.temperature,
                                  self.max_tokens, routing)
        if routing is not None:
            outputs["moe_metrics"] = routing.metrics(collective_device())
        if routing is not None and routing.keep_routes:
            outputs["routed_experts"] = routing.routes(*batch["input_ids"].shape)
        return outputs

    def update(self, mini_batch: dict) -> dict:
        """One optimizer step on a mini-batch; metrics identical on every rank. A mini-batch
        without old_logprobs (rollout.old_logprobs=update: the batch's only step) takes this
        update's own, detached, and gets them as its 'old_logprobs' [n, s]."""
        inputs = {name: mini_batch[name] for name in ACTOR_INPUTS if name in mini_batch}
        inputs["output_mask"] = mini_batch["loss_mask"]
        routing = replaying_routes(self.moe_model, self.routing_replay, mini_batch, inputs)
        objective = partial(actor_objective, config=self.algorithm, correction=self.correction)
        own_old = "old_logprobs" not in mini_batch
        metrics = train_step(self.trainable, inputs, self.micro_batch_size, objective, "lm",
                             self.vocab_size, self.temperature, self.max_tokens, routing,
                             per_token=("logprobs",) if own_old else ())
        if own_old:
            mini_batch["old_logprobs"] = metrics.pop("logprobs")
        return role_metrics(metrics, "actor")


def replaying_routes(model: ModelConfig | None, routing_replay: str, batch: dict,
                     inputs: dict) -> RoutingPass | None:
    """The routing of a pass that replays the batch's routes (added to `inputs`), when the
    model has experts, replay is on and the batch has routes; None otherwise."""
    if model is None or routing_replay == "none" or "routed_experts" not in batch:
        return None
    inputs["routed_experts"] = batch["routed_experts"]
    return RoutingPass(model, replay=True, observe=False)


def scoring_inputs(batch: dict, routing: RoutingPass | None = None) -> dict:
    """What a forward pass over `batch` needs; its `response_mask`, when it has one, as the
    positions whose log-probs are used (prompt positions then get no logits); its routes when
    `routing` replays or compares them."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if "response_mask" in batch:
        inputs["output_mask"] = batch["response_mask"]
    if routing is not None and "routed_experts" in batch:
        inputs["routed_experts"] = batch["routed_experts"]
    return inputs


def role_metrics(metrics: dict, role: str) -> dict:
    """Step-level names (loss, grad_norm, lr, update_skipped) get the role's prefix."""
    return {name if "/" in name else f"{role}/{name}": value for name, value in metrics.items()}
