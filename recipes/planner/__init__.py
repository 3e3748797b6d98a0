"""The planner: memory, communication and step time of any layout of a recipe config, predicted per rank from the
runtime's own objects on the meta device, and a search over layouts. `estimate(cfg, cluster, world)` is the
function API; `python -m recipes.plan` the command line."""

from recipes.planner.cluster import Cluster, load_cluster
from recipes.planner.predict import RankEstimate, estimate

__all__ = ["Cluster", "RankEstimate", "estimate", "load_cluster"]
