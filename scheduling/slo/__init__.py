"""SLOs of agent jobs: what a job asks of the engine (:mod:`.spec`), how often a replay met it
(:mod:`.attainment`), and what the predictor says it will meet without replaying (:mod:`.model`)."""
from scheduling.slo.spec import DEFAULT_SLO, SLOSpec, parse_slo

__all__ = ["SLOSpec", "DEFAULT_SLO", "parse_slo"]
