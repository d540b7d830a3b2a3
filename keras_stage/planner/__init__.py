"""SmartStage's planner: what part of a model runs inside the stage."""

from keras_stage.planner.planner import StageSplit as StageSplit
from keras_stage.planner.planner import plan_model as plan_model
from keras_stage.planner.stage_plan import BoundaryTensor as BoundaryTensor
from keras_stage.planner.stage_plan import StagePlan as StagePlan

__all__ = ["BoundaryTensor", "StagePlan", "StageSplit", "plan_model"]
