"""Model definitions. Model files hold no distributed code; see ``<model>/parallelize.py``."""
