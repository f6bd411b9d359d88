"""Reading other toolkits' configurations into plait recipes (``plait import-nxdt``)."""
