"""The generic decoder every model family derives from: its config (:mod:`.config`), its model
(:mod:`.model`) and the per-rank shapes its tensor-parallel plan gives the planner (:mod:`.shapes`).

Nothing is imported here, so that reading a config loads no more than the config module.
"""
