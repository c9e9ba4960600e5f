"""Pipeline parallelism: `PipelineStrategy` cuts a Keras model into stages on devices.

Modules, one mechanism each:
- `strategy`: `PipelineStrategy` (options, `split` / `merge` / `report`);
- `model`: `PipelinedModel`, the `keras.Model` whose `train_step` runs the schedule;
- `step`: one batch's forwards and backwards as one dataflow graph;
- `schedules`: the schedule registry, op kinds, stage -> device map, bubble arithmetic;
- `timeline`: the profiled timeline of one step and its Gantt chart;
- `plan`: the planning report: memory per device, bytes between devices per step.
"""

from tfscale.strategies.pipeline.model import PipelinedModel
from tfscale.strategies.pipeline.plan import DevicePlan, PlanReport
from tfscale.strategies.pipeline.schedules import SCHEDULES, Kind
from tfscale.strategies.pipeline.strategy import PipelineStrategy
from tfscale.strategies.pipeline.timeline import PipelineTrace
from tfscale.strategies.pipeline.timeline import plot as plot_timeline

__all__ = [
    "SCHEDULES",
    "DevicePlan",
    "Kind",
    "PipelineStrategy",
    "PipelineTrace",
    "PipelinedModel",
    "PlanReport",
    "plot_timeline",
]
