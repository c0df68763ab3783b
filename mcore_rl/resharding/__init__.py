"""Regroup training TP/PP shards into a rollout engine's layout, moving only missing bytes.

layouts.py describes who holds which canonical rows (training and every rollout layout),
plan.py turns two layouts into a deterministic transfer plan (pure, identical on every rank),
execute.py runs it with bucketed point-to-point messages and streams the shards, delivery.py
gives the HF-named full-tensor form, full_gather.py is the peers' baseline for benchmarks and
dry_run.py sizes a job before launch.
"""

from .execute import DEFAULT_BUCKET_BYTES, Resharder
from .layouts import ENGINES, RolloutLayout, ShardSpec, TrainingLayout
from .plan import PlanError, ReshardPlan, build_plan, make_rollout_layout

__all__ = ["DEFAULT_BUCKET_BYTES", "ENGINES", "PlanError", "ReshardPlan", "Resharder",
           "RolloutLayout", "ShardSpec", "TrainingLayout", "build_plan", "make_rollout_layout"]
