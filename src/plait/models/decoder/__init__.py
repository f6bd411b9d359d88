"""The generic decoder every model family derives from: its config (:mod:`.config`) and its model
(:mod:`.model`).

Nothing is imported here, so that reading a config loads no more than the config module.
"""
