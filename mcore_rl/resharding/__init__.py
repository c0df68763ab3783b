"""Regroup training TP/PP shards into a rollout engine's layout, moving only missing bytes.

shards.py describes a rank's tensor as canonical rows (vllm_shards.py: vLLM's cut and names),
layouts.py who holds which of them (training and every rollout layout; grouping.py chooses a
rollout layout's grouping), plan.py turns two layouts into a deterministic transfer plan (pure,
identical on every rank), execute.py runs it with bucketed point-to-point messages and streams
the shards (messages.py sends each message whole or as its change since the last sync, which
delta.py encodes), delivery.py gives the HF-named full-tensor form, full_gather.py is the
peers' baseline for benchmarks and dry_run.py sizes a job before launch.
"""

from .execute import DEFAULT_BUCKET_BYTES, Resharder
from .grouping import make_rollout_layout
from .messages import DeltaOptions
from .layouts import ENGINES, RolloutLayout, TrainingLayout
from .plan import PlanError, ReshardPlan, build_plan
from .shards import ShardSpec

__all__ = ["DEFAULT_BUCKET_BYTES", "DeltaOptions", "ENGINES", "PlanError", "ReshardPlan", "Resharder",
           "RolloutLayout", "ShardSpec", "TrainingLayout", "build_plan", "make_rollout_layout"]
