"""Data: built-in corpora, tokenizers and fixed-length token sequences."""
